"""The real agent on a lab node with 110 pods, file mode: how fast it reacts, what it costs.

Figures (all in the same run, same node):
- reaction: a pod's kubernetes.io/egress-bandwidth edited in the YAML file (atomic rename) -> the new ceil readable in
  the kernel (tc over netlink, polled every ~2 ms), p50/p99; against the baseline of applying
  that one class change directly with `tc class change` (the kernel's own cost). The file
  source is woken by inotify (it polled modification times every 0.1 s before);
- agent CPU (% of one core, the iptables/ipset tools it runs included) and RSS over a steady window with a /metrics scrape every 10 s,
  local allocation every 2 s, sampling every 1 s and the default 30 s resync; then the same with
  the real controller (`netagent controller --no-auth`) and reports every 5 s, scraped every 10 s and every 1 s
  (the counters are read once per report period whatever the scrape rate);
- scrape duration of /metrics and /state (110 pods), p50/p99; against the baseline of exec'ing
  `iptables-save -c -t mangle` twice (IPv4, IPv6) and `tc -s class show`, what a shell-out
  exporter pays for the same counters;
- one read of the byte counters (`Classifier.counters`, the rules and ipsets the agent programmed
  for the pods) in-process over netlink and with the tools (`ipset save`, `iptables-save -c` x2),
  CPU (this process and the tools it waits for) and wall time per read, alternated.

    sudo python3 bench/agent.py [--pods 110] [--changes 60] [--window 30] [--internal-counting rules|device]

`--internal-counting device` runs the agent counting internal bytes on the pods' devices (eBPF, its
map in a bpf filesystem the bench mounts, the service CIDR given as the agent then needs).
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lab.netns import bpf_filesystem  # noqa: E402
from lab.topology import Lab  # noqa: E402
from netagent.desired import DataPathOptions, PodShape, assign_minors, from_wire  # noqa: E402
from iptables.apply import Classifier  # noqa: E402
from tc.netlink import Shaper  # noqa: E402
from bench.timing import pct, timed_ms  # noqa: E402
from lab.agentproc import IFB, AgentProcess, pod_object, wait_for, write_objects  # noqa: E402

M = 1_000_000
CLASSES = {"bronze": 20 * M, "silver": 60 * M}
POLICY = [
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": name},
     "spec": {"weight": 1, "max": str(rate)}} for name, rate in CLASSES.items()
] + [
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressBudget", "metadata": {"name": "default"},
     "spec": {"total": "100G", "teams": [{"name": "team-a", "namespaces": ["team-a"], "defaultClass": "bronze"}]}},
]


def cpu_seconds(pid: int) -> float:
    """User + system time of the agent and of the tools it ran and waited for (iptables-save, ipset)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def own_cpu_s() -> float:
    """User + system time of this process and of the children it waited for."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def counter_reads(netns: str, rounds: int = 10, per_round: int = 5) -> dict[str, tuple[float, float]]:
    """source -> (CPU ms per read, p50 wall ms) of `Classifier.counters`, netlink and exec alternated."""
    clf = Classifier(netns=netns)
    assert clf.counters("netlink") == clf.counters("exec"), "the two reads differ"
    cpu: dict[str, float] = {"netlink": 0.0, "exec": 0.0}
    wall: dict[str, list[float]] = {"netlink": [], "exec": []}
    for _ in range(rounds):
        for source in cpu:
            c0 = own_cpu_s()
            wall[source] += timed_ms(lambda: clf.counters(source), per_round)
            cpu[source] += own_cpu_s() - c0
    clf.close()
    return {source: (1000 * cpu[source] / (rounds * per_round), pct(wall[source], 50)) for source in cpu}


def syncs(agent: AgentProcess) -> tuple[float, float]:
    """(reconciles so far, seconds they took) from the agent's own histogram."""
    return (agent.metric("netagent_reconcile_duration_seconds_count"),
            agent.metric("netagent_reconcile_duration_seconds_sum"))


def steady_cpu(agent: AgentProcess, window: float, scrape_every: float = 10.0) -> tuple[float, float, str]:
    """(% of one core, RSS MiB, what the agent reconciled meanwhile) over `window` seconds with a scrape
    every `scrape_every` s."""
    pid = agent.proc.pid
    s0 = syncs(agent)
    c0, t0 = cpu_seconds(pid), time.monotonic()
    next_scrape = t0
    while time.monotonic() - t0 < window:
        if time.monotonic() >= next_scrape:
            agent.get("/metrics")
            next_scrape += scrape_every
        time.sleep(0.2)
    c1, t1 = cpu_seconds(pid), time.monotonic()
    s1 = syncs(agent)
    n, took = s1[0] - s0[0], s1[1] - s0[1]
    return 100 * (c1 - c0) / (t1 - t0), rss_mib(pid), f"{n:.0f} reconciles, {1000 * took / max(n, 1):.0f} ms each"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=110)
    ap.add_argument("--changes", type=int, default=60)
    ap.add_argument("--window", type=float, default=30.0, help="seconds of steady state for CPU")
    ap.add_argument("--internal-counting", choices=("rules", "device"), default="rules",
                    help="the agent's --internal-counting (device: in a bpf filesystem the bench mounts)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespaces)")
        return 2
    work = Path(tempfile.mkdtemp(prefix="netagent-bench-"))
    if args.internal_counting == "rules":
        return run(args, work, ["--internal-counting", "rules"])
    with bpf_filesystem() as root:
        return run(args, work, ["--internal-counting", "device", "--bpf-dir", os.path.join(root, "netagent"),
                                "--service-cidr", "10.96.0.0/12"])


def run(args, work: Path, counting: list[str]) -> int:
    t_build = time.monotonic()
    with Lab(nodes=1, pods_per_node=args.pods) as lab:
        node = lab.nodes[0]
        print(f"lab: 1 node, {args.pods} pods, built in {time.monotonic() - t_build:.1f} s")
        minors = {p.name: assign_minors([PodShape("x", (p.ip4, p.ip6), 1, 1)])["x"] for p in node.pods}
        caps: dict[str, str] = {}  # pod -> kubernetes.io/egress-bandwidth

        def write() -> float:
            """Replace the pods file atomically; returns the moment the new content is in place."""
            tmp = work / "pods.tmp"
            tmp.write_text(yaml.dump_all([pod_object(p, node, annotations={
                "netagent.io/egress-class": "bronze",
                **({"kubernetes.io/egress-bandwidth": caps[p.name]} if p.name in caps else {})}) for p in node.pods],
                Dumper=yaml.CSafeDumper))
            os.replace(tmp, work / "pods.yaml")
            return time.perf_counter()
        write_objects(work / "policy.yaml", POLICY)
        write()
        agent = AgentProcess(lab, node, [work / "policy.yaml", work / "pods.yaml"], port=9590, log_dir=work,
                             resync=30.0, extra=counting).start()
        shaper = Shaper(node.netns)
        try:
            agent.wait_ready(60)

            def ceils():
                return {m: from_wire(st.ceil_bytes * 8, DataPathOptions()) for m, st in shaper.stats(IFB).items()}
            wait_for(lambda: all(ceils().get(m) == CLASSES["bronze"] for m in minors.values()), 60, 0.1,
                     "all pods programmed")

            # -- reaction: annotation edited in the file -> kernel ---------------------------------
            reaction = []
            for i in range(args.changes):
                pod = node.pods[i % len(node.pods)]
                caps[pod.name] = "15M" if caps.get(pod.name) == "10M" else "10M"
                want, minor = int(caps[pod.name][:-1]) * M, minors[pod.name]
                time.sleep(0.05 + (i % 7) * 0.03)  # land at different phases of the file poll
                t0 = write()
                while True:
                    st = shaper.stats(IFB).get(minor)
                    if st and from_wire(st.ceil_bytes * 8, DataPathOptions()) == want:
                        break
                    if time.perf_counter() - t0 > 30:
                        raise RuntimeError(f"pod {pod.name}: ceil {want} never applied; see {agent.log_path}")
                    time.sleep(0.002)
                reaction.append((time.perf_counter() - t0) * 1000)
            probe_minor = minors[node.pods[0].name]

            def direct_change():
                subprocess.run(["ip", "netns", "exec", node.netns, "tc", "class", "change", "dev", IFB,
                                "parent", "1:1", "classid", f"1:{probe_minor:x}", "htb", "rate", "8kbit",
                                "ceil", "20mbit", "burst", "67050b", "cburst", "67050b"], check=True,
                               capture_output=True)
            baseline = timed_ms(direct_change, 20)
            print(f"reaction, egress-bandwidth annotation edited in the file -> kernel ({args.changes} changes, {args.pods} pods): "
                  f"p50 {pct(reaction, 50):.0f} ms, p99 {pct(reaction, 99):.0f} ms, max {max(reaction):.0f} ms "
                  f"(aim p99 <= 1000 ms); baseline `tc class change` exec'd directly: p50 {pct(baseline, 50):.1f} ms "
                  f"(ratio p50 {pct(reaction, 50) / pct(baseline, 50):.0f}x, the file source is woken by inotify)")
            time.sleep(3)  # let the agent repair the class the baseline changed behind its back

            # -- scrape ------------------------------------------------------------------------
            time.sleep(1.1)  # the first scrape after a second reads the byte counters; the rest share them
            first = timed_ms(lambda: agent.get("/metrics"), 1)
            scrape = timed_ms(lambda: agent.get("/metrics"), 30)
            state = timed_ms(lambda: agent.get("/state"), 30)

            def shell_exporter():
                for argv in (["iptables-save", "-c", "-t", "mangle"], ["ip6tables-save", "-c", "-t", "mangle"],
                             ["tc", "-s", "class", "show", "dev", IFB]):
                    subprocess.run(["ip", "netns", "exec", node.netns, *argv], check=True, capture_output=True)
            shell = timed_ms(shell_exporter, 30)
            size = len(agent.get("/metrics")[1])
            print(f"scrape /metrics ({size // 1024} KiB): first after 1 s {first[0]:.1f} ms, then p50 {pct(scrape, 50):.1f} ms, "
                  f"p99 {pct(scrape, 99):.1f} ms (aim <= 20 ms); "
                  f"/state p50 {pct(state, 50):.1f} ms; baseline shell-out of the same counters: "
                  f"p50 {pct(shell, 50):.1f} ms (ratio {pct(scrape, 50) / pct(shell, 50):.2f})")

            reads = counter_reads(node.netns)
            print(f"byte counters, one read ({args.pods} pods, {Classifier(netns=node.netns).backend} backend): "
                  f"netlink CPU {reads['netlink'][0]:.1f} ms, p50 {reads['netlink'][1]:.1f} ms; "
                  f"exec (ipset save, iptables-save -c x2) CPU {reads['exec'][0]:.1f} ms, p50 {reads['exec'][1]:.1f} ms")

            # -- steady-state cost ---------------------------------------------------------------
            cpu, rss, did = steady_cpu(agent, args.window)
            print(f"agent, local allocation, {args.pods} pods, scrape every 10 s: CPU {cpu:.2f}% of a core "
                  f"(aim <= 2%), RSS {rss:.0f} MiB (aim <= 64 MiB); {did} in {args.window:g} s")
        finally:
            shaper.close()
            agent.close()

        # -- the same node reporting to the real controller every 5 s ---------------------------
        controller_log = open(work / "controller.log", "w")
        lab.spawn(node.netns, [sys.executable, "-m", "cli.main", "controller", "--from-file", str(work / "policy.yaml"),
                               "--no-auth", "--insecure-http", "--listen", "127.0.0.1:9591"], stdout=controller_log,
                  stderr=subprocess.STDOUT)
        agent = AgentProcess(lab, node, [work / "policy.yaml", work / "pods.yaml"], port=9592, log_dir=work,
                             resync=30.0, extra=["--controller", "http://127.0.0.1:9591", "--controller-insecure-http", "--report-period", "5",
                                                 "--token-path", str(work / "no-token"), *counting]).start()
        try:
            agent.wait_ready(60)
            wait_for(lambda: (agent.state() or {}).get("allocation_source") == "controller", 30, 0.2, "an answer")
            for every in (10.0, 1.0):
                cpu, rss, did = steady_cpu(agent, args.window, every)
                print(f"agent, controller reports every 5 s, {args.pods} pods, scrape every {every:g} s: CPU {cpu:.2f}% "
                      f"of a core (aim <= 1%), RSS {rss:.0f} MiB (aim <= 64 MiB); {did} in {args.window:g} s")
        finally:
            agent.close()
    print(f"logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
