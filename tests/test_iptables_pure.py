"""Pure tests of iptables/ rendering, diffing, parsing and detection: no root, no kernel."""
from __future__ import annotations

import ipaddress
import shlex

import pytest

from iptables import render as R
from iptables.backend import choose_backend, has_kubelet_hint, rule_count
from iptables.errors import IptablesError
from iptables.model import ClassifierState, PodClassification
from iptables.parse import comment_of, counted_comments, mark_masks, normalise, parse_ipset_save, parse_save, tokens


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


def walk(chains: dict[str, list[list[str]]], root: str, flag: str, addr: str) -> tuple[str | None, int]:
    """Follow -s/-d matches and -g gotos from `root`; -> (pod chain reached, rules evaluated)."""
    ip = ipaddress.ip_address(addr)
    chain, evaluated = root, 0
    while True:
        for rule in chains[chain]:
            evaluated += 1
            net = ipaddress.ip_network(rule[rule.index(flag) + 1])
            if ip in net:
                chain = rule[rule.index("-g") + 1]
                break
        else:
            return None, evaluated
        if chain not in chains or not chains[chain] or flag not in chains[chain][0]:
            return chain, evaluated


# -- render -----------------------------------------------------------------------------

def test_render_is_deterministic_and_family_specific():
    st = state(3)
    v4, v6 = R.render(st, 4), R.render(st, 6)
    assert v4 == R.render(st, 4)
    assert "10.244.0.10/32" in v4 and "fd00:244" not in v4
    assert "fd00:244::10/128" in v6 and "10.244" not in v6
    assert "--match-set netagent-internal4 dst" in v4 and "--match-set netagent-internal6 dst" in v6
    assert "-j MARK --set-xmark 0x1000/0x1000" in v4
    assert "-j CLASSIFY --set-class 0001:0010" in v4
    assert "-I POSTROUTING 1 -j NETAGENT-POSTROUTING" in v4 and "-I PREROUTING 1 -j NETAGENT-PREROUTING" in v4
    assert v4.startswith("*mangle\n") and v4.endswith("COMMIT\n")


def test_every_chain_is_ours_and_short_enough():
    rs = R.build(state(110), 4, prefix="ABCDEFGHIJKL")
    for name in rs.chains:
        assert R.is_ours(name, "ABCDEFGHIJKL") and len(name) <= R.MAX_CHAIN_NAME
    assert not R.is_ours("ABCDEFGHIJKLM-X", "ABCDEFGHIJKL")


def test_pod_chains_count_each_direction_and_scope():
    rs = R.build(state(1), 4)
    e = R.pod_chain("NETAGENT", "egress", "ns/p0")
    i = R.pod_chain("NETAGENT", "ingress", "ns/p0")
    assert [comment_of(r) for r in rs.chains[e][:2]] == ["ns/p0 egress internal", "ns/p0 egress internet"]
    assert [comment_of(r) for r in rs.chains[i]] == ["ns/p0 ingress internal", "ns/p0 ingress internet"]
    assert rs.pod_chains == {e: "ns/p0", i: "ns/p0"}


def test_long_pod_keys_keep_the_counted_kind_in_the_comment():
    key = "n" * 63 + "/" + "p" * 253  # the longest Kubernetes namespace/name
    rs = R.build(state(pods=(PodClassification(key, ("10.244.0.9",), (1, 9)),)), 4)
    texts = [comment_of(r) for r in rs.chains[R.pod_chain("NETAGENT", "egress", key)][:2]]
    assert all(len(t.encode()) < 255 for t in texts)
    assert texts[0].endswith(" egress internal") and texts[1].endswith(" egress internet")
    assert rs.pod_chains[R.pod_chain("NETAGENT", "egress", key)] == key


@pytest.mark.parametrize("family", [4, 6])
def test_dispatch_reaches_every_pod_in_few_rules(family):
    st = state(110)
    chains = parse_restore(R.render(st, family))
    worst = 0
    for pod in st.pods:
        addr = [a for a in pod.ips if ipaddress.ip_address(a).version == family][0]
        for root, flag, direction in (("NETAGENT-EGRESS", "-s", "egress"), ("NETAGENT-INGRESS", "-d", "ingress")):
            reached, evaluated = walk(chains, root, flag, addr)
            assert reached == R.pod_chain("NETAGENT", direction, pod.key)
            worst = max(worst, evaluated)
    assert worst <= 2 * R.FANOUT  # a flat list would be up to 110 rules
    outsider = "10.9.9.9" if family == 4 else "fd00:9::9"
    assert walk(chains, "NETAGENT-EGRESS", "-s", outsider)[0] is None


def test_dispatch_of_scattered_addresses():
    scattered = tuple(PodClassification(f"ns/s{i}", (f"10.{i}.{i * 7 % 256}.{i * 13 % 250 + 1}",), (1, i + 1))
                      for i in range(60))
    st = state(pods=scattered)
    chains = parse_restore(R.render(st, 4))
    for pod in scattered:
        assert walk(chains, "NETAGENT-EGRESS", "-s", pod.ips[0])[0] == R.pod_chain("NETAGENT", "egress", pod.key)


def test_single_stack_pods_appear_only_in_their_family():
    v4_only = PodClassification("ns/four", ("10.244.0.5",), (1, 5))
    v6_only = PodClassification("ns/six", ("fd00:244::6",), (1, 6))
    st = state(pods=(v4_only, v6_only))
    assert set(R.build(st, 4).pod_chains.values()) == {"ns/four"}
    assert set(R.build(st, 6).pod_chains.values()) == {"ns/six"}


def test_node_counters_hook_every_uplink():
    rs = R.build(state(0, uplinks=("eth0", "eth1")), 4)
    post = rs.chains["NETAGENT-POSTROUTING"]
    assert "-o eth0 -j NETAGENT-NODE-OUT" in post and "-o eth1 -j NETAGENT-NODE-OUT" in post
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


def test_class_change_rewrites_only_that_pods_chain():
    old = state(20)
    changed = list(old.pods)
    changed[5] = PodClassification(changed[5].key, changed[5].ips, (1, 0x999))
    rs = R.build(ClassifierState(old.mark_bit, old.internal_cidrs, tuple(changed), old.uplinks), 4)
    up = R.render_update(rs, *kernel_view(R.build(old, 4)))
    e = R.pod_chain("NETAGENT", "egress", "ns/p5")
    assert up.rewritten == (e,) and up.changes == 1
    assert "--set-class 0001:0999" in up.text


def test_pod_removal_deletes_its_chains_after_unhooking():
    old = state(3)
    rs = R.build(ClassifierState(old.mark_bit, old.internal_cidrs, old.pods[:2], old.uplinks), 4)
    up = R.render_update(rs, *kernel_view(R.build(old, 4)))
    lines = up.text.splitlines()
    gone = {R.pod_chain("NETAGENT", d, "ns/p2") for d in ("egress", "ingress")}
    assert {ln.split()[1] for ln in lines if ln.startswith("-X ")} == gone
    # the dispatch chains that referenced them are refilled in the same transaction, before -X
    assert max(i for i, ln in enumerate(lines) if ln.startswith("-A NETAGENT-EGRESS")) < lines.index(f"-X {sorted(gone)[0]}")


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


def evaluate(state: ClassifierState, family: int, src: str, dst: str, oif: str, local_src: bool = False) -> dict:
    """Run one packet through a parse of the rendered POSTROUTING rules, as the kernel would.

    -> {"mark": skb mark, "priority": (major, minor) or None, "counted": comments of the rules it matched}.
    """
    chains = parse_restore(R.render(state, family))
    internal = [ipaddress.ip_network(c) for c in R.set_members(state.internal_cidrs)[family]]
    pkt = {"mark": 0, "priority": None, "counted": []}

    def matches(rule: list[str]) -> bool:
        i, negate, ok = 0, False, True
        while i < len(rule) and rule[i] not in ("-j", "-g"):
            tok, arg = rule[i], rule[i + 1] if i + 1 < len(rule) else ""
            result = None
            if tok == "!":
                negate, i = True, i + 1
                continue
            if tok == "-o":
                result = arg == oif
            elif tok in ("-s", "-d"):
                result = ipaddress.ip_address(src if tok == "-s" else dst) in ipaddress.ip_network(arg)
            elif tok == "--mark":
                value, mask = (int(v, 16) for v in arg.split("/"))
                result = pkt["mark"] & mask == value
            elif tok == "--match-set":
                addr = ipaddress.ip_address(src if rule[i + 2] == "src" else dst)
                result = any(addr in net for net in internal)
            elif tok == "--src-type" and arg == "LOCAL":
                result = local_src
            elif tok not in ("-m", "--comment"):
                raise AssertionError(f"this fake does not know {tok} {arg}")
            if result is not None:
                ok = ok and (result != negate)
            negate, i = False, i + (3 if tok == "--match-set" else 2)  # option, argument(s)
        return ok

    def run(chain: str) -> None:
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
                return
            if target == "MARK":
                value, mask = (int(v, 16) for v in rule[where + 3].split("/"))
                pkt["mark"] = (pkt["mark"] & ~mask) | value
            elif target == "CLASSIFY":
                pkt["priority"] = tuple(int(v, 16) for v in rule[where + 3].split(":"))
            else:
                run(target)
                if verb == "-g":
                    return

    run("NETAGENT-POSTROUTING")
    return pkt


@pytest.mark.parametrize("family", [4, 6])
def test_unknown_sources_go_to_the_default_class_and_known_pods_keep_theirs(family):
    st = state(3, default_class=DEFAULT)
    known, stranger = ("10.244.0.11", "10.244.0.99") if family == 4 else ("fd00:244::11", "fd00:244::99")
    internet, peer = ("192.0.2.1", "10.0.0.2") if family == 4 else ("2001:db8::1", "fd00::2")
    node_ip = "10.0.0.1" if family == 4 else "fd00::1"

    pod = evaluate(st, family, known, internet, "eth0")
    assert (pod["mark"], pod["priority"]) == (0x1000, (1, 0x11))
    assert "unknown source egress internet" not in pod["counted"]

    unknown = evaluate(st, family, stranger, internet, "eth0")
    assert (unknown["mark"], unknown["priority"]) == (0x1000, DEFAULT)
    assert unknown["counted"] == ["unknown source egress internet", "node egress internet"]

    for quiet in (evaluate(st, family, stranger, peer, "eth0"),            # internal destination
                  evaluate(st, family, node_ip, internet, "eth0", True),   # the node's own traffic
                  evaluate(st, family, stranger, internet, "veth9"),       # not leaving by an uplink
                  evaluate(state(3), family, stranger, internet, "eth0")):  # no default class: as before
        assert (quiet["mark"], quiet["priority"]) == (0, None)
        assert "unknown source egress internet" not in quiet["counted"]


def test_catch_all_is_in_the_node_egress_chain_after_the_pod_dispatch():
    rs = R.build(state(2, default_class=DEFAULT, uplinks=("eth0", "eth1")), 6)
    assert rs.chains["NETAGENT-POSTROUTING"] == (
        "-j NETAGENT-EGRESS", "-o eth0 -j NETAGENT-NODE-OUT", "-o eth1 -j NETAGENT-NODE-OUT",
        "-o eth0 -j RETURN", "-o eth1 -j RETURN", "-j NETAGENT-INGRESS")
    assert rs.chains["NETAGENT-NODE-OUT"] == (
        '-m set --match-set netagent-internal6 dst -m comment --comment "node egress internal" -j RETURN',
        "-m mark ! --mark 0x1000/0x1000 -m addrtype ! --src-type LOCAL -j NETAGENT-UNKNOWN",
        '-m comment --comment "node egress internet" -j RETURN')
    assert rs.chains["NETAGENT-UNKNOWN"] == (
        '-m comment --comment "unknown source egress internet" -j MARK --set-xmark 0x1000/0x1000',
        "-j CLASSIFY --set-class 0001:fffe")
    assert "NETAGENT-UNKNOWN" not in R.build(state(2), 6).chains


def test_turning_the_default_class_on_touches_no_pod_chain():
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
