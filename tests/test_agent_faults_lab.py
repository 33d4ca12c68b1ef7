"""The agent's faults of docs/reliability.md that tests/test_agent_drift.py does not cover, in CI:
the real agent (`python3 -m netagent run`, resync 10 minutes) in the namespace lab, asserted on
the kernel, never on time.

- kill -9 during an apply of 100 new pods: tc goes first, then the rules (one iptables-restore
  transaction per family) and the pods' set entries, so no pod is classified into a class the
  kernel lacks, the old pod's rules stay; the restarted agent finishes.
- the xtables lock held by another process (the legacy backend takes it; iptables-nft does not):
  a new pod is shaped anyway (its address goes into an ipset: no lock), what is programmed
  stays; the rules themselves wait for the lock (/readyz 503 meanwhile, nothing half written)
  and arrive once it frees.

bench/faults_agent.py measures the same faults under traffic for the table's figures.
"""
from __future__ import annotations

import time

import pytest

from lab.agentproc import (AgentProcess, classified_into_missing_classes, iptables_text, pod_object, tc_classes,
                           wait_for, write_objects)
from lab.faults import hold_xtables_lock, release
from lab.netns import require_root, run
from lab.topology import Lab

pytestmark = [pytest.mark.root]

POLICY = [
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": "bronze"},
     "spec": {"weight": 1, "max": "20M"}},
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressBudget", "metadata": {"name": "default"},
     "spec": {"total": "1G", "teams": [{"name": "team-a", "namespaces": ["team-a"], "defaultClass": "bronze"}]}},
]
EXTRA = 100
# past iptables-restore's own 5 s wait for the lock and the agent's retry after it (bench: 30 s)
LOCK_HELD_S = 15


@pytest.fixture
def lab_node(tmp_path):
    require_root()
    with Lab(nodes=1, pods_per_node=2, ipv6=False) as lab:
        node = lab.nodes[0]
        write_objects(tmp_path / "policy.yaml", POLICY)
        write_objects(tmp_path / "pods.yaml", [pod_object(node.pods[0], node)])
        yield lab, node, tmp_path


def extra_pods(node) -> list[dict]:
    return [{**pod_object(node.pods[0], node, name=f"extra-{i}"),
             "status": {"phase": "Running", "podIP": f"10.244.0.{100 + i}", "podIPs": [{"ip": f"10.244.0.{100 + i}"}]}}
            for i in range(EXTRA)]


def extra_rules(text: str) -> int:
    return sum(f"10.244.0.{100 + i}/" in text or f"10.244.0.{100 + i} " in text for i in range(EXTRA))


def settled(read, interval: float = 0.3) -> str:
    """`read()` once two reads `interval` apart agree: an ipset or iptables-restore the killed agent
    started may still be running (it is not killed with it)."""
    last = read()
    while True:
        time.sleep(interval)
        now = read()
        if now == last:
            return now
        last = now


def appended(save: str) -> list[str]:
    """The rules of an iptables-save (its header and chain lines carry counters and times)."""
    return [line for line in save.splitlines() if line.startswith("-A")]


def test_kill9_during_an_apply_leaves_old_or_new_rules_never_half(lab_node):
    lab, node, files = lab_node
    agent = AgentProcess(lab, node, [files], port=9581, log_dir=files, resync=600, learn_uplink=True).start()
    try:
        agent.wait_ready()
        wait_for(lambda: node.pods[0].ip4 in iptables_text(node.netns), what="the first pod's rules")
        write_objects(files / "pods.yaml", [pod_object(node.pods[0], node)] + extra_pods(node))
        # tc goes first: kill as soon as new classes show, between tc and iptables or inside the
        # iptables-restore transaction
        wait_for(lambda: len(tc_classes(node.netns)) > 10, timeout=30, interval=0.002, what="the apply under way")
        agent.kill9()
        text = settled(lambda: iptables_text(node.netns))
        rules = extra_rules(text)
        print(f"at the kill: {len(tc_classes(node.netns))} tc classes, {rules} of {EXTRA} new pods classified")
        # The rules are one iptables-restore transaction; the pods' addresses go into the counted ipsets
        # member by member, after their classes: each pod is whole (its entry and its class) or absent.
        assert not classified_into_missing_classes(node.netns), "a pod classified into a class the kernel lacks"
        assert node.pods[0].ip4 in text and "-j NETAGENT" in text, "the old pod's rules went with the kill"
        agent.start()
        agent.wait_ready()
        wait_for(lambda: extra_rules(iptables_text(node.netns)) == EXTRA, timeout=60, what="the rest applied")
    finally:
        print(agent.log()[-3000:])
        agent.close()


def test_xtables_lock_held_keeps_shaping_and_applies_when_it_frees(lab_node):
    """A new pod needs no iptables write (its address goes into an ipset, which takes no xtables
    lock): it is shaped while the lock is held. The rules themselves (an agent starting on a node
    where another process holds the lock) wait for it: not ready meanwhile, nothing half written."""
    lab, node, files = lab_node
    save = ["iptables-legacy-save", "-t", "mangle"]
    agent = AgentProcess(lab, node, [files], port=9582, log_dir=files, resync=600, learn_uplink=True,
                         extra=["--iptables-backend", "legacy"])
    holder = hold_xtables_lock(LOCK_HELD_S)
    try:
        agent.start()
        wait_for(lambda: agent.get("/readyz")[0] == 503, timeout=LOCK_HELD_S, what="/readyz 503 while the lock is held")
        assert "NETAGENT" not in run(save, node.netns), "rules written under another process's lock"
        assert holder.poll() is None, "the lock was released before the agent was seen waiting for it"
        holder.wait(LOCK_HELD_S + 30)
        wait_for(lambda: "-j NETAGENT" in run(save, node.netns), timeout=30, what="the rules once the lock frees")
        wait_for(lambda: agent.get("/readyz")[0] == 200, timeout=30, what="ready once the rules are in")
        wait_for(lambda: node.pods[0].ip4 in iptables_text(node.netns), what="the first pod classified")
        classes = tc_classes(node.netns)
        rules = run(save, node.netns)

        holder = hold_xtables_lock(LOCK_HELD_S)
        write_objects(files / "pods.yaml", [pod_object(p, node) for p in node.pods[:2]])
        wait_for(lambda: node.pods[1].ip4 in iptables_text(node.netns) and len(tc_classes(node.netns)) > len(classes),
                 timeout=LOCK_HELD_S, what="the new pod classified and its class made while the lock is held")
        assert holder.poll() is None, "the lock was released before the new pod was seen shaped"
        assert set(classes) <= set(tc_classes(node.netns)), "shaping was lost while the lock was held"
        assert appended(run(save, node.netns)) == appended(rules), "the rules changed under the lock"
        assert agent.get("/readyz")[0] == 200
    finally:
        release(holder)
        print(agent.log()[-3000:])
        agent.close()
