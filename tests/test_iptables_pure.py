"""Pure tests of iptables/ rendering, diffing, parsing and detection: no root, no kernel."""
from __future__ import annotations

import dataclasses
import ipaddress
import shlex

import pytest

from iptables import render as R
from iptables.backend import choose_backend, has_kubelet_hint, rule_count
from iptables.errors import IptablesError
from iptables.model import ClassifierState, PodClassification
from iptables.parse import (comment_of, counted_comments, mark_masks, normalise, parse_ipset_entries, parse_ipset_save,
                            parse_save, tokens)


def pods(n: int, base4: str = "10.244.0.10", base6: str = "fd00:244::10") -> tuple[PodClassification, ...]:
    a4, a6 = ipaddress.ip_address(base4), ipaddress.ip_address(base6)
    return tuple(PodClassification(f"ns/p{i}", (str(a4 + i), str(a6 + i)), (1, 0x10 + i)) for i in range(n))


def state(n: int = 3, **kw) -> ClassifierState:
    args = dict(mark_bit=0x1000, internal_cidrs=("10.0.0.0/8", "fd00::/8"), pods=pods(n), uplinks=("eth0",))
    args.update(kw)
    return ClassifierState(**args)


def parse_restore(text: str) -> dict[str, list[list[str]]]:
    """A small fake of iptables-restore: chain -> rules as token lists (what the kernel would hold)."""
    chains: dict[str, list[list[str]]] = {}
    for line in text.splitlines():
        if line.startswith(":"):
            chains[line[1:].split()[0]] = []
        elif line.startswith("-A "):
            tokens = shlex.split(line)
            chains[tokens[1]].append(tokens[2:])
    return chains


# -- render -----------------------------------------------------------------------------

def test_render_is_deterministic_and_family_specific():
    st = state(3)
    v4, v6 = R.render(st, 4), R.render(st, 6)
    assert v4 == R.render(st, 4)
    assert "-d 10.0.0.0/8 -m comment" in v4 and "-d fd00::/8 -m comment" in v6  # few CIDRs: plain rules
    assert "-j SET --map-set netagent-egress-inet4 src --map-mark --map-prio" in v4
    assert "-I POSTROUTING 1 -j NETAGENT-POSTROUTING" in v4 and "-I PREROUTING 1 -j NETAGENT-PREROUTING" in v4
    assert v4.startswith("*mangle\n") and v4.endswith("COMMIT\n")
    sets4, sets6 = R.build(st, 4).sets, R.build(st, 6).sets
    assert set(sets4["netagent-egress-int4"].members) == {"10.244.0.10", "10.244.0.11", "10.244.0.12"}
    assert set(sets6["netagent-ingress-inet6"].members) == {"fd00:244::10", "fd00:244::11", "fd00:244::12"}
    assert all(s.family == 4 for s in sets4.values()) and all(s.family == 6 for s in sets6.values())


def test_rules_never_name_a_pod():
    """10 or 110 pods, any classes: the same rules; pods live in the sets only."""
    small, big = R.build(state(10), 4), R.build(state(110), 4)
    assert small.chains == big.chains and small.jumps == big.jumps
    assert len(big.sets["netagent-egress-inet4"].members) == 110
    assert "10.244.0" not in R.render(state(110), 4)


def test_every_chain_and_set_is_ours_and_short_enough():
    rs = R.build(state(110), 4, prefix="ABCDEFGHIJKL")
    for name in rs.chains:
        assert R.is_ours(name, "ABCDEFGHIJKL") and len(name) <= R.MAX_CHAIN_NAME
    assert not R.is_ours("ABCDEFGHIJKLM-X", "ABCDEFGHIJKL")
    assert all(len(n) <= R.MAX_SET_NAME for n in R.set_names("ABCDEFGHIJKL"))
    assert set(rs.sets) | set(R.build(state(1), 6, prefix="ABCDEFGHIJKL").sets) == \
        {n for n in R.set_names("ABCDEFGHIJKL") if not n.endswith(R.SWAP_SUFFIX)}


def test_pod_sets_count_each_direction_and_scope():
    rs = R.build(state(1), 4)
    assert {n: R.set_kind(n, "NETAGENT") for n in rs.sets} == {
        "netagent-internal4": None, "netagent-peer4": None,
        "netagent-egress-int4": "egress_internal", "netagent-egress-inet4": "egress_internet",
        "netagent-ingress-int4": "ingress_internal", "netagent-ingress-inet4": "ingress_internet",
        "netagent-egress-ack4": None, "netagent-ingress-ack4": None}
    for name in ("netagent-egress-int4", "netagent-ingress-int4", "netagent-ingress-inet4"):
        assert rs.sets[name].members == {"10.244.0.10": (("comment", "ns/p0"),)}
        # the download set carries skbinfo always (a counted set is never re-created), used when shaped
        assert rs.sets[name].create == "hash:ip family inet counters comment" + (
            " skbinfo" if name == "netagent-ingress-inet4" else "")
    marked = rs.sets["netagent-egress-inet4"]
    assert marked.create == "hash:ip family inet counters comment skbinfo"
    assert marked.members == {"10.244.0.10": (("comment", "ns/p0"), ("skbmark", "0x1000/0x1000"), ("skbprio", "1:10"))}
    # the peer set: internal CIDRs, the node's pods excluded (nomatch: the most specific entry decides)
    assert rs.sets["netagent-peer4"].members["10.244.0.10/32"] == (("nomatch", ""),)
    assert rs.sets["netagent-peer4"].members["10.0.0.0/8"] == ()
    assert not rs.sets["netagent-internal4"].counted and not rs.sets["netagent-peer4"].counted


def test_long_pod_keys_are_cut_in_set_comments():
    key = "n" * 63 + "/" + "p" * 253  # the longest Kubernetes namespace/name
    rs = R.build(state(pods=(PodClassification(key, ("10.244.0.9",), (1, 9)),)), 4)
    text = dict(rs.sets["netagent-egress-int4"].members["10.244.0.9"])["comment"]
    assert len(text.encode()) < 255 and text.startswith("n" * 63 + "/") and "~" in text


def test_single_stack_pods_appear_only_in_their_family():
    v4_only = PodClassification("ns/four", ("10.244.0.5",), (1, 5))
    v6_only = PodClassification("ns/six", ("fd00:244::6",), (1, 6))
    st = state(pods=(v4_only, v6_only))
    assert set(R.build(st, 4).sets["netagent-egress-int4"].members) == {"10.244.0.5"}
    assert set(R.build(st, 6).sets["netagent-egress-int6"].members) == {"fd00:244::6"}


def test_node_counters_hook_every_uplink():
    rs = R.build(state(0, uplinks=("eth0", "eth1")), 4)
    post = rs.chains["NETAGENT-POSTROUTING"]
    assert post[:2] == ("-o eth0 -g NETAGENT-NODE-OUT", "-o eth1 -g NETAGENT-NODE-OUT")
    assert rs.chains["NETAGENT-PREROUTING"] == ("-i eth0 -j NETAGENT-NODE-IN", "-i eth1 -j NETAGENT-NODE-IN")


def test_set_members_add_link_local_and_multicast_and_canonicalise():
    members = R.set_members(("10.1.2.3/8", "fd00::/8", "169.254.169.254/32"))
    assert members[4] == ("10.0.0.0/8", "169.254.0.0/16", "169.254.169.254/32", "224.0.0.0/4", "255.255.255.255/32")
    assert members[6] == ("fd00::/8", "fe80::/10", "ff00::/8")


# -- bad input --------------------------------------------------------------------------

@pytest.mark.parametrize("bit", [0, 3, 0x3000, 2**32, -1, True, "0x1000"])
def test_mark_bit_must_be_one_bit(bit):
    with pytest.raises(IptablesError, match="mark bit .* single bit"):
        R.build(state(mark_bit=bit), 4)


@pytest.mark.parametrize("cidr,match", [("10.0.0.0/33", "malformed"), ("not-a-net", "malformed"),
                                        ("0.0.0.0/0", "every address"), ("::/0", "every address")])
def test_bad_cidr_names_it(cidr, match):
    with pytest.raises(IptablesError, match=match) as err:
        R.build(state(internal_cidrs=(cidr,)), 4)
    assert cidr in str(err.value)


def test_bad_pods_and_uplinks():
    dup = (PodClassification("a/x", ("10.244.0.1",), (1, 2)), PodClassification("b/y", ("10.244.0.1",), (1, 3)))
    with pytest.raises(IptablesError, match="10.244.0.1 is claimed by both a/x and b/y"):
        R.build(state(pods=dup), 4)
    with pytest.raises(IptablesError, match="not an IP address"):
        R.build(state(pods=(PodClassification("a/x", ("10.244.0.300",), (1, 2)),)), 4)
    with pytest.raises(IptablesError, match="out of range"):
        R.build(state(pods=(PodClassification("a/x", ("10.244.0.3",), (0, 2)),)), 4)
    with pytest.raises(IptablesError, match="quotes"):
        R.build(state(pods=(PodClassification('a/"x', ("10.244.0.3",), (1, 2)),)), 4)
    with pytest.raises(IptablesError, match="no uplink"):
        R.build(state(uplinks=()), 4)
    with pytest.raises(IptablesError, match="not a valid interface"):
        R.build(state(uplinks=("eth 0",)), 4)
    with pytest.raises(IptablesError, match="prefix"):
        R.build(state(), 4, prefix="THIS-IS-WAY-TOO-LONG")


# -- diff -------------------------------------------------------------------------------

def kernel_view(rs: R.Ruleset) -> tuple[dict[str, tuple[str, ...]], list[tuple[str, str]]]:
    return ({c: tuple(normalise(r) for r in rules) for c, rules in rs.chains.items()},
            [(h, normalise(r)) for h, r in rs.jumps])


def test_update_of_matching_kernel_is_empty():
    rs = R.build(state(20), 4)
    chains, jumps = kernel_view(rs)
    assert R.render_update(rs, chains, jumps) == R.Update("", 0, ())


def test_update_from_nothing_declares_everything_and_hooks():
    rs = R.build(state(2), 6)
    up = R.render_update(rs, {}, [])
    assert up.changes == len(rs.chains) + 2 and up.rewritten == ()
    assert parse_restore(up.text) == parse_restore(R.render(state(2), 6))


def test_class_change_touches_no_rule_and_one_set_member():
    old = state(20)
    changed = list(old.pods)
    changed[5] = PodClassification(changed[5].key, changed[5].ips, (1, 0x999))
    new = R.build(ClassifierState(old.mark_bit, old.internal_cidrs, tuple(changed), old.uplinks), 4)
    was = R.build(old, 4)
    assert R.render_update(new, *kernel_view(was)) == R.Update("", 0, ())
    differ = {n: [m for m in s.members if s.members[m] != was.sets[n].members.get(m)] for n, s in new.sets.items()}
    assert {n: m for n, m in differ.items() if m} == {"netagent-egress-inet4": ["10.244.0.15"]}
    assert dict(new.sets["netagent-egress-inet4"].members["10.244.0.15"])["skbprio"] == "1:999"


def test_pod_removal_touches_no_rule():
    old = state(3)
    new = R.build(ClassifierState(old.mark_bit, old.internal_cidrs, old.pods[:2], old.uplinks), 4)
    assert R.render_update(new, *kernel_view(R.build(old, 4))).changes == 0
    assert "10.244.0.12" not in new.sets["netagent-ingress-int4"].members
    assert "10.244.0.12/32" not in new.sets["netagent-peer4"].members


def test_missing_hook_is_inserted_and_duplicate_removed():
    rs = R.build(state(1), 4)
    chains, jumps = kernel_view(rs)
    up = R.render_update(rs, chains, [jumps[1], jumps[1]])
    assert up.text.splitlines()[1:-1] == ["-D POSTROUTING -j NETAGENT-POSTROUTING",
                                         "-I PREROUTING 1 -j NETAGENT-PREROUTING"]


# -- parse ------------------------------------------------------------------------------

SAVE = """# Generated by iptables-save v1.8.9 (nf_tables)
*mangle
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:NETAGENT-E-X - [0:0]
[13:8764] -A POSTROUTING -j NETAGENT-POSTROUTING
[3:1184] -A NETAGENT-E-X -m set --match-set netagent-internal4 dst -m comment --comment "ns/p egress internal" -j RETURN
[0:0] -A NETAGENT-E-X -m comment --comment nospace -j MARK --set-xmark 0x1000/0x1000
COMMIT
*nat
:KUBE-MARK-MASQ - [0:0]
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
COMMIT
"""


def test_parse_save_with_and_without_counters():
    tables = parse_save(SAVE)
    assert set(tables) == {"mangle", "nat"}
    mangle = tables["mangle"]
    assert mangle.chains["PREROUTING"] == "ACCEPT" and mangle.chains["NETAGENT-E-X"] == "-"
    first = mangle.chain_rules("NETAGENT-E-X")[0]
    assert (first.packets, first.bytes) == (3, 1184)
    assert comment_of(first.rule) == "ns/p egress internal"
    assert tables["nat"].rules[0].bytes == 0


def test_counted_comments_reads_only_our_commented_rules():
    found = counted_comments(SAVE + '[4:40] -A NETAGENT-NODE-IN -m comment --comment "node ingress internet" -j RETURN\n'
                             '[9:90] -A OTHER -m comment --comment "ns/p egress internal" -j RETURN\n', "NETAGENT")
    assert found == [("NETAGENT-E-X", "ns/p egress internal", 1184), ("NETAGENT-E-X", "nospace", 0),
                     ("NETAGENT-NODE-IN", "node ingress internet", 40)]


def test_tokens_and_normalise_follow_iptables_quoting():
    assert tokens('-m comment --comment "a b" -j RETURN') == ["-m", "comment", "--comment", "a b", "-j", "RETURN"]
    assert tokens(r'--comment "say \"hi\"" -j RETURN') == ["--comment", 'say "hi"', "-j", "RETURN"]
    assert normalise('-m  comment --comment "a b"   -j RETURN') == '-m comment --comment "a b" -j RETURN'
    assert normalise('-m comment --comment "nospace" -j RETURN') == "-m comment --comment nospace -j RETURN"


@pytest.mark.parametrize("rule,mask", [
    ("-j MARK --set-xmark 0x4000/0x4000", 0x4000),
    ("-j MARK --set-xmark 0x1/0xffffffff", 0xFFFFFFFF),
    ("-m mark --mark 0x1000/0x1000 -j RETURN", 0x1000),
    ("-m mark --mark 0x7", 0xFFFFFFFF),
    ("-j MARK --and-mark 0xffffefff", 0x1000),
    ("-j MARK --or-mark 0x1000", 0x1000),
    ("-j CONNMARK --restore-mark --nfmask 0xff00 --ctmask 0xff00", 0xFF00),
    ("-j CONNMARK --save-mark", 0xFFFFFFFF),
    ("-m connmark --mark 0x10000/0x10000 -j RETURN", 0x10000),
    ("-p tcp -j TPROXY --on-port 15006 --on-ip 0.0.0.0 --tproxy-mark 0x1/0x1", 0x1),
])
def test_mark_masks(rule, mask):
    found = 0
    for _, m in mark_masks(rule):
        found |= m
    assert found & mask == mask


def test_mark_masks_ignores_unrelated_rules():
    assert mark_masks("-s 10.0.0.0/8 -j ACCEPT") == []
    assert mark_masks('-m comment --comment "--mark 0x1000" -j ACCEPT') == []


def test_parse_ipset_save():
    sets = parse_ipset_save("create s hash:net family inet hashsize 1024 maxelem 65536\nadd s 10.0.0.0/8\nadd s 10.1.2.3\n")
    assert sets == {"s": ("hash:net family inet hashsize 1024 maxelem 65536", {"10.0.0.0/8", "10.1.2.3"})}


def test_parse_ipset_entries_reads_extensions_and_counters():
    text = ('create s hash:ip family inet hashsize 1024 maxelem 65536 counters comment skbinfo bucketsize 12 initval 0x1\n'
            'add s 10.244.0.10 packets 2 bytes 456 comment "ns/pod x" skbmark 0x1000/0x1000 skbprio 1:10\n'
            'add s 10.244.0.11 packets 0 bytes 0 comment "ns/q" skbmark 0x1000 skbprio 0001:00fe\n'
            'create p hash:net family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x2\n'
            'add p 10.244.0.10 nomatch\nadd p 10.0.0.0/8\n')
    sets = parse_ipset_entries(text)
    assert sets["s"][1]["10.244.0.10"] == ((("comment", "ns/pod x"), ("skbmark", "0x1000/0x1000"), ("skbprio", "1:10")), 456)
    assert sets["s"][1]["10.244.0.11"][0] == (("comment", "ns/q"), ("skbmark", "0x1000/0xffffffff"), ("skbprio", "1:fe"))
    assert sets["p"][1] == {"10.244.0.10": ((("nomatch", ""),), 0), "10.0.0.0/8": ((), 0)}


# -- backend detection ----------------------------------------------------------------------

def fake_save(dumps: dict[tuple[int, str, str | None], str]):
    return lambda family, backend, table: dumps.get((family, backend, table), "")


HINT = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n"
RULES = "*filter\n-A INPUT -j ACCEPT\n-A INPUT -j DROP\nCOMMIT\n"


def test_detection_follows_kubelet_hint_then_ours_then_rule_count():
    assert has_kubelet_hint(HINT) and not has_kubelet_hint(RULES) and rule_count(RULES) == 2
    assert choose_backend(fake_save({(6, "nft", "mangle"): HINT, (4, "legacy", None): RULES}), "NETAGENT") == "nft"
    assert choose_backend(fake_save({(4, "legacy", None): HINT, (4, "nft", None): RULES}), "NETAGENT") == "legacy"
    assert choose_backend(fake_save({(4, "legacy", None): ":NETAGENT-EGRESS - [0:0]\n"}), "NETAGENT") == "legacy"
    assert choose_backend(fake_save({(4, "legacy", None): RULES}), "NETAGENT") == "legacy"
    assert choose_backend(fake_save({(4, "legacy", None): RULES, (4, "nft", None): RULES}), "NETAGENT") == "nft"
    assert choose_backend(fake_save({}), "NETAGENT") == "nft"


# -- unknown sources: the default-class catch-all ----------------------------------------------

DEFAULT = (1, 0xFFFE)


def evaluate(state: ClassifierState, family: int, src: str, dst: str, oif: str, local_src: bool = False,
             proto: str = "udp", length: int = 1400, tcp_flags: frozenset = frozenset(), iif: str | None = None) -> dict:
    """Run one packet through a parse of the rendered POSTROUTING rules and the built sets, as the kernel would;
    through the PREROUTING rules first when it arrived by a device (`iif`; None: the node sent it).

    -> {"mark": skb mark, "priority": (major, minor) or None, "lookups": set lookups made,
        "device_tests": -i/-o matches made,
        "counted": what counted it: rule comments, and "<pod key> <kind>" for a pod set member's counter}.
    hash:net is longest-prefix match and a `nomatch` member answers "not in the set"; a rule's
    matches stop at the first that fails (later set lookups are neither made nor counted).
    """
    rs = R.build(state, family)
    chains = parse_restore(R.render(state, family))
    pkt = {"mark": 0, "priority": None, "counted": [], "lookups": 0, "device_tests": 0}
    addr = {"src": ipaddress.ip_address(src), "dst": ipaddress.ip_address(dst)}

    def lookup(name: str, where: str):
        """-> the matched member's extensions (a dict), or None."""
        pkt["lookups"] += 1
        s, ip = rs.sets[name], addr[where]
        if s.type == "hash:ip":
            ext = s.members.get(str(ip))
            return None if ext is None else dict(ext)
        best = max((ipaddress.ip_network(m) for m in s.members if ip in ipaddress.ip_network(m)),
                   key=lambda n: n.prefixlen, default=None)
        ext = None if best is None else dict(s.members[str(best)])
        return None if ext is None or "nomatch" in ext else ext

    def count(name: str, ext: dict) -> None:
        if rs.sets[name].counted:
            pkt["counted"].append(f"{ext['comment']} {R.set_kind(name, 'NETAGENT')}")

    def matches(rule: list[str]) -> bool:
        i, negate = 0, False
        while i < len(rule) and rule[i] not in ("-j", "-g"):
            tok, arg = rule[i], rule[i + 1] if i + 1 < len(rule) else ""
            step, result = 2, None
            if tok == "!":
                negate, i = True, i + 1
                continue
            if tok in ("-o", "-i"):
                pkt["device_tests"] += 1
                result = arg == (oif if tok == "-o" else iif)
            elif tok in ("-s", "-d"):
                result = addr["src" if tok == "-s" else "dst"] in ipaddress.ip_network(arg)
            elif tok == "--mark":
                value, mask = (int(v, 16) for v in arg.split("/"))
                result = pkt["mark"] & mask == value
            elif tok == "--match-set":
                ext = lookup(arg, rule[i + 2])
                if ext is not None and "--update-counters" not in rule:  # "! --update-counters": no count
                    count(arg, ext)
                result, step = ext is not None, 3
            elif tok == "--update-counters":
                negate, step = False, 1
            elif tok == "--src-type" and arg == "LOCAL":
                result = local_src
            elif tok == "-p":
                result = arg == proto
            elif tok == "--length":
                lo, hi = (int(v) for v in arg.split(":"))
                result = lo <= length <= hi
            elif tok == "--tcp-flags":
                mask, want = set(arg.split(",")), set(rule[i + 2].split(","))
                result, step = proto == "tcp" and (tcp_flags & mask) == want, 3
            elif tok not in ("-m", "--comment"):
                raise AssertionError(f"this fake does not know {tok} {arg}")
            if result is not None and result == negate:
                return False
            negate, i = False, i + step
        return True

    def run(chain: str) -> bool:
        """-> True when the chain ended the walk of its caller too (a -g chain that returned)."""
        for rule in chains[chain]:
            if not matches(rule):
                continue
            if "--comment" in rule:
                pkt["counted"].append(rule[rule.index("--comment") + 1])
            where = rule.index("-j") if "-j" in rule else rule.index("-g") if "-g" in rule else None
            if where is None:
                continue
            verb, target = rule[where], rule[where + 1]
            if target == "RETURN":
                return False
            if target == "MARK":
                value, mask = (int(v, 16) for v in rule[where + 3].split("/"))
                pkt["mark"] = (pkt["mark"] & ~mask) | value
            elif target == "CLASSIFY":
                pkt["priority"] = tuple(int(v, 16) for v in rule[where + 3].split(":"))
            elif target == "SET":
                name = rule[where + 3]
                ext = lookup(name, rule[where + 4])
                if ext is not None:
                    count(name, ext)
                    if "--map-mark" in rule:
                        value, mask = (int(v, 16) for v in ext["skbmark"].split("/"))
                        pkt["mark"] = (pkt["mark"] & ~mask) ^ value
                    if "--map-prio" in rule:
                        pkt["priority"] = tuple(int(v, 16) for v in ext["skbprio"].split(":"))
            elif verb == "-g":
                run(target)
                return False  # a goto's chain returns to our caller
            else:
                run(target)
        return False

    if iif is not None and "NETAGENT-PREROUTING" in chains:
        run("NETAGENT-PREROUTING")
    run("NETAGENT-POSTROUTING")
    return pkt


NET = {4: dict(pod="10.244.0.10", other="10.244.0.11", peer="10.0.0.2", internet="192.0.2.1", node="10.0.0.1",
               stranger="10.244.0.99", outside="192.168.7.7"),
       6: dict(pod="fd00:244::10", other="fd00:244::11", peer="fd00::2", internet="2001:db8::1", node="fd00::1",
               stranger="fd00:244::99", outside="2001:db8:7::7")}


MANY = tuple(f"10.{i}.0.0/16" for i in range(20)) + ("10.244.0.0/16", "fd00::/8",) + tuple(f"fd{i:02x}::/16" for i in range(1, 21))


@pytest.mark.parametrize("family", [4, 6])
@pytest.mark.parametrize("n", [10, 110])
@pytest.mark.parametrize("cidrs", [("10.0.0.0/8", "fd00::/8"), MANY], ids=["few-cidrs", "many-cidrs"])
def test_every_packet_counted_once_by_direction_and_scope_in_one_or_two_lookups(family, n, cidrs):
    """What each kind of packet is counted as, marked with, and costs in set lookups, for 10 and
    110 pods; with few internal CIDRs the scope test is plain rules, with many one more lookup."""
    st = state(n, default_class=DEFAULT, internal_cidrs=cidrs)
    a = dict(NET[family], peer="10.1.0.2" if family == 4 else "fd00::2")
    scope = 0 if cidrs != MANY else 1  # the internal set, when the CIDRs are too many for rules
    cases = [  # src, dst, out device, local source -> counted, mark, class, set lookups
        (a["pod"], a["peer"], "eth0", False, ["node egress internal", "ns/p0 egress_internal"], 0, None, 1 + scope),
        (a["pod"], a["internet"], "eth0", False, ["ns/p0 egress_internet", "node egress internet"], 0x1000, (1, 0x10),
         1 + scope),
        (a["peer"], a["pod"], "vp0", False, ["ns/p0 ingress_internal"], 0, None, 2),
        (a["node"], a["pod"], "vp0", True, ["ns/p0 ingress_internal"], 0, None, 2),
        (a["internet"], a["pod"], "vp0", False, ["ns/p0 ingress_internet"], 0, None, 3),
        (a["pod"], a["other"], "vp1", False, ["ns/p0 egress_internal", "ns/p1 ingress_internal"], 0, None, 4 + 2 * scope),
        (a["node"], a["internet"], "eth0", True, ["node egress internet"], 0, None, 1 + scope),
        (a["node"], a["peer"], "eth0", True, ["node egress internal"], 0, None, 1 + scope),
        (a["peer"], a["internet"], "vx", False, [], 0, None, 2),  # neither end a pod, not an uplink
    ]
    for src, dst, oif, local, counted, mark, prio, lookups in cases:
        pkt = evaluate(st, family, src, dst, oif, local)
        what = f"{src} -> {dst} via {oif}: {pkt}"
        assert (pkt["counted"], pkt["mark"], pkt["priority"], pkt["lookups"]) == (counted, mark, prio, lookups), what


def test_few_internal_cidrs_are_rules_many_are_a_set():
    few, many = R.build(state(3), 4), R.build(state(3, internal_cidrs=MANY), 4)
    assert sum(r.startswith("-d ") for r in few.chains["NETAGENT-NODE-OUT"]) == 4  # 10/8 + link-local, multicast, bcast
    assert not any("netagent-internal4" in r for rules in few.chains.values() for r in rules)
    assert sum("--match-set netagent-internal4" in r for rules in many.chains.values() for r in rules) == 4
    assert not any(r.startswith(("-d ", "-s ")) for rules in many.chains.values() for r in rules)


@pytest.mark.parametrize("family", [4, 6])
def test_a_pod_outside_the_internal_cidrs_is_counted_by_the_other_ends_scope(family):
    """A pod whose own address is not internal (pod CIDR left out of the internal CIDRs): the scope is
    always the other end's, as before: its packets to a neighbour are internal egress for it and
    internet ingress for the neighbour; the neighbour's replies are internet egress and internal ingress."""
    a = NET[family]
    odd = PodClassification("ns/odd", (a["outside"],), (1, 0x77))
    st = state(2, pods=(*pods(2), odd))
    assert evaluate(st, family, a["outside"], a["pod"], "vp0")["counted"] == ["ns/odd egress_internal", "ns/p0 ingress_internet"]
    assert evaluate(st, family, a["pod"], a["outside"], "vp2")["counted"] == ["ns/p0 egress_internet", "ns/odd ingress_internal"]
    assert evaluate(st, family, a["outside"], a["internet"], "eth0")["counted"] == ["ns/odd egress_internet", "node egress internet"]


@pytest.mark.parametrize("family", [4, 6])
def test_unknown_sources_go_to_the_default_class_and_known_pods_keep_theirs(family):
    st = state(3, default_class=DEFAULT)
    known, stranger = ("10.244.0.11", "10.244.0.99") if family == 4 else ("fd00:244::11", "fd00:244::99")
    internet, peer = ("192.0.2.1", "10.0.0.2") if family == 4 else ("2001:db8::1", "fd00::2")
    node_ip = "10.0.0.1" if family == 4 else "fd00::1"

    pod = evaluate(st, family, known, internet, "eth0")
    assert (pod["mark"], pod["priority"]) == (0x1000, (1, 0x11))
    assert pod["counted"] == ["ns/p1 egress_internet", "node egress internet"]

    unknown = evaluate(st, family, stranger, internet, "eth0")
    assert (unknown["mark"], unknown["priority"]) == (0x1000, DEFAULT)
    assert unknown["counted"] == ["unknown source egress internet", "node egress internet"]

    for quiet in (evaluate(st, family, stranger, peer, "eth0"),            # internal destination
                  evaluate(st, family, node_ip, internet, "eth0", True),   # the node's own traffic
                  evaluate(st, family, stranger, internet, "veth9"),       # not leaving by an uplink
                  evaluate(state(3), family, stranger, internet, "eth0")):  # no default class: as before
        assert (quiet["mark"], quiet["priority"]) == (0, None)
        assert "unknown source egress internet" not in quiet["counted"]


def test_catch_all_is_in_the_node_egress_chain_after_the_pods_set():
    rs = R.build(state(2, default_class=DEFAULT, uplinks=("eth0", "eth1")), 6)
    assert rs.chains["NETAGENT-POSTROUTING"] == (
        "-o eth0 -g NETAGENT-NODE-OUT", "-o eth1 -g NETAGENT-NODE-OUT",
        "-m set --match-set netagent-peer6 src -g NETAGENT-FROM-PEER",
        "-m set --match-set netagent-egress-int6 src ! --update-counters -g NETAGENT-FROM-POD",
        "-m set --match-set netagent-ingress-inet6 dst -j RETURN")
    assert rs.chains["NETAGENT-NODE-OUT"] == (
        *(f'-d {net} -m comment --comment "node egress internal" -g NETAGENT-EGRESS-INT'
          for net in ("fd00::/8", "fe80::/10", "ff00::/8")),
        "-j SET --map-set netagent-egress-inet6 src --map-mark --map-prio",
        "-m length --length 0:256 -j SET --map-set netagent-egress-ack6 src --map-prio",
        "-m mark ! --mark 0x1000/0x1000 -m addrtype ! --src-type LOCAL -j NETAGENT-UNKNOWN",
        '-m comment --comment "node egress internet" -j RETURN')
    assert rs.chains["NETAGENT-UNKNOWN"] == (
        '-m comment --comment "unknown source egress internet" -j MARK --set-xmark 0x1000/0x1000',
        "-j CLASSIFY --set-class 0001:fffe")
    assert "NETAGENT-UNKNOWN" not in R.build(state(2), 6).chains


def test_turning_the_default_class_on_touches_only_the_node_egress_chain():
    old = R.build(state(20), 4)
    new = R.build(state(20, default_class=DEFAULT), 4)
    up = R.render_update(new, *kernel_view(old))
    assert up.changes == 2 and up.rewritten == ("NETAGENT-NODE-OUT",)
    declared = {ln[1:].split()[0] for ln in up.text.splitlines() if ln.startswith(":")}
    assert declared == {"NETAGENT-NODE-OUT", "NETAGENT-UNKNOWN"}
    back = R.render_update(old, *kernel_view(new))
    assert back.changes == 2 and "-X NETAGENT-UNKNOWN" in back.text


@pytest.mark.parametrize("bad", [(0, 0xFFFE), (1, 0x10000), (1,), "1:fffe", (1, True)])
def test_bad_default_class_is_named(bad):
    with pytest.raises(IptablesError, match="default class for unknown sources"):
        R.build(state(default_class=bad), 4)


# -- downloads (internet ingress, issue 13) ----------------------------------------------------------

DL_DEFAULT = (2, 0xFFFE)


def download_state(n: int = 3, **kw) -> ClassifierState:
    shaped = tuple(PodClassification(p.key, p.ips, p.tc_class, (2, p.tc_class[1])) for p in pods(n))
    return state(n, default_class=DEFAULT, ingress_default_class=DL_DEFAULT, pods=shaped, **kw)


@pytest.mark.parametrize("family", [4, 6])
@pytest.mark.parametrize("n", [10, 110])
def test_downloads_are_marked_to_the_pods_download_class_and_nothing_else_is(family, n):
    """Internet -> a known pod: counted, our mark, the pod's download class, in the same three set
    lookups as before; internet -> an address no known pod holds: the download default class;
    internal, node-sourced, pod-to-pod and upload packets: exactly as without download shaping."""
    st = download_state(n)
    a = dict(NET[family], stranger="10.244.3.250" if family == 4 else "fd00:244:3::250")
    pkt = evaluate(st, family, a["internet"], a["pod"], "vp0")
    assert (pkt["counted"], pkt["mark"], pkt["priority"], pkt["lookups"]) == (["ns/p0 ingress_internet"], 0x1000, (2, 0x10), 3)
    unknown = evaluate(st, family, a["internet"], a["stranger"], "vp9")
    assert (unknown["counted"], unknown["mark"], unknown["priority"]) == (
        ["unknown destination ingress internet"], 0x1000, DL_DEFAULT)
    same = [  # never marked for downloads, counted as without download shaping
        (a["peer"], a["pod"], "vp0", False),        # internal peer -> pod
        (a["node"], a["pod"], "vp0", True),         # host -> pod (node address in the internal CIDRs)
        (a["outside"], a["pod"], "vp0", True),      # host -> pod from a node address that is not internal
        (a["outside"], a["stranger"], "vp9", True),  # host -> an unknown pod
        (a["pod"], a["other"], "vp1", False),        # pod -> pod on the node
        (a["pod"], a["internet"], "eth0", False),    # upload: its own class, unchanged
        (a["pod"], a["peer"], "eth0", False),
    ]
    for src, dst, oif, local in same:
        with_dl, without = evaluate(st, family, src, dst, oif, local), evaluate(state(n, default_class=DEFAULT), family, src, dst, oif, local)
        assert with_dl == without, f"{src} -> {dst} via {oif}: {with_dl} != {without}"
        assert with_dl["priority"] in (None, (1, 0x10)), with_dl


def ack_state(n: int = 3) -> ClassifierState:
    """Pods whose small TCP segments go to their control leaves (minor | 0x8000) in both shapers."""
    steered = tuple(PodClassification(p.key, p.ips, p.tc_class, (2, p.tc_class[1]), ack_class=(1, 0x8000 | p.tc_class[1]),
                                      ingress_ack_class=(2, 0x8000 | p.tc_class[1])) for p in pods(n))
    return state(n, default_class=DEFAULT, ingress_default_class=DL_DEFAULT, pods=steered)


@pytest.mark.parametrize("family", [4, 6])
def test_a_pods_small_packets_go_to_its_control_leaf_and_nothing_else_does(family):
    """A pod's small packets of any protocol (both ways: pure ACKs, SYN/FIN/RST, a request of up to
    256 bytes, a ping, a DNS query) go to its control leaf, still marked and counted as its internet
    traffic; a full-size packet of any protocol, an unknown pod's ACK and internal traffic do not."""
    st, a = ack_state(3), NET[family]
    ack = frozenset({"ACK"})
    up = evaluate(st, family, a["pod"], a["internet"], "eth0", proto="tcp", length=52, tcp_flags=ack)
    assert (up["counted"], up["mark"], up["priority"]) == (["ns/p0 egress_internet", "node egress internet"], 0x1000, (1, 0x8010))
    down = evaluate(st, family, a["internet"], a["pod"], "vp0", proto="tcp", length=72, tcp_flags=ack | {"PSH"})
    assert (down["counted"], down["mark"], down["priority"]) == (["ns/p0 ingress_internet"], 0x1000, (2, 0x8010))
    for kw in (dict(proto="tcp", length=60, tcp_flags=ack | {"FIN"}),          # closing
               dict(proto="tcp", length=60, tcp_flags=frozenset({"SYN"})),     # opening
               dict(proto="tcp", length=256, tcp_flags=ack | {"PSH"}),         # a request
               dict(proto="icmp", length=84),                                  # a ping
               dict(proto="udp", length=60)):                                  # a DNS query
        assert evaluate(st, family, a["pod"], a["internet"], "eth0", **kw)["priority"] == (1, 0x8010), kw
        assert evaluate(st, family, a["internet"], a["pod"], "vp0", **kw)["priority"] == (2, 0x8010), kw
    for kw in (dict(proto="tcp", length=1500, tcp_flags=ack),                  # a data segment
               dict(proto="tcp", length=257, tcp_flags=ack | {"PSH"}),
               dict(proto="udp", length=1428),
               dict(proto="icmp", length=257)):
        assert evaluate(st, family, a["pod"], a["internet"], "eth0", **kw)["priority"] == (1, 0x10), kw
        assert evaluate(st, family, a["internet"], a["pod"], "vp0", **kw)["priority"] == (2, 0x10), kw
    small = dict(proto="tcp", length=52, tcp_flags=ack)
    assert evaluate(st, family, a["stranger"], a["internet"], "eth0", **small)["priority"] == DEFAULT
    assert evaluate(st, family, a["pod"], a["peer"], "eth0", **small)["priority"] is None
    assert evaluate(st, family, a["peer"], a["pod"], "vp0", **small)["priority"] is None
    # the steering sets hold the leaves only; without a download shaper the download one stays empty
    rs = R.build(st, family)
    assert rs.sets[f"netagent-egress-ack{family}"].create.endswith("skbinfo")
    assert not rs.sets[f"netagent-egress-ack{family}"].counted
    assert rs.sets[f"netagent-egress-ack{family}"].members[a["pod"]] == (("skbprio", "1:8010"),)
    unshaped = state(3, pods=tuple(PodClassification(p.key, p.ips, p.tc_class, ack_class=(1, 0x8000 | p.tc_class[1]))
                                   for p in pods(3)))
    assert R.build(unshaped, family).sets[f"netagent-ingress-ack{family}"].members == {}


def test_download_members_carry_the_mark_and_class_only_when_shaped():
    shaped = R.build(download_state(1), 4).sets["netagent-ingress-inet4"]
    assert shaped.members == {"10.244.0.10": (("comment", "ns/p0"), ("skbmark", "0x1000/0x1000"), ("skbprio", "2:10"))}
    counted = R.build(state(1), 4).sets["netagent-ingress-inet4"]
    assert counted.members == {"10.244.0.10": (("comment", "ns/p0"),)} and counted.extensions == shaped.extensions
    rs = R.build(download_state(1), 4)
    assert rs.chains["NETAGENT-UNKNOWN-IN"] == (
        '-m comment --comment "unknown destination ingress internet" -j MARK --set-xmark 0x1000/0x1000',
        "-j CLASSIFY --set-class 0002:fffe")
    assert rs.chains["NETAGENT-FROM-HOST"] == ("-m set --match-set netagent-ingress-inet4 dst -j RETURN",)


def test_turning_download_shaping_on_and_off_touches_only_the_postrouting_chain():
    old, new = R.build(state(20, default_class=DEFAULT), 4), R.build(download_state(20), 4)
    up = R.render_update(new, *kernel_view(old))
    assert up.rewritten == ("NETAGENT-POSTROUTING",) and up.changes == 3
    back = R.render_update(old, *kernel_view(new))
    assert "-X NETAGENT-UNKNOWN-IN" in back.text and "-X NETAGENT-FROM-HOST" in back.text


@pytest.mark.parametrize("bad", [(0, 0xFFFE), (2, 0x10000), "2:fffe"])
def test_bad_download_classes_are_named(bad):
    with pytest.raises(IptablesError, match="download default class"):
        R.build(state(ingress_default_class=bad), 4)
    with pytest.raises(IptablesError, match="ns/p0 download"):
        R.build(state(1, pods=(PodClassification("ns/p0", ("10.244.0.10",), (1, 0x10), bad),)), 4)


# -- internal bytes counted on the pods' devices (tc/ebpf/) ----------------------------------------

def evaluate_by_device(state: ClassifierState, family: int, src: str, dst: str, oif: str, local_src: bool = False,
                       **kw) -> dict:
    """`evaluate` with the rules of `internal_by_device`, and the device counter modelled as tc/ebpf/
    programs it: on a pod's device, what the pod sends to an internal destination counts as its internal
    egress (before the rules), what it receives from an internal source as its internal ingress (after);
    on an uplink, what arrives counts as the node's ingress by its source's scope (before the rules), what
    leaves for an internal destination as its internal egress (after)."""
    st = dataclasses.replace(state, internal_by_device=True)
    internal = [ipaddress.ip_network(n) for n in R.set_members(st.internal_cidrs)[family]]
    here = {ipaddress.ip_address(ip): p.key for p in st.pods for ip in p.ips}
    s, d = ipaddress.ip_address(src), ipaddress.ip_address(dst)
    pkt = evaluate(st, family, src, dst, oif, local_src, **kw)
    s_internal, d_internal = any(s in n for n in internal), any(d in n for n in internal)
    sent = [f"{here[s]} egress_internal"] if s in here and d_internal else []
    received = [f"{here[d]} ingress_internal"] if d in here and s_internal else []
    if kw.get("iif") in st.uplinks:
        sent.insert(0, f"node ingress {'internal' if s_internal else 'internet'}")
    if oif in st.uplinks and d_internal:
        received.append("node egress internal")
    pkt["counted"] = sent + pkt["counted"] + received
    return pkt


def packets(family: int) -> list[tuple[str, str, str, bool]]:
    """Every kind of packet the node forwards or sends: (src, dst, out device, local source)."""
    a = NET[family]
    return [(a["pod"], a["peer"], "eth0", False), (a["pod"], a["internet"], "eth0", False),
            (a["peer"], a["pod"], "vp0", False), (a["node"], a["pod"], "vp0", True),
            (a["internet"], a["pod"], "vp0", False), (a["pod"], a["other"], "vp1", False),
            (a["node"], a["internet"], "eth0", True), (a["node"], a["peer"], "eth0", True),
            (a["peer"], a["internet"], "vx", False), (a["stranger"], a["internet"], "eth0", False),
            (a["internet"], a["stranger"], "vp9", False), (a["outside"], a["pod"], "vp0", False),
            (a["pod"], a["outside"], "vp2", False), (a["outside"], a["internet"], "eth0", False),
            (a["outside"], a["pod"], "vp0", True), (a["pod"], a["internet"], "vx", False)]


@pytest.mark.parametrize("family", [4, 6])
@pytest.mark.parametrize("cidrs", [("10.0.0.0/8", "fd00::/8"), MANY], ids=["few-cidrs", "many-cidrs"])
@pytest.mark.parametrize("shaped", ["uploads", "downloads"])
def test_counting_on_the_devices_changes_no_count_mark_or_class(family, cidrs, shaped):
    """Every packet is counted as the same kinds for the same pods and the node, marked and classified the same,
    whether the rules count internal bytes or the devices do (pods' and uplinks'); a pod outside the internal
    CIDRs included."""
    base = state(3, internal_cidrs=cidrs) if shaped == "uploads" else download_state(3, internal_cidrs=cidrs)
    odd = PodClassification("ns/odd", (NET[family]["outside"],), (1, 0x77), base.pods[0].ingress_class)
    st = dataclasses.replace(base, pods=(*base.pods, odd))
    pod_addresses = {ipaddress.ip_address(ip) for p in st.pods for ip in p.ips}
    for src, dst, oif, local in packets(family):
        # where it came from: the node sent it, a pod's device (a pod's or an unknown pod's address), or an uplink
        iif = None if local else "vp-src" if ipaddress.ip_address(src) in pod_addresses | {
            ipaddress.ip_address(NET[family]["stranger"])} else "eth0"
        by_rules = evaluate(st, family, src, dst, oif, local, iif=iif)
        by_device = evaluate_by_device(st, family, src, dst, oif, local, iif=iif)
        what = f"{src} -> {dst} via {oif}: {by_rules} / {by_device}"
        assert sorted(by_rules["counted"]) == sorted(by_device["counted"]), what
        assert (by_rules["mark"], by_rules["priority"]) == (by_device["mark"], by_device["priority"]), what
        # never more lookups, but one where the internal CIDRs are a set and an internal source forwards
        # elsewhere than an uplink or a pod (its scope test and its destination's, where the peer set was one)
        assert by_device["lookups"] <= by_rules["lookups"] + (cidrs == MANY), what


@pytest.mark.parametrize("family", [4, 6])
@pytest.mark.parametrize("n", [10, 110])
def test_a_packet_with_both_ends_internal_costs_no_set_lookup_and_no_device_test(family, n):
    """With the devices counting, internal traffic of any direction meets plain scope rules only (with few
    internal CIDRs; with many, the internal set's lookups), whatever the number of pods and uplinks: no
    -i/-o test, and no PREROUTING hook at all."""
    a = NET[family]
    for cidrs, scope in ((("10.0.0.0/8", "fd00::/8"), 0), (MANY, 1)):
        st = state(n, default_class=DEFAULT, internal_cidrs=cidrs, uplinks=("eth0", "eth1"))
        cases = [(a["pod"], a["peer"], "eth0", "vp0"), (a["peer"], a["pod"], "vp0", "eth0"),
                 (a["pod"], a["other"], "vp1", "vp0"), (a["node"], a["pod"], "vp0", None)]
        for src, dst, oif, iif in cases:
            pkt = evaluate_by_device(st, family, src, dst, oif, iif is None, iif=iif)
            assert (pkt["lookups"], pkt["device_tests"]) == (2 * scope, 0), (src, dst, pkt)
            assert pkt["mark"] == 0 and pkt["priority"] is None
    rs = R.build(dataclasses.replace(state(n), internal_by_device=True), family)
    assert not any(f"netagent-{k}{family}" in r for rules in rs.chains.values() for r in rules
                   for k in ("ingress-int", "peer"))
    assert {"NETAGENT-EGRESS-INT", "NETAGENT-FROM-PEER", "NETAGENT-POD-INT", "NETAGENT-NODE-IN",
            "NETAGENT-PREROUTING"}.isdisjoint(rs.chains)
    assert rs.jumps == (("POSTROUTING", "-j NETAGENT-POSTROUTING"),)
    assert not any("comment" in r for r in rs.chains["NETAGENT-NODE-OUT"] if "internet" not in r)


def test_switching_where_internal_bytes_are_counted_touches_no_set():
    """The sets are the same either way (a counted set is never re-created), so the switch is chains only."""
    old = R.build(state(20), 4)
    new = R.build(dataclasses.replace(state(20), internal_by_device=True), 4)
    assert old.sets == new.sets
    up = R.render_update(new, *kernel_view(old))
    assert set(up.rewritten) == {"NETAGENT-POSTROUTING", "NETAGENT-NODE-OUT", "NETAGENT-FROM-POD", "NETAGENT-TO-POD"}
    assert {"-X NETAGENT-EGRESS-INT", "-X NETAGENT-FROM-PEER", "-X NETAGENT-POD-INT", "-X NETAGENT-NODE-IN",
            "-X NETAGENT-PREROUTING", "-D PREROUTING -j NETAGENT-PREROUTING"} <= set(up.text.splitlines())
    back = R.render_update(old, *kernel_view(new))  # and back: the PREROUTING hook returns
    assert "-I PREROUTING 1 -j NETAGENT-PREROUTING" in back.text.splitlines()
