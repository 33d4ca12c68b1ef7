"""tc executor and capability probe against the real kernel, in scratch namespaces."""
import json
import subprocess
import sys
import time

import pytest

from tc.errors import TcError
from tc import rawnl
from tc.model import (DEFAULT_MINOR, NODE_MINOR, ClassStats, HtbClassSpec, ShaperSpec, ack_minor, bulk_minor,
                      fold_leaves)
from tc.netlink import Shaper, fold_counters
from tc.probe import probe, require
from lab.netns import scratch_netns, sh

pytestmark = pytest.mark.root


def make_spec(pods=None, **kw):
    base = dict(
        ifb="na-ifb0", devices=("eth0",), mark_bit=0x20000, node_rate=1_000_000_000,
        default=HtbClassSpec(DEFAULT_MINOR, 1_000_000, 1_000_000, "default"),
        pods=tuple(pods if pods is not None else (
            HtbClassSpec(0x10A, 10_000_000, 20_000_000, "a/p1"),
            HtbClassSpec(0x10B, 40_000_000_000, 60_000_000_000, "a/p2"),
        )),
    )
    base.update(kw)
    return ShaperSpec(**base)


@pytest.fixture
def node():
    with scratch_netns("tc") as ns:
        sh("ip link add eth0 type veth peer name eth1 && ip link set eth0 up && ip link set eth1 up", ns)
        yield ns


def snapshot(ns):
    return sh("tc qdisc show; tc filter show dev eth0 egress 2>/dev/null; ip -o link | sed 's/^[0-9]*: //'", ns)


def test_apply_is_idempotent_and_adopted_after_restart(node):
    spec = make_spec()
    with Shaper(node) as s:
        first = s.apply(spec)
        assert first.changes > 0
        assert s.apply(spec).changes == 0
    # a new process (restart) adopts what it finds: nothing to do
    with Shaper(node) as s2:
        assert s2.plan(spec) == []
    classes = sh("tc class show dev na-ifb0", node)
    assert "rate 40Gbit ceil 60Gbit" in classes  # 64-bit rate attributes
    assert "rate 10Mbit ceil 20Mbit" in classes
    filt = sh("tc filter show dev eth0 egress", node)
    assert "bytecode '5,32 0 0 4294963220,84 0 0 131072,21 0 1 131072" in filt
    assert "Redirect to device na-ifb0" in filt
    assert "default 0xfffe" in sh("tc qdisc show dev na-ifb0", node)


def test_change_in_place_and_delete(node):
    with Shaper(node) as s:
        s.apply(make_spec())
        handle_before = sh("tc qdisc show dev na-ifb0 | grep htb", node)
        changed = make_spec(pods=[HtbClassSpec(0x10A, 30_000_000, 30_000_000, "a/p1")])
        ops = s.apply(changed).ops
        assert {o.action for o in ops} <= {"change_class", "replace_leaf", "delete_class"}
        assert sh("tc qdisc show dev na-ifb0 | grep htb", node) == handle_before
        classes = sh("tc class show dev na-ifb0", node)
        assert "1:10b" not in classes and "rate 30Mbit ceil 30Mbit" in classes
        assert s.apply(changed).changes == 0


def test_stats_one_dump(node):
    with Shaper(node) as s:
        s.apply(make_spec())
        stats = s.stats("na-ifb0")
    assert set(stats) == {0x1, 0x10A, 0x10B, DEFAULT_MINOR}
    assert stats[0x10B].rate_bytes == 5_000_000_000
    # fresh classes: no drops, and at most a link-local packet of the lab's IPv6 autoconfiguration
    assert all(st.bytes < 1024 and st.drops == 0 for st in stats.values())


def reference_stats(s: Shaper, ifb: str = "na-ifb0") -> dict[int, ClassStats]:
    """Every class decoded in full (`parse_htb_class`) and folded by `fold_leaves`: what `stats` was."""
    return fold_leaves({c.handle & 0xFFFF: ClassStats(c.handle & 0xFFFF, c.bytes, c.packets, c.drops, c.overlimits,
                                                      c.backlog, c.qlen, c.rate_bytes, c.ceil_bytes)
                        for c in s._htb_classes(s._index(ifb), 1)})


def test_stats_decode_only_the_counters_and_match_the_full_decoder(node):
    """110 pods (two above 4 GiB/s: 64-bit rate attributes) and one pod's bulk leaf flooded over its
    1 Mbit/s ceil: the lean decoder gives each class what the full one gives, on the same bytes while
    packets queue, and `stats` folds the leaves as `fold_leaves` does once they drained."""
    pods = [HtbClassSpec(0x100 + i, 10_000_000, 20_000_000, f"a/p{i}") for i in range(108)]
    pods += [HtbClassSpec(0x10A0, 40_000_000_000, 60_000_000_000, "a/big"),
             HtbClassSpec(0x10A1, 1_000_000, 1_000_000, "a/slow")]
    sh("ip addr add 10.9.0.1/24 dev eth0 && ip neigh add 10.9.0.9 lladdr 02:00:00:00:00:09 dev eth0", node)
    sh(f"iptables -t mangle -A OUTPUT -p udp -j MARK --set-mark 0x20000 && "
       f"iptables -t mangle -A OUTPUT -p udp -j CLASSIFY --set-class 1:{bulk_minor(0x10A1):x}", node)
    burst = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
             "for _ in range(300): s.sendto(bytes(1400), ('10.9.0.9', 9))")
    with Shaper(node) as s:
        s.apply(make_spec(pods=pods))
        idx = s._index("na-ifb0")
        sh(f"{sys.executable} -c \"{burst}\"", node)  # 420 KB at once: ~3 s of the leaf's 1 Mbit/s
        payloads = s.chan.dump_classes(idx)
        raw = s.chan.dump_class_counters(idx, 1)
        assert fold_counters(raw) == fold_leaves({m: ClassStats(m, *c) for m, c in raw.items()})
        # the counters' dump asks for the HTB's classes only: every one the whole dump has, nothing else
        assert set(raw) == {handle & 0xFFFF for handle, parent, payload in payloads
                            if handle >> 16 == 1 and rawnl.parse_htb_class(handle, parent, payload) is not None}
        queued = False
        for handle, parent, payload in payloads:
            full = rawnl.parse_htb_class(handle, parent, payload)
            lean = rawnl.class_counters(payload, 0, len(payload))
            assert lean == (full.bytes, full.packets, full.drops, full.overlimits, full.backlog, full.qlen,
                            full.rate_bytes, full.ceil_bytes), hex(handle)
            queued |= handle & 0xFFFF == bulk_minor(0x10A1) and full.backlog > 0 and full.overlimits > 0
        assert queued, "the flooded leaf showed no backlog"
        assert raw[bulk_minor(0x10A1)][4] > 0  # so was it in the counters folded above
        # a message cut anywhere, or bytes flipped, is skipped or misread but never read past
        for handle, parent, payload in payloads[:20]:
            for cut in range(len(payload)):
                rawnl.class_counters(payload, 0, cut)
                rawnl.class_counters(payload[:cut], 0, cut)
            broken = bytearray(payload)
            for i in range(0, len(broken), 3):
                broken[i] ^= 0xFF
                rawnl.class_counters(bytes(broken), 0, len(broken))
        for _ in range(300):  # drained: the counters stand still
            before = reference_stats(s)
            now = s.stats("na-ifb0")
            if not any(st.backlog_bytes for st in before.values()) and before == reference_stats(s):
                break
            time.sleep(0.1)
        assert now == before
        assert set(now) == {0x1, DEFAULT_MINOR, *(p.minor for p in pods)}
        slow = now[0x10A1]
        assert slow.overlimits > 0 and slow.packets > 0 and now[0x10A0].rate_bytes == 5_000_000_000


def test_a_class_dump_decodes_only_the_classes_that_changed(node, monkeypatch):
    """Idle classes read back the same bytes: the second of two dumps decodes none of them, and
    after traffic through one pod only the classes it went through, with their new counters."""
    decoded = []
    full = rawnl.class_counters
    monkeypatch.setattr(rawnl, "class_counters", lambda data, off, end: decoded.append(1) or full(data, off, end))
    pods = [HtbClassSpec(0x100 + i, 10_000_000, 20_000_000, f"a/p{i}") for i in range(20)]
    sh("ip addr add 10.9.0.1/24 dev eth0 && ip neigh add 10.9.0.9 lladdr 02:00:00:00:00:09 dev eth0", node)
    sh(f"iptables -t mangle -A OUTPUT -p udp -j MARK --set-mark 0x20000 && "
       f"iptables -t mangle -A OUTPUT -p udp -j CLASSIFY --set-class 1:{bulk_minor(0x105):x}", node)
    with Shaper(node) as s:
        s.apply(make_spec(pods=pods))
        first = s.stats("na-ifb0")
        assert len(decoded) == 3 * 20 + 2  # every class once: pods, their two leaves, node and default
        decoded.clear()
        assert s.stats("na-ifb0") == first and decoded == []
        sh(f"{sys.executable} -c \"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
           f".sendto(bytes(100), ('10.9.0.9', 9))\"", node)
        for _ in range(100):
            after = s.stats("na-ifb0")
            if after[0x105].packets:
                break
            time.sleep(0.05)
        assert after[0x105].packets == 1 and after[NODE_MINOR].packets == first[NODE_MINOR].packets + 1
        assert after == reference_stats(s)
        assert 0 < len(decoded) < 10  # the pod's class, its bulk leaf, the node class: not the 62


def test_missing_uplink_changes_nothing(node):
    before = snapshot(node)
    with Shaper(node) as s, pytest.raises(TcError, match="bond7.*not found.*nothing was changed"):
        s.apply(make_spec(devices=("eth0", "bond7")))
    assert snapshot(node) == before


def test_ifb_name_taken_by_someone_else(node):
    sh("ip link add na-ifb0 type veth peer name someone1", node)
    before = snapshot(node)
    with Shaper(node) as s, pytest.raises(TcError, match="na-ifb0.*not netagent's IFB"):
        s.apply(make_spec())
    assert snapshot(node) == before


def test_cleanup_removes_exactly_ours(node):
    before = snapshot(node)
    with Shaper(node) as s:
        s.apply(make_spec())
        assert s.cleanup("na-ifb0", ("eth0",), 0xC000)
        assert snapshot(node) == before
        assert s.cleanup("na-ifb0", ("eth0",), 0xC000) == []  # idempotent


def test_cleanup_keeps_a_clsact_someone_else_uses(node):
    sh("tc qdisc add dev eth0 clsact && tc filter add dev eth0 egress pref 7 bpf bytecode '1,6 0 0 0'", node)
    before = snapshot(node)
    with Shaper(node) as s:
        s.apply(make_spec())
        assert "pref 7 bpf" in sh("tc filter show dev eth0 egress", node)
        s.cleanup("na-ifb0", ("eth0",), 0xC000)
    assert snapshot(node) == before


def kernel_has_fq_codel() -> bool:
    """The answer from tc(8), independent of the probe's code."""
    with scratch_netns("fqc") as ns:
        sh("ip link add fqc0 type veth peer name fqc1", ns)
        return not subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "fqc0", "root", "fq_codel"],
                                  capture_output=True).returncode


def links(ns):
    return sorted(line.split(":")[1].strip().split("@")[0] for line in sh("ip -o link", ns).splitlines())


def test_probe_finds_what_the_data_path_needs_and_leaves_nothing():
    expected_leaf = "fq_codel" if kernel_has_fq_codel() else "tbf"
    with scratch_netns("probe") as ns:
        sh("ip link add eth0 type veth peer name eth1", ns)
        before = snapshot(ns)
        caps = probe(ns)
        assert snapshot(ns) == before
    require(caps)  # raises with the missing features named
    assert {"htb", "clsact", "pfifo"} <= caps.qdiscs
    assert "bpf" in caps.classifiers and "mirred" in caps.actions and caps.ifb
    assert caps.leaf_qdisc == expected_leaf


def test_probe_removes_only_its_own_leftovers():
    with scratch_netns("probe") as ns:
        # a probe device left by a crash, and two that only look alike (wrong kind, wrong name)
        sh("ip link add nap-0badcafe type ifb && ip link add nap-00000001 type veth peer name peer1 "
           "&& ip link add nap-mine type ifb", ns)
        probe(ns)
        assert links(ns) == ["lo", "nap-00000001", "nap-mine", "peer1"]


# the agent's container: exactly these capabilities (tests/test_deploy.py checks the DaemonSet says so)
AGENT_POD_CAPABILITIES = {"net_admin": 12, "net_raw": 13}
CONFINED_PROBE = """
import json
from tc.probe import probe
status = open("/proc/self/status").read()
print(json.dumps({"caps": probe().as_dict(), "cap_eff": int(status.split("CapEff:")[1].split()[0], 16)}))
"""


def test_probe_works_with_only_the_agent_pods_capabilities():
    """The agent's pod has NET_ADMIN and NET_RAW, no SYS_ADMIN: no namespace of its own, so the
    probe runs on a device of its own in the namespace it is in, and says what the kernel has."""
    expected_leaf = "fq_codel" if kernel_has_fq_codel() else "tbf"
    setpriv = ["setpriv", f"--bounding-set=-all,{','.join('+' + c for c in AGENT_POD_CAPABILITIES)}",
               "--inh-caps=-all", "--no-new-privs", "--"]
    with scratch_netns("probe") as ns:
        sh("ip link add eth0 type veth peer name eth1 && ip link set eth0 up && ip link set eth1 up", ns)
        before = snapshot(ns)
        confined = ["ip", "netns", "exec", ns, *setpriv]
        refused = subprocess.run([*confined, "ip", "netns", "add", f"{ns}-x"], capture_output=True, text=True)
        assert refused.returncode != 0, "the confinement must refuse what needs CAP_SYS_ADMIN"
        run = subprocess.run([*confined, sys.executable, "-c", CONFINED_PROBE], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0, run.stderr
        assert snapshot(ns) == before
    out = json.loads(run.stdout)
    assert out["cap_eff"] == sum(1 << bit for bit in AGENT_POD_CAPABILITIES.values())
    caps = out["caps"]
    assert caps["missing"] == [] and caps["ifb"]
    assert {"htb", "clsact", "pfifo"} <= set(caps["qdiscs"])
    assert "bpf" in caps["classifiers"] and "mirred" in caps["actions"]
    assert caps["leaf_qdisc"] == expected_leaf


def test_a_probe_that_cannot_run_says_what_it_needs():
    """Without CAP_NET_ADMIN the probe fails with the reason (the agent then refuses to start)."""
    code = "from tc.probe import probe\ntry:\n    probe()\nexcept Exception as exc:\n    print(type(exc).__name__, exc)"
    with scratch_netns("probe") as ns:
        run = subprocess.run(["ip", "netns", "exec", ns, "setpriv", "--bounding-set=-all", "--inh-caps=-all",
                              "--no-new-privs", "--", sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
        assert links(ns) == ["lo"]
    assert run.stdout.startswith("TcError") and "CAP_NET_ADMIN" in run.stdout, run.stdout + run.stderr


def test_node_rate_change_then_restart_changes_nothing(node):
    """HTB keeps an inner class's creation-time quantum (it only sets quanta of leaves): a
    changed node rate must not make every later reconcile, or a restart, 'fix' it again."""
    with Shaper(node) as s:
        s.apply(make_spec(node_rate=10_000_000_000))
        assert [o.action for o in s.apply(make_spec(node_rate=100_000_000)).ops] == ["change_class"]
        assert s.apply(make_spec(node_rate=100_000_000)).changes == 0
    with Shaper(node) as fresh:
        assert fresh.plan(make_spec(node_rate=100_000_000)) == []


def test_bfifo_leaf_holds_its_byte_limit_and_is_adopted(node):
    """The byte-limited leaf (pyroute2 has no bfifo encoder: sent with pfifo's tc_fifo_qopt)."""
    from tc import sizing
    spec = make_spec(leaf="bfifo")
    with Shaper(node) as s:
        s.apply(spec)
        leaves = s.observe(spec).leaves
        for leaf in (bulk_minor(0x10A), ack_minor(0x10A)):
            assert (leaves[leaf].kind, leaves[leaf].limit) == ("bfifo", sizing.leaf_limit_bytes(20_000_000))
        assert s.apply(spec).changes == 0
    with Shaper(node) as fresh:
        assert fresh.apply(spec).changes == 0


def test_the_segmenting_tbf_leaf_is_adopted_and_its_bucket_follows_the_uplinks_mtu(node):
    """tbf leaves (slow classes) at a 64-bit rate far above any ceil with a one-frame bucket: a restart
    changes nothing. TBF drops a non-GSO packet larger than its bucket, so when the uplink's
    MTU grows the bucket must grow with it: an 8000-byte ping through the shaper is lost with the old
    bucket and passes once the leaves are re-applied."""
    from tc import sizing
    spec = make_spec(leaf="tbf")
    with scratch_netns("tcpeer") as peer:
        sh(f"ip link set eth1 netns {peer}", node)
        sh("ip addr add 192.0.2.2/24 dev eth1 && ip link set eth1 up", peer)
        sh("ip addr add 192.0.2.1/24 dev eth0", node)
        with Shaper(node) as s:
            s.apply(spec)
            leaves = s.observe(spec).leaves
            for minor in (bulk_minor(0x10A), ack_minor(0x10A)):
                leaf = leaves[minor]
                assert (leaf.kind, leaf.limit, leaf.tbf_rate, leaf.tbf_burst) == (
                    "tbf", sizing.leaf_limit_bytes(20_000_000), sizing.SEGMENTER_RATE_BYTES, 1522)
            assert leaves[bulk_minor(0x10B)].kind == "pfifo"  # 60 Gbit/s: splitting would cost more than it saves
            assert s.apply(spec).changes == 0
            with Shaper(node) as fresh:
                assert fresh.plan(spec) == []
            # the default class catches marked traffic from no known pod: the ping goes through it
            big_ping = "ping -c 3 -W 1 -i 0.2 -M do -s 8000 -m 131072 192.0.2.2"
            sh(f"ping -c 1 -W 1 -m 131072 192.0.2.2", node)
            sh("ip link set eth0 mtu 9000", node)
            sh("ip link set eth1 mtu 9000", peer)
            lost = subprocess.run(["ip", "netns", "exec", node, *big_ping.split()], capture_output=True, text=True)
            assert lost.returncode != 0, "a frame above the bucket passed: the test cannot see the bucket"
            ops = s.apply(spec).ops
            assert {(o.action, o.leaf_burst) for o in ops} == {("replace_leaf", 9022)} and len(ops) == 3
            sh(big_ping, node)
            assert s.apply(spec).changes == 0
            # the 20 Mbit/s pod grows past the boundary: its leaves become pfifo (another kind under
            # the same handle: deleted, then added), and back
            fast = make_spec(leaf="tbf", pods=(HtbClassSpec(0x10A, 10_000_000, 4 * sizing.SEGMENT_CEIL_BPS, "a/p1"),))
            assert [o.action for o in s.apply(fast).ops if "leaf" in o.action] == ["delete_leaf", "replace_leaf"] * 2
            assert s.observe(fast).leaves[bulk_minor(0x10A)].kind == "pfifo" and s.apply(fast).changes == 0
            s.apply(spec)
            assert s.observe(spec).leaves[bulk_minor(0x10A)].kind == "tbf" and s.apply(spec).changes == 0
            assert "dropped 0" not in sh("tc -s qdisc show dev na-ifb0 parent 1:fffe", node)  # the lost ones


def test_a_pod_class_holds_a_control_leaf_first_and_a_bulk_leaf_and_an_older_flat_tree_is_adopted(node):
    """The kernel's view of a pod: an inner class with two prio-ordered leaves and their queues. A
    tree made by an older netagent (each pod class a leaf with its own pfifo) is turned into it in
    place: the pod class keeps its minor, HTB makes it an inner class when its first leaf is added."""
    spec = make_spec()
    sh("ip link add na-ifb0 type ifb && ip link set na-ifb0 up && ip link set dev na-ifb0 alias "
       "'netagent: internet egress shaper' && tc qdisc add dev na-ifb0 root handle 1: htb default fffe && "
       "tc class add dev na-ifb0 parent 1: classid 1:1 htb rate 1Gbit && "
       "tc class add dev na-ifb0 parent 1:1 classid 1:fffe htb rate 1Mbit && "
       "tc class add dev na-ifb0 parent 1:1 classid 1:10a htb rate 10Mbit ceil 20Mbit && "
       "tc qdisc add dev na-ifb0 parent 1:10a handle 10a: pfifo limit 64", node)
    with Shaper(node) as s:
        assert s.apply(spec).changes > 0
        assert s.apply(spec).changes == 0
        classes = s.observe(spec).classes
        stats = s.stats("na-ifb0")
    for pod in (0x10A, 0x10B):
        assert classes[pod].parent_minor == NODE_MINOR
        assert classes[ack_minor(pod)].parent_minor == classes[bulk_minor(pod)].parent_minor == pod
        assert classes[ack_minor(pod)].prio == 0 and classes[bulk_minor(pod)].prio == 1
        assert classes[ack_minor(pod)].rate_bytes + classes[bulk_minor(pod)].rate_bytes == classes[pod].rate_bytes
    leaves = {line.split()[4] for line in sh("tc qdisc show dev na-ifb0", node).splitlines() if " parent 1:" in line}
    assert leaves == {"1:fffe", "1:410a", "1:810a", "1:410b", "1:810b"}  # no queue left under a pod class
    assert set(stats) == {NODE_MINOR, DEFAULT_MINOR, 0x10A, 0x10B}  # the leaves are folded into their pods
    with Shaper(node) as fresh:
        assert fresh.plan(spec) == []
        fresh.apply(make_spec(pods=()))
    assert sh("tc class show dev na-ifb0", node).count("class htb") == 2


def test_a_pod_with_a_tiny_guarantee_and_a_large_ceil_applies_and_converges(node):
    """8 bit/s guaranteed (its control leaf: 8 bit/s, its bulk leaf: 8 bit/s), 1 Gbit/s ceil: every
    bucket fits HTB's 32-bit buffer and a second apply changes nothing."""
    spec = make_spec(pods=(HtbClassSpec(0x10A, 8, 1_000_000_000, "a/tiny"), HtbClassSpec(0x10B, 8_000, 8_000, "a/slow")))
    with Shaper(node) as s:
        s.apply(spec)
        assert s.apply(spec).changes == 0
    assert sh("tc class show dev na-ifb0", node).count("class htb") == 2 + 2 * 3
