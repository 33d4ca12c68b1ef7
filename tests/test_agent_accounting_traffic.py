"""Issue 34: the real agent counts a pod's internet bytes where they are billed (root; real traffic).

`python3 -m netagent run` in a lab node (routed and bridged pod networks), one pod capped at
8 Mbit/s both ways. Each test moves traffic with iperf3 and compares what the agent shows in
/state (the same numbers /metrics exports) with what reached the receiver, in L3 bytes (a counting
rule in the receiver's INPUT, checked against iperf3's receiver):
- UDP (1400-byte datagrams, so the L3 bytes are exact): a flood at 200 Mbit/s, 25x the cap.
  Uploads: `egress_bytes.internet` (as they left the pod's shaper) within 2 % of the datagrams
  the far end received; `dropped_bytes` within 2 % of what the shaper dropped (its own drop count
  in packets, read from the kernel, times the datagram's L3 size). Downloads: `ingress_bytes`
  (as they arrived) within 2 % of what crossed the uplink (the uplink's own counters) and
  `ingress_delivered_bytes` of what the pod received; drops as for uploads. The node totals and
  the pod's internet counter agree with the uplink's interface counters.
- TCP at the cap (one flow) and above it (four flows): the pod's counter against the payload that
  reached the far end (a counting rule in its INPUT, headers taken off) in segments (each MSS with
  the MTU's headers); iperf3's receiver read at least 90 % of that payload less a second of the cap
  (the rest: retransmitted copies and the queue's tail after its end, both of which crossed the uplink).
  In the same run the pod's and the node's internet counters, both ways (data and ACKs), agree with
  the uplink's interface counters. The device counter's at-cap uploads are skipped (CI time): the four-
  flow runs read the same counters. The at-cap download is also the segments test's run: one TCP run
  per (direction, family, flows) and agent, shared by the tests that read it (`tcp_run`).
- A kill -9 of the agent in the middle of a flood: the counter after the restart goes on from
  the kernel's class counter; the whole flood counted once (within 2 %). The restart and upgrade tests run
  on the routed topology only, under both counters (`restarts_on_one_topology`, CI time).
Transfers are a few seconds each; run under `flock /tmp/netagent-traffic.lock`.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys

import pytest

from lab.agentproc import AgentProcess, pod_object, wait_for, write_objects
from lab.netns import bpf_filesystem, require_root
from lab.topology import INTERNET_V4, INTERNET_V6, UPLINK, Lab, run
from netagent.datapath import CARRY_SET

pytestmark = [pytest.mark.root, pytest.mark.traffic]

M = 1_000_000
CAP = 8 * M
FLOOD = "200M"
RUN_S = 3
QUEUE_S = 1.0  # what may still arrive after iperf3's receiver stops, in seconds of the cap
DATAGRAM = 1400
UDP_HEADERS = {4: 20 + 8, 6: 40 + 8}
MTU = 1500
TOLERANCE = 0.02
PORT = 5341
POLICY = [
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": "capped"},
     "spec": {"weight": 1, "max": "8M", "ingress": {"weight": 1, "max": "8M"}}},
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressBudget", "metadata": {"name": "default"},
     "spec": {"total": "1G", "ingressTotal": "1G",
              "teams": [{"name": "team-a", "namespaces": ["team-a"], "defaultClass": "capped"}]}},
]


@pytest.fixture(scope="module", params=["routed", "bridge"])
def lab(request):
    require_root()
    with Lab(nodes=1, pods_per_node=1, pod_network=request.param) as lab:
        # a queue on the internet host's device counts what it sent in segments (qdisc_pkt_len): `wire`
        run("tc qdisc replace dev eth0 root pfifo limit 10000", lab.internet)
        lab.iperf_server(lab.internet, PORT)
        yield lab


@pytest.fixture(scope="module")
def bpffs():
    with bpf_filesystem() as root:
        yield root


@pytest.fixture(scope="module", params=["rules", "device"])
def agent(request, lab, bpffs, tmp_path_factory):
    """The agent counting internal bytes by the rules or on the pods' devices (eBPF): the internet
    counters come from the shaper's classes either way, and must say the same."""
    d = tmp_path_factory.mktemp("accounting")
    node = lab.nodes[0]
    write_objects(d / "policy.yaml", POLICY)
    write_objects(d / "pods.yaml", [pod_object(node.pods[0], node)])
    counting = ["--internal-counting", request.param, "--bpf-dir", os.path.join(bpffs, "netagent"),
                "--service-cidr", "10.96.0.0/16"]
    a = AgentProcess(lab, node, [d], port=9581, log_dir=d,
                     extra=["--default-rate", "1M", "--ingress-default-rate", "1M", *counting]).start()
    a.counting = request.param
    a.tcp_runs = {}  # (direction, family, flows) -> one measured TCP run, shared by the tests that read it
    try:
        a.wait_ready()
        wait_for(lambda: (a.pod(node.pods[0].name) or {}).get("ingress_limit_bps") == CAP, what="pod capped")
        yield a
    finally:
        print(a.log())
        a.close()
        run([sys.executable, "-m", "netagent", "cleanup", "--bpf-dir", os.path.join(bpffs, "netagent")], node.netns,
            check=False)


def uplink(netns: str) -> dict[str, int]:
    """The uplink's own counters, in L3 bytes (a frame's bytes less its Ethernet header)."""
    s = json.loads(run(["ip", "-s", "-j", "link", "show", UPLINK], netns))[0]["stats64"]
    return {"tx": s["tx"]["bytes"] - 14 * s["tx"]["packets"], "rx": s["rx"]["bytes"] - 14 * s["rx"]["packets"]}


def wire(netns: str) -> int:
    """The L3 bytes the internet host sent, each segment with its headers, as its wire carried them: its
    queue counts a GSO packet as its segments (bytes: each one's frame; packets: segments). On the node's
    uplink the same download is fewer, larger packets with one header each."""
    q = json.loads(run(["tc", "-s", "-j", "qdisc", "show", "dev", "eth0", "root"], netns))[0]
    return q["bytes"] - 14 * q["packets"]


def class_drops(netns: str, ifb: str, minor: int) -> int:
    """The shaper's own count of the packets it dropped for the pod's class (tc, not the agent)."""
    out = run(["tc", "-s", "class", "show", "dev", ifb], netns)
    total = 0
    for block in out.split("\nclass ")[0:]:  # the pod's class and its leaves (handle or parent 1:<minor>)
        m = re.match(r"(?:class )?htb \w+:(\w+) parent \w+:(\w+)", block)
        d = re.search(r"\(dropped (\d+),", block)
        if m and d and f"{minor:x}" in m.groups():
            total += int(d.group(1))
    return total


@contextlib.contextmanager
def far_end(netns: str, family: int, match: str, proto: str = "udp"):
    """A counting rule in the receiver's INPUT: the L3 bytes that reached the far end, those that
    arrived after iperf3's receiver stopped counting too (a shaper's queue drains after the sender's
    end, and the end message goes ahead of it in the pod's small-packet class). Removed on exit."""
    tool = "iptables" if family == 4 else "ip6tables"
    rule = f"INPUT -p {proto} {match} -m comment --comment netagent-test-far-end"
    run(f"{tool} -w -I {rule}", netns)
    try:
        def read(packets: bool = False) -> int:
            out = run(f"{tool} -w -nvxL INPUT", netns)
            return sum(int(line.split()[0 if packets else 1]) for line in out.splitlines()
                       if "netagent-test-far-end" in line)
        yield read
    finally:
        run(f"{tool} -w -D {rule}", netns)


def settled(agent: AgentProcess, name: str) -> dict:
    """The pod's numbers once they stopped moving (the sampler reads each second)."""
    last: list = [None]

    def still():
        p = agent.pod(name)
        key = (p["egress_bytes"]["internet"], p["ingress_bytes"]["internet"], p["ingress_delivered_bytes"],
               p["dropped_bytes"], p["ingress_dropped_bytes"])
        same, last[0] = key == last[0], key
        return p if same else None
    return wait_for(still, 20, 1.5, "counters settled")


def snapshot(lab: Lab, agent: AgentProcess) -> dict:
    node = lab.nodes[0]
    p = settled(agent, node.pods[0].name)
    st = agent.state()
    minor = p["minor"]
    return {"pod": p, "node_egress": st["egress_bytes"]["internet"], "node_ingress": st["ingress_bytes"]["internet"],
            "uplink": uplink(node.netns), "wire": wire(lab.internet), "up_drops": class_drops(node.netns, "netagent0", minor),
            "down_drops": class_drops(node.netns, "netagent-in", minor)}


def agrees_with_the_uplink(before: dict, after: dict, agent: AgentProcess) -> None:
    """The pod's and the node's internet counters against the uplink in the same run, both directions (a
    TCP run's data one way, its ACKs the other). Uploads left the uplink as segments (the class counts
    segments): its own tx counter. Downloads arrived GRO-merged, a packet of several segments with one
    header: the device counter counts each segment's headers, so its arrivals are the internet's wire
    (`wire`); the rules (the fallback) count the packets as the uplink's own rx counter does."""
    up = {k: after["uplink"][k] - before["uplink"][k] for k in ("tx", "rx")}
    pod = {k: after["pod"][k]["internet"] - before["pod"][k]["internet"] for k in ("egress_bytes", "ingress_bytes")}
    near(pod["egress_bytes"], up["tx"], "pod's internet upload vs the uplink's tx")
    near(after["node_egress"] - before["node_egress"], up["tx"], "node's internet upload vs the uplink's tx")
    if agent.counting == "device":
        rx, what = after["wire"] - before["wire"], "the uplink's rx in segments"
    else:
        rx, what = up["rx"], "the uplink's rx (the rules: merged packets)"
    near(pod["ingress_bytes"], rx, f"pod's internet download (arrived) vs {what}")
    near(after["node_ingress"] - before["node_ingress"], rx, f"node's internet download vs {what}")


def near(counted: float, truth: float, what: str) -> None:
    print(f"{what}: {counted:.0f} B against {truth:.0f} B ({(counted - truth) / truth:+.2%})")  # the docs' figures (-s)
    assert abs(counted - truth) <= TOLERANCE * truth, f"{what}: counted {counted:.0f} B, truth {truth:.0f} B " \
                                                      f"({(counted - truth) / truth:+.2%})"


@pytest.mark.parametrize("family", [4, 6])
@pytest.mark.parametrize("direction", ["upload", "download"])
def test_a_udp_flood_above_the_cap_is_counted_as_delivered_and_dropped(lab, agent, direction, family):
    node, pod = lab.nodes[0], lab.nodes[0].pods[0]
    dst = INTERNET_V4 if family == 4 else INTERNET_V6
    receiver, match = (lab.internet, f"--dport {PORT}") if direction == "upload" else (pod.netns, f"--sport {PORT}")
    with far_end(receiver, family, match) as far:
        before = snapshot(lab, agent)
        result = lab.iperf(pod.netns, dst, PORT, seconds=RUN_S, udp_bitrate=FLOOD, reverse=direction == "download")
        after = snapshot(lab, agent)
        got = far()
    d = {k: after["pod"][k] - before["pod"][k] for k in ("dropped_bytes", "ingress_dropped_bytes",
                                                         "ingress_delivered_bytes")}
    l3 = DATAGRAM + UDP_HEADERS[family]
    # what the far end got: the receiver's datagrams (sent less lost, as the receiver counted them)
    rx = result["end"]["sum_received"]
    received = (rx["packets"] - rx["lost_packets"]) * l3
    # iperf3's receiver got all but the shaper queue's tail (at most ~100 ms at the cap)
    assert received <= got <= received + 0.1 * CAP / 8 + 10 * l3, (received, got)
    received = got
    up = {k: after["uplink"][k] - before["uplink"][k] for k in ("tx", "rx")}
    if direction == "upload":
        sent = after["pod"]["egress_bytes"]["internet"] - before["pod"]["egress_bytes"]["internet"]
        near(sent, received, "pod's internet upload vs the far end")
        shaper_dropped = (after["up_drops"] - before["up_drops"]) * l3
        assert shaper_dropped > 10 * received, "the flood was not above the cap"
        near(d["dropped_bytes"], shaper_dropped, "pod's dropped upload bytes vs the shaper's drops")
        near(after["node_egress"] - before["node_egress"], up["tx"], "node's internet upload vs the uplink's tx")
        near(sent, up["tx"], "pod's internet upload vs the uplink's tx")
    else:
        arrived = after["pod"]["ingress_bytes"]["internet"] - before["pod"]["ingress_bytes"]["internet"]
        near(arrived, up["rx"], "pod's internet download (arrived) vs the uplink's rx")
        near(after["node_ingress"] - before["node_ingress"], up["rx"], "node's internet download vs the uplink's rx")
        near(d["ingress_delivered_bytes"], received, "pod's delivered download vs the far end")
        shaper_dropped = (after["down_drops"] - before["down_drops"]) * l3
        assert shaper_dropped > 10 * received, "the flood was not above the cap"
        near(d["ingress_dropped_bytes"], shaper_dropped, "pod's dropped download bytes vs the shaper's drops")
        near(d["ingress_delivered_bytes"] + d["ingress_dropped_bytes"], arrived, "arrived = delivered + dropped")


def tcp_run(lab: Lab, agent: AgentProcess, direction: str, family: int, flows: int) -> dict:
    """One TCP run (iperf3 with `flows` flows) between the pod and the internet host, with the snapshots
    around it and the far end's counting rule: measured once per agent and shared by every test that
    reads it (the at-cap download is the segments test's run too), so no test moves the same traffic
    twice. A run that failed is not kept: the next test measures again."""
    key = (direction, family, flows)
    if key not in agent.tcp_runs:
        pod = lab.nodes[0].pods[0]
        dst = INTERNET_V4 if family == 4 else INTERNET_V6
        receiver, match = (lab.internet, f"--dport {PORT}") if direction == "upload" else (pod.netns, f"--sport {PORT}")
        with far_end(receiver, family, match, "tcp") as far:
            before = snapshot(lab, agent)
            result = lab.iperf(pod.netns, dst, PORT, seconds=RUN_S, reverse=direction == "download",
                               extra=["-P", str(flows)])
            after = snapshot(lab, agent)
            got, packets = far(), far(packets=True)
        agent.tcp_runs[key] = {"before": before, "after": after, "result": result, "got": got, "packets": packets}
    return agent.tcp_runs[key]


@pytest.mark.parametrize("flows", [1, 4], ids=["at-cap", "above-cap"])
@pytest.mark.parametrize("family", [4, 6])
@pytest.mark.parametrize("direction", ["upload", "download"])
def test_tcp_at_and_above_the_cap_is_counted_in_segments(lab, agent, direction, family, flows):
    if agent.counting == "device" and flows == 1 and direction == "upload":
        # the device counter changes where internal bytes and the node's arrived total are read, not the
        # classes or rules the TCP comparisons read: the four-flow run covers it, this one would repeat it
        # (the at-cap download stays: it is the segments test's run, measured once for both)
        pytest.skip("CI time: the device counter's TCP uploads are the four-flow ones (the same counters as at the cap)")
    run_ = tcp_run(lab, agent, direction, family, flows)
    before, after, result, got, packets = (run_[k] for k in ("before", "after", "result", "got", "packets"))
    mss = result["start"]["tcp_mss_default"]
    # the far end's rule counts a GRO/GSO packet once with one header (IP + TCP with timestamps): its
    # payload is exact; on the wire each MSS of it was a segment with the MTU's headers
    payload = got - packets * (MTU - mss)
    received = payload + math.ceil(payload / mss) * (MTU - mss)
    # iperf3's receiver read all of it but the retransmitted copies and what arrived after it stopped
    # reading: four flows above the cap still have their windows in flight then (a fresh-clone CI run
    # read 2.96 MB of 3.54 MB, 16 % short, where a bound of 10 % alone failed); a far-end rule that
    # counted anything else (another flow, each copy twice) still misses these bounds
    read = result["end"]["sum_received"]["bytes"]
    assert 0.9 * payload - QUEUE_S * CAP / 8 <= read <= payload, (read, payload)
    if direction == "upload":
        counted = after["pod"]["egress_bytes"]["internet"] - before["pod"]["egress_bytes"]["internet"]
    else:
        counted = after["pod"]["ingress_delivered_bytes"] - before["pod"]["ingress_delivered_bytes"]
    near(counted, received, f"pod's {direction} ({flows} flows) vs the far end in segments")
    agrees_with_the_uplink(before, after, agent)


SEGMENT_TOLERANCE = 0.005  # issue 38's quota: a team's use within 1 % of what iperf3 moved


@pytest.mark.parametrize("family", [4, 6])
def test_tcp_download_arrived_equals_the_uplink_in_segments(request, lab, agent, family):
    """The pod's and the node's arrived TCP download against the L3 bytes the internet host's wire carried
    as segments (`wire`: each with its headers, as a NAT gateway bills them; the uplink saw them merged).
    The device counter adds each merged segment's headers (tc/ebpf `_merged`); the rules, the fallback
    where it cannot run, count a merged packet once with one header: short by 1.5-2.7 % (docs/accounting.md),
    held by a strict xfail that turns red if they ever count segments."""
    if agent.counting == "rules":
        request.applymarker(pytest.mark.xfail(strict=True, reason="the rules (ipset counters) count a GRO-merged "
                                              "download once with one header, 1.5-2.7 % short of its segments"))
    run_ = tcp_run(lab, agent, "download", family, 1)  # the at-cap download's run, shared
    before, after = run_["before"], run_["after"]
    segments = after["wire"] - before["wire"]
    packets = after["uplink"]["rx"] - before["uplink"]["rx"]
    arrived = after["pod"]["ingress_bytes"]["internet"] - before["pod"]["ingress_bytes"]["internet"]
    node = after["node_ingress"] - before["node_ingress"]
    print(f"the uplink's rx {packets} B (merged packets) against the wire's {segments} B in segments "
          f"({(packets - segments) / segments:+.2%})")
    assert packets < (1 - SEGMENT_TOLERANCE) * segments, "nothing was merged: the test does not see what it is for"
    for counted, what in ((arrived, "pod's arrived download"), (node, "node's arrived download")):
        print(f"{what} vs the uplink in segments: {counted} B against {segments} B "
              f"({(counted - segments) / segments:+.2%}; {agent.counting})")
        assert abs(counted - segments) <= SEGMENT_TOLERANCE * segments, (what, counted, segments)


def restarts_on_one_topology(lab: Lab) -> None:
    """The restart and upgrade tests below run on the routed topology only, under both counters: what they
    test (the carry kept in the kernel, the counters adopted, the pinned segments map) is the same classes, sets
    and maps on either topology. The counting tests above run on both, and a restart on the bridge is held by
    tests/test_agent_device_counting_kernel.py and tests/test_agent_downloads_kernel.py."""
    if lab.pod_network != "routed":
        pytest.skip("CI time: a restart's carry and adoption are the same on the bridge (the counting tests run "
                    "on both topologies)")


def test_a_restart_in_the_middle_of_a_flood_counts_every_byte_once(lab, agent):
    restarts_on_one_topology(lab)
    pod = lab.nodes[0].pods[0]
    with far_end(lab.internet, 4, f"--dport {PORT}") as far:
        before = snapshot(lab, agent)
        out = flood_across_a_restart(lab, agent, pod, before)
        after = snapshot(lab, agent)
        got = far()
    rx = json.loads(out)["end"]["sum_received"]
    received = (rx["packets"] - rx["lost_packets"]) * (DATAGRAM + UDP_HEADERS[4])
    assert received <= got <= received + 0.1 * CAP / 8 + 10 * (DATAGRAM + UDP_HEADERS[4]), (received, got)
    near(after["pod"]["egress_bytes"]["internet"] - before["pod"]["egress_bytes"]["internet"], got,
         "upload across a restart vs the far end")


def test_a_restart_in_the_middle_of_a_download_counts_its_segments_once(lab, agent):
    """A TCP download with the agent killed (-9) and started again in its middle: the arrivals go on from
    what the kernel kept counting meanwhile (the ipsets; with the device counter also its pinned segments
    map, which the programs kept filling), so the whole download is counted once, against the wire in
    segments (device counter) or the uplink's merged packets (the rules)."""
    restarts_on_one_topology(lab)
    pod = lab.nodes[0].pods[0]
    before = snapshot(lab, agent)
    download = lab.iperf_async(pod.netns, INTERNET_V4, PORT, seconds=2 * RUN_S, extra=["-R"])
    try:
        start = before["pod"]["ingress_bytes"]["internet"]
        wait_for(lambda: agent.pod(pod.name)["ingress_bytes"]["internet"] > start + 1_000_000, what="download counted")
        shown = agent.pod(pod.name)["ingress_bytes"]["internet"]
        restart(agent)
        assert agent.pod(pod.name)["ingress_bytes"]["internet"] >= shown  # never backwards across the restart
        download.communicate(timeout=60)
    finally:
        if download.poll() is None:
            download.kill()
    after = snapshot(lab, agent)
    arrived = after["pod"]["ingress_bytes"]["internet"] - start
    truth, what = ((after["wire"] - before["wire"], "the wire in segments") if agent.counting == "device" else
                   (after["uplink"]["rx"] - before["uplink"]["rx"], "the uplink's rx"))
    print(f"download across a restart vs {what}: {arrived} B against {truth} B ({(arrived - truth) / truth:+.2%})")
    assert abs(arrived - truth) <= SEGMENT_TOLERANCE * truth, (arrived, truth)


def flood_across_a_restart(lab: Lab, agent: AgentProcess, pod, before: dict) -> str:
    """A 6 s flood with the agent killed (-9) and started again in its middle; iperf3's JSON."""
    flood = lab.iperf_async(pod.netns, INTERNET_V4, PORT, seconds=2 * RUN_S, udp_bitrate=FLOOD)
    try:
        start = before["pod"]["egress_bytes"]["internet"]
        wait_for(lambda: agent.pod(pod.name)["egress_bytes"]["internet"] > start + 1_000_000, what="flood counted")
        shown = agent.pod(pod.name)["egress_bytes"]["internet"]
        agent.kill9()
        agent.start()
        agent.wait_ready()
        assert agent.pod(pod.name)["egress_bytes"]["internet"] >= shown  # never backwards across the restart
        out, _ = flood.communicate(timeout=60)
        return out
    finally:
        if flood.poll() is None:
            flood.kill()


def pod_upload(agent: AgentProcess, name: str) -> int:
    return agent.pod(name)["egress_bytes"]["internet"]


def restart(agent: AgentProcess) -> None:
    agent.kill9()
    agent.start()
    agent.wait_ready()


def test_a_restart_after_a_class_was_made_again_goes_on_from_the_kept_carry(lab, agent):
    """The IFB deleted under the agent: it makes every class again (counters from zero); the pod's
    counter carries on, and a restart afterwards goes on from the carry kept in the kernel."""
    restarts_on_one_topology(lab)
    node, pod = lab.nodes[0], lab.nodes[0].pods[0]
    lab.iperf(pod.netns, INTERNET_V4, PORT, seconds=1, udp_bitrate="20M")
    shown = settled(agent, pod.name)["egress_bytes"]["internet"]
    run("ip link del netagent0", node.netns)
    wait_for(lambda: "netagent0" in run("ip -br link", node.netns) and agent.state()["ready"], what="IFB made again")
    assert settled(agent, pod.name)["egress_bytes"]["internet"] >= shown
    assert "netagent-carry" in run("ipset list -n", node.netns)
    restart(agent)
    after = settled(agent, pod.name)["egress_bytes"]["internet"]
    assert shown <= after <= shown + 100_000  # the iperf3 control connection's leftovers at most


def test_an_upgrade_goes_on_from_the_offered_count_the_agent_before_showed(lab, agent):
    """The agent before counted offered bytes and kept no carries: the first agent that counts sent
    bytes starts each pod from the offered count, then grows by what is sent; its next restart does
    not seed again."""
    restarts_on_one_topology(lab)
    from iptables.apply import Classifier
    node, pod = lab.nodes[0], lab.nodes[0].pods[0]
    lab.iperf(pod.netns, INTERNET_V4, PORT, seconds=1, udp_bitrate=FLOOD)  # throttled: offered >> sent
    sent = settled(agent, pod.name)["egress_bytes"]["internet"]
    agent.kill9()
    run(f"ipset destroy {CARRY_SET}", node.netns, check=False)  # the kernel as the agent before left it
    classifier = Classifier(netns=node.netns)
    try:
        old = classifier.counters()[0][f"team-a/{pod.name}"]["egress_internet"]  # what it showed
    finally:
        classifier.close()
    assert old > 2 * sent
    agent.start()
    agent.wait_ready()
    seeded = settled(agent, pod.name)["egress_bytes"]["internet"]
    assert old <= seeded <= old + 100_000
    restart(agent)
    assert seeded <= settled(agent, pod.name)["egress_bytes"]["internet"] <= seeded + 100_000
    before = snapshot(lab, agent)
    with far_end(lab.internet, 4, f"--dport {PORT}") as far:
        lab.iperf(pod.netns, INTERNET_V4, PORT, seconds=RUN_S, udp_bitrate=FLOOD)
        after = snapshot(lab, agent)
        got = far()
    near(after["pod"]["egress_bytes"]["internet"] - before["pod"]["egress_bytes"]["internet"], got,
         "upload after an upgrade vs the far end")
