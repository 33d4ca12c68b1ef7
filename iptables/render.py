"""Pure rendering: a `ClassifierState` becomes chains, rules, ipsets and iptables-restore text.

Nothing here runs a command. `build()` returns the desired ruleset of one family as
plain data (chain -> rule texts, in the exact canonical form `iptables-save` prints,
so a read-back compares token for token, and the ipsets with their members);
`render()` is its full restore text; `render_update()` is the minimal transaction
that turns what the kernel holds into it.

Layout (per family, mangle table; see docs/iptables.md). A packet costs one or two set
lookups in the common cases whatever the number of pods; the rules never name a pod, so
a pod that comes, goes or changes class changes set members only. "dst internal?" is one
plain -d rule per internal CIDR while there are at most RULE_CIDRS_MAX, else a lookup in
the internal set:

    PREROUTING  -> P-PREROUTING: -i <uplink> -j P-NODE-IN      node ingress by scope
    POSTROUTING -> P-POSTROUTING:
        -o <uplink> -g P-NODE-OUT            leaves by an uplink (never to a pod of this node)
             dst internal? count node egress internal -g P-EGRESS-INT: src in egress-int (the pod's count)
             SET --map-set egress-inet src --map-mark --map-prio   (the pod's count, our bit, its HTB class)
             small packet: SET --map-set egress-ack src --map-prio (the pod's control leaf instead)
             [not marked, not a node address -> P-UNKNOWN: MARK, CLASSIFY default]; count node egress internet
        src in peer (internal, no pod here) -g P-FROM-PEER:   dst in ingress-int (the pod's count)
        src a pod here                      -g P-FROM-POD:    egress by dst scope, then P-TO-POD
        dst in ingress-inet (the pod's count): e.g. de-NATed replies from the internet
      with downloads shaped (`ingress_default_class`), that last rule becomes:
        src a node address                  -g P-FROM-HOST:   dst in ingress-inet (count; never shaped)
        SET --map-set ingress-inet dst --map-mark --map-prio   (the pod's count, our bit, its download class)
        small packet: SET --map-set ingress-ack dst --map-prio  (the pod's download control leaf)
        [not marked -> P-UNKNOWN-IN: MARK, CLASSIFY download default]

With the internal bytes counted on the devices (`internal_by_device`, tc/ebpf/: the pods' on
their devices, the node's totals on its uplinks), no rule counts them: a packet whose both ends
are internal meets the POSTROUTING hook and its plain scope rules only, no set and no device
test, and nothing hooks PREROUTING (it only counted the node's ingress):

    POSTROUTING -> P-POSTROUTING:
        src internal                        -g P-SRC-INT:     dst internal -> RETURN;
                                                              -o <uplink> -g P-INET-OUT;
                                                              else egress-inet src (the pod's count)
        -o <uplink> -g P-NODE-OUT: dst internal -> RETURN (uncounted); -g P-INET-OUT
             P-INET-OUT: NODE-OUT's internet rules above (SET egress-inet, ..., count node egress internet)
        src a pod here (not internal)       -g P-FROM-POD:    egress by dst scope, then P-TO-POD
        the last rules as above
"""
from __future__ import annotations

import base64
import hashlib
import ipaddress
import re
from dataclasses import dataclass

from iptables.errors import IptablesError
from iptables.model import ClassifierState, PodClassification
from iptables.parse import normalise

TABLE = "mangle"
MAX_CHAIN_NAME = 28  # XT_EXTENSION_MAXNAMELEN - 1: a 12-character prefix + "-POSTROUTING" fits
MAX_SET_NAME = 31  # IPSET_MAXNAMELEN - 1: a 12-character prefix + "-ingress-inet4" or "-internal4-tmp" fits
MAX_KEY_IN_COMMENT = 200  # an ipset comment holds 255 bytes
_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,11}$")
_IFNAME_RE = re.compile(r"^[^\s/:\"']{1,15}$")
_KEY_RE = re.compile(r"^[^\"\\\n\r\t]{1,}$")
HOOKS = ("PREROUTING", "POSTROUTING")
# Never internet, whatever the configuration: link-local (cloud metadata, neighbour discovery),
# multicast (MLD reports, mDNS) and the limited broadcast. Always in the internal sets.
ALWAYS_INTERNAL = {4: ("169.254.0.0/16", "224.0.0.0/4", "255.255.255.255/32"), 6: ("fe80::/10", "ff00::/8")}
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
KINDS = ("egress_internal", "egress_internet", "ingress_internal", "ingress_internet")
# the node also counts internet egress it forwarded from sources that are no known pod (P-UNKNOWN)
UNKNOWN_KIND = "egress_unknown_internet"
# ... and internet ingress it forwarded to addresses that are no known pod (P-UNKNOWN-IN)
UNKNOWN_INGRESS_KIND = "ingress_unknown_internet"
NODE_KINDS = (*KINDS, UNKNOWN_KIND, UNKNOWN_INGRESS_KIND)
# per-pod sets (hash:ip, one member per pod address, the pod key as comment): what their counters count
POD_SET_KINDS = {"egress-int": "egress_internal", "egress-inet": "egress_internet",
                 "ingress-int": "ingress_internal", "ingress-inet": "ingress_internet"}
# per-pod sets that steer a pod's small packets to its control leaf (skbprio only, uncounted;
# named for the pure ACKs they first carried)
ACK_SET_SUFFIXES = ("egress-ack", "ingress-ack")
SET_SUFFIXES = ("internal", "peer", *POD_SET_KINDS, *ACK_SET_SUFFIXES)
# what goes to a pod's control leaf: packets of at most this many bytes (IP header included), of
# any protocol: pure ACKs (at most 100 bytes in IPv6 with every option), connection setup and
# teardown (SYN, FIN, RST), request-sized messages, pings, DNS queries; never a full segment.
# Pure ACKs alone (<= 128 bytes) left a new connection's handshake and first request behind the
# pod's own bulk data: a download started beside the pod's upload first moved after 0.4-1.8 s in
# the demo, 0.42-0.44 s with small TCP segments. TCP only left a ping or a DNS query behind the
# pod's upload backlog, 1.15x the CNI plugin's TBF at 20M (docs/datapath.md): this is the sparse
# lane fq_codel gives a new flow, where the kernel has no fq_codel. Everything here stays within
# the pod's own rate and ceil, so a pod that floods small packets only delays its own bulk data.
CONTROL_MAX_BYTES = 256
CONTROL_MATCH = f"-m length --length 0:{CONTROL_MAX_BYTES}"
COUNTED = ("counters", "comment")
SWAP_SUFFIX = "-tmp"  # uncounted sets are refilled as <name>-tmp and swapped in
# up to this many internal CIDRs per family (link-local and multicast included) the scope test is
# one plain -s/-d rule per CIDR; above it, one lookup in the internal set (bench/classify_cost.py
# --components: a set lookup costs ~300 ns on either backend, a plain rule 8-10 ns)
RULE_CIDRS_MAX = 16


@dataclass(frozen=True)
class IpSet:
    """One ipset as we want it: members with their extensions in the order `ipset save` prints them."""

    name: str
    type: str  # "hash:net" or "hash:ip"
    family: int
    extensions: tuple[str, ...]  # create options: counters, comment, skbinfo
    members: dict[str, tuple[tuple[str, str], ...]]  # canonical member -> ((option, value), ...)

    @property
    def counted(self) -> bool:
        """Counted sets keep their members' counters: changed member by member, never swapped."""
        return "counters" in self.extensions

    @property
    def create(self) -> str:
        return " ".join((self.type, "family", "inet" if self.family == 4 else "inet6", *self.extensions))


@dataclass(frozen=True)
class Ruleset:
    """The desired (or observed) state of our chains in one family's mangle table, and our ipsets."""

    family: int
    chains: dict[str, tuple[str, ...]]  # our chain -> its rules, without "-A <chain> "
    jumps: tuple[tuple[str, str], ...]  # (builtin chain, rule) hooks into our chains
    sets: dict[str, IpSet]


def names(prefix: str) -> dict[str, str]:
    """The fixed chain names for one prefix."""
    return {tag: f"{prefix}-{tag}" for tag in (
        "PREROUTING", "POSTROUTING", "NODE-IN", "NODE-OUT", "UNKNOWN", "UNKNOWN-IN",
        "EGRESS-INT", "FROM-PEER", "FROM-POD", "POD-INT", "TO-POD", "FROM-HOST", "SRC-INT", "INET-OUT")}


def set_names(prefix: str) -> list[str]:
    """Every ipset name ours can have (both families, with the swap sets): cleanup destroys these."""
    return [f"{prefix.lower()}-{suffix}{family}{tmp}" for family in (4, 6) for suffix in SET_SUFFIXES
            for tmp in ("", SWAP_SUFFIX)]


def is_ours(chain: str, prefix: str) -> bool:
    """The single ownership test: every cleanup and every diff goes through it."""
    return chain.startswith(prefix + "-")


def short_hash(text: str) -> str:
    digest = hashlib.sha256(text.encode()).digest()
    return base64.b32encode(digest).decode()[:10]


def ipset_name(prefix: str, family: int) -> str:
    """The internal-CIDR set of one family."""
    return f"{prefix.lower()}-internal{family}"


def xmark(bit: int) -> str:
    return f"0x{bit:x}/0x{bit:x}"


def classify_target(tc_class: tuple[int, int]) -> str:
    major, minor = tc_class
    return f"{major:04x}:{minor:04x}"  # the form iptables-save prints


def skbprio(tc_class: tuple[int, int]) -> str:
    major, minor = tc_class
    return f"{major:x}:{minor:x}"  # the form ipset save prints


def comment(text: str) -> str:
    return f'-m comment --comment "{text}"'


def _host(addr: Address) -> str:
    return str(ipaddress.ip_network(f"{addr}/{addr.max_prefixlen}"))


# -- validation -------------------------------------------------------------------------

def validate_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix or ""):
        raise IptablesError(
            f"chain prefix {prefix!r} is not valid: use 1-12 letters, digits or '_', starting with a letter "
            "(chain names are limited to 28 characters)")


def validate_mark_bit(bit: object) -> int:
    if isinstance(bit, bool) or not isinstance(bit, int) or bit <= 0 or bit > 0xFFFFFFFF or bit & (bit - 1):
        shown = hex(bit) if isinstance(bit, int) and not isinstance(bit, bool) and bit >= 0 else repr(bit)
        raise IptablesError(
            f"mark bit {shown} is not a single bit of the 32-bit firewall mark: pick one power of two such as 0x1000 "
            "that no other component (kube-proxy 0x4000/0x8000, portmap 0x2000, Calico 0xff000000, Tailscale 0xff0000) uses")
    return bit


def split_cidrs(cidrs: tuple[str, ...]) -> dict[int, tuple[str, ...]]:
    """Internal CIDRs by family, canonical and sorted; refuses what hash:net cannot hold."""
    out: dict[int, set] = {4: set(), 6: set()}
    for text in cidrs:
        try:
            net = ipaddress.ip_network(str(text).strip(), strict=False)
        except ValueError as exc:
            raise IptablesError(f"internal CIDR {text!r} is malformed ({exc}): give networks such as 10.0.0.0/8 or fd00::/8") from None
        if net.prefixlen == 0:
            raise IptablesError(
                f"internal CIDR {text!r} covers every address: an ipset hash:net cannot hold /0, and it would make "
                "all traffic internal; list the real internal ranges instead")
        out[net.version].add(net)
    return {fam: tuple(str(n) for n in sorted(nets)) for fam, nets in out.items()}


def set_members(cidrs: tuple[str, ...]) -> dict[int, tuple[str, ...]]:
    """The contents of the internal ipset of each family: the given CIDRs plus ALWAYS_INTERNAL."""
    split = split_cidrs(cidrs)
    return {fam: split_cidrs(split[fam] + ALWAYS_INTERNAL[fam])[fam] for fam in (4, 6)}


def _validate_class(tc_class: object, what: str) -> None:
    if (not isinstance(tc_class, tuple) or len(tc_class) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in tc_class)):
        raise IptablesError(f"{what}: HTB class {tc_class!r} must be a (major, minor) pair of integers")
    major, minor = tc_class
    if not (1 <= major <= 0xFFFF and 0 <= minor <= 0xFFFF):
        raise IptablesError(f"{what}: HTB class {major:#x}:{minor:#x} is out of range (major 1..0xffff, minor 0..0xffff)")


def _validate_pod(pod: PodClassification) -> None:
    if not isinstance(pod.key, str) or not _KEY_RE.match(pod.key):
        raise IptablesError(f"pod key {pod.key!r} must be non-empty text without quotes, backslashes or line breaks")
    _validate_class(pod.tc_class, f"pod {pod.key}")
    if pod.ingress_class is not None:
        _validate_class(pod.ingress_class, f"pod {pod.key} download")
    if pod.ack_class is not None:
        _validate_class(pod.ack_class, f"pod {pod.key} control leaf")
    if pod.ingress_ack_class is not None:
        _validate_class(pod.ingress_ack_class, f"pod {pod.key} download control leaf")
    if not pod.ips:
        raise IptablesError(f"pod {pod.key} has no IP address: leave it out of the state until it has one")


def validate(state: ClassifierState) -> None:
    """Every check that can be made without the kernel; raises IptablesError naming the input."""
    validate_mark_bit(state.mark_bit)
    split_cidrs(state.internal_cidrs)
    if not state.uplinks:
        raise IptablesError("no uplink: node totals and the egress layout need the internet-facing device(s)")
    for dev in state.uplinks:
        if not isinstance(dev, str) or not _IFNAME_RE.match(dev):
            raise IptablesError(f"uplink {dev!r} is not a valid interface name")
    if state.default_class is not None:
        _validate_class(state.default_class, "default class for unknown sources")
    if state.ingress_default_class is not None:
        _validate_class(state.ingress_default_class, "download default class for unknown destinations")
    seen: dict[str, str] = {}
    keys: set[str] = set()
    for pod in state.pods:
        _validate_pod(pod)
        if pod.key in keys:
            raise IptablesError(f"pod {pod.key} appears twice in the classifier state")
        keys.add(pod.key)
        for ip in pod.ips:
            try:
                addr = str(ipaddress.ip_address(ip))
            except ValueError:
                raise IptablesError(f"pod {pod.key}: {ip!r} is not an IP address") from None
            if addr in seen:
                raise IptablesError(f"IP {addr} is claimed by both {seen[addr]} and {pod.key}: one IP, one pod")
            seen[addr] = pod.key


# -- building ---------------------------------------------------------------------------

def _set(prefix: str, family: int, suffix: str, kind: str, extensions: tuple[str, ...],
         members: dict[str, tuple[tuple[str, str], ...]]) -> IpSet:
    return IpSet(f"{prefix.lower()}-{suffix}{family}", kind, family, extensions, members)


def _key_text(key: str) -> str:
    """The pod key as an ipset comment (at most 255 bytes): a long key is cut and tagged with its hash."""
    if len(key.encode()) > MAX_KEY_IN_COMMENT:
        return key.encode()[:MAX_KEY_IN_COMMENT - 12].decode(errors="ignore") + "~" + short_hash(key)
    return key


def build_sets(state: ClassifierState, family: int, prefix: str = "NETAGENT") -> dict[str, IpSet]:
    """The ipsets of one family: the internal CIDRs, the internal sources that are no pod of this
    node, and the four per-pod counting sets (egress/ingress x internal/internet)."""
    internal = set_members(state.internal_cidrs)[family]
    pods: list[tuple[str, PodClassification]] = []
    for pod in state.pods:
        for ip in pod.ips:
            addr = ipaddress.ip_address(ip)
            if addr.version == family:
                pods.append((str(addr), pod))
    named = {ip: (("comment", _key_text(pod.key)),) for ip, pod in pods}
    marked = {ip: (("comment", _key_text(pod.key)), ("skbmark", xmark(state.mark_bit)),
                   ("skbprio", skbprio(pod.tc_class))) for ip, pod in pods}
    # downloads: the same mark bit (the kernel scrubs the mark when a packet enters the pod's
    # namespace, and an egress-marked packet never leaves by a pod's device), the download class
    downloads = {ip: (("comment", _key_text(pod.key)), ("skbmark", xmark(state.mark_bit)),
                      ("skbprio", skbprio(pod.ingress_class)))
                 if pod.ingress_class is not None and state.ingress_default_class is not None
                 else (("comment", _key_text(pod.key)),) for ip, pod in pods}
    acks = {ip: (("skbprio", skbprio(pod.ack_class)),) for ip, pod in pods if pod.ack_class is not None}
    ingress_acks = {ip: (("skbprio", skbprio(pod.ingress_ack_class)),) for ip, pod in pods
                     if pod.ingress_ack_class is not None and state.ingress_default_class is not None}
    peer = {net: () for net in internal}
    peer.update({_host(ipaddress.ip_address(ip)): (("nomatch", ""),) for ip, _ in pods})
    sets = [
        _set(prefix, family, "internal", "hash:net", (), {net: () for net in internal}),
        _set(prefix, family, "peer", "hash:net", (), peer),
        _set(prefix, family, "egress-int", "hash:ip", COUNTED, named),
        _set(prefix, family, "egress-inet", "hash:ip", COUNTED + ("skbinfo",), marked),
        _set(prefix, family, "ingress-int", "hash:ip", COUNTED, named),
        # skbinfo always (a counted set is never re-created); members carry it when downloads are shaped
        _set(prefix, family, "ingress-inet", "hash:ip", COUNTED + ("skbinfo",), downloads),
        _set(prefix, family, "egress-ack", "hash:ip", ("skbinfo",), acks),
        _set(prefix, family, "ingress-ack", "hash:ip", ("skbinfo",), ingress_acks),
    ]
    return {s.name: s for s in sets}


def set_kind(name: str, prefix: str) -> str | None:
    """The counter kind ("egress_internal", ...) a per-pod set of ours counts, else None."""
    head = prefix.lower() + "-"
    if not name.startswith(head) or name[-1:] not in ("4", "6"):
        return None
    return POD_SET_KINDS.get(name[len(head):-1])


def build(state: ClassifierState, family: int, prefix: str = "NETAGENT") -> Ruleset:
    """The desired ruleset and ipsets of one family (4 or 6). Raises IptablesError on bad input.

    The rules do not depend on the pods: adding, removing or reclassifying a pod changes set
    members only (see the module docstring for the layout).
    """
    if family not in (4, 6):
        raise IptablesError(f"family {family!r} must be 4 or 6")
    validate_prefix(prefix)
    validate(state)
    n = names(prefix)
    sets = build_sets(state, family, prefix)
    s = {suffix: f"{prefix.lower()}-{suffix}{family}" for suffix in SET_SUFFIXES}
    mark = xmark(state.mark_bit)
    chains: dict[str, tuple[str, ...]] = {}
    internal = set_members(state.internal_cidrs)[family]

    def scope(where: str, rest: str) -> tuple[str, ...]:
        """Rules that apply `rest` to packets whose `where` ("src"/"dst") address is internal: one plain
        -s/-d rule per CIDR while there are few (a plain match costs ~10 ns, a set lookup ~300 ns),
        else one lookup in the internal set."""
        if len(internal) <= RULE_CIDRS_MAX:
            return tuple(f"{'-s' if where == 'src' else '-d'} {net} {rest}" for net in internal)
        return (f"-m set --match-set {s['internal']} {where} {rest}",)

    def to_default_class(counted_as: str, target: tuple[int, int]) -> tuple[str, ...]:
        """A packet of no known pod: our mark (so it is counted and shaped) and the default class."""
        return (f"{comment(counted_as)} -j MARK --set-xmark {mark}", f"-j CLASSIFY --set-class {classify_target(target)}")

    unknown: tuple[str, ...] = ()
    if state.default_class is not None:
        # after the pods' SET: a known pod's internet packet already carries our mark (and its own
        # class). Forwarded only: a source that is one of the node's addresses is host traffic.
        unknown = (f"-m mark ! --mark {mark} -m addrtype ! --src-type LOCAL -j {n['UNKNOWN']}",)
        chains[n["UNKNOWN"]] = to_default_class("unknown source egress internet", state.default_class)
    by_device = state.internal_by_device
    # internal egress through an uplink: counted here (the node's by the rule, the pod's by its set), or
    # on the uplink and the pod's device already
    internal_out = "-j RETURN" if by_device else f"{comment('node egress internal')} -g {n['EGRESS-INT']}"
    to_uplinks = tuple(f"-o {dev} -g {n['NODE-OUT']}" for dev in state.uplinks)
    internet_out = (
        f"-j SET --map-set {s['egress-inet']} src --map-mark --map-prio",
        f"{CONTROL_MATCH} -j SET --map-set {s['egress-ack']} src --map-prio",
        *unknown,
        f"{comment('node egress internet')} -j RETURN",
    )
    if by_device:
        # an internal source's internet packet comes straight here from SRC-INT, its scope already known
        chains[n["INET-OUT"]] = internet_out
        chains[n["NODE-OUT"]] = (*scope("dst", internal_out), f"-g {n['INET-OUT']}")
    else:
        chains[n["NODE-OUT"]] = (*scope("dst", internal_out), *internet_out)
    if by_device:
        # both ends internal: counted on the pods' devices, nothing left to do; an internal source to
        # anywhere else is a pod's internet egress (counted here) or no pod's packet
        chains[n["SRC-INT"]] = (
            *scope("dst", "-j RETURN"),
            *(f"-o {dev} -g {n['INET-OUT']}" for dev in state.uplinks),
            f"-m set --match-set {s['egress-inet']} src -j RETURN",
        )
        # FROM-POD sees only sources that are not internal (a pod outside the internal CIDRs)
        chains[n["FROM-POD"]] = (
            *scope("dst", f"-g {n['TO-POD']}"),
            f"-m set --match-set {s['egress-inet']} src",
            f"-g {n['TO-POD']}",
        )
        chains[n["TO-POD"]] = (f"-m set --match-set {s['ingress-inet']} dst -j RETURN",)
    else:
        chains[n["EGRESS-INT"]] = (f"-m set --match-set {s['egress-int']} src -j RETURN",)
        chains[n["FROM-PEER"]] = (f"-m set --match-set {s['ingress-int']} dst -j RETURN",)
        chains[n["FROM-POD"]] = (
            *scope("dst", f"-g {n['POD-INT']}"),
            f"-m set --match-set {s['egress-inet']} src",
            f"-g {n['TO-POD']}",
        )
        chains[n["POD-INT"]] = (
            f"-m set --match-set {s['egress-int']} src",
            f"-g {n['TO-POD']}",
        )
        chains[n["TO-POD"]] = (
            *scope("src", f"-g {n['FROM-PEER']}"),
            f"-m set --match-set {s['ingress-inet']} dst -j RETURN",
        )
    if not by_device:
        chains[n["NODE-IN"]] = (
            *scope("src", f"{comment('node ingress internal')} -j RETURN"),
            f"{comment('node ingress internet')} -j RETURN",
        )
        chains[n["PREROUTING"]] = tuple(f"-i {dev} -j {n['NODE-IN']}" for dev in state.uplinks)
    if state.ingress_default_class is None:
        to_pod_internet: tuple[str, ...] = (f"-m set --match-set {s['ingress-inet']} dst -j RETURN",)
    else:
        # downloads: left here is a packet from a source that is not internal, no pod of this node
        # and (after FROM-HOST) no node address: internet -> pod (de-NATed). The node's own traffic
        # is counted, never shaped; a known pod's packet gets our mark and its download class from
        # its member; one to an address no known pod holds goes to the download default class.
        to_pod_internet = (
            f"-m addrtype --src-type LOCAL -g {n['FROM-HOST']}",
            f"-j SET --map-set {s['ingress-inet']} dst --map-mark --map-prio",
            f"{CONTROL_MATCH} -j SET --map-set {s['ingress-ack']} dst --map-prio",
            f"-m mark ! --mark {mark} -j {n['UNKNOWN-IN']}",
        )
        chains[n["FROM-HOST"]] = (f"-m set --match-set {s['ingress-inet']} dst -j RETURN",)
        chains[n["UNKNOWN-IN"]] = to_default_class("unknown destination ingress internet", state.ingress_default_class)
    if by_device:  # an internal source first: both ends internal is the most common packet, and it is done
        head = (*scope("src", f"-g {n['SRC-INT']}"), *to_uplinks)
    else:
        head = (*to_uplinks, f"-m set --match-set {s['peer']} src -g {n['FROM-PEER']}")
    chains[n["POSTROUTING"]] = (
        *head,
        f"-m set --match-set {s['egress-int']} src ! --update-counters -g {n['FROM-POD']}",
        *to_pod_internet,
    )
    jumps = tuple((hook, f"-j {n[hook]}") for hook in HOOKS if n[hook] in chains)
    return Ruleset(family, chains, jumps, sets)


def render(state: ClassifierState, family: int, prefix: str = "NETAGENT") -> str:
    """Full iptables-restore text (mangle, only our chains) that programs `state` from nothing."""
    rs = build(state, family, prefix)
    lines = [f"*{TABLE}"]
    lines += [f":{c} - [0:0]" for c in rs.chains]
    for c, rules in rs.chains.items():
        lines += [f"-A {c} {r}" for r in rules]
    lines += [f"-I {hook} 1 {rule}" for hook, rule in rs.jumps]
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Update:
    text: str  # iptables-restore --noflush input; "" when the kernel already matches
    changes: int  # chains written or deleted plus hook rules inserted or deleted
    rewritten: tuple[str, ...]  # existing chains that get flushed and refilled (their counters restart)


def render_update(desired: Ruleset, current_chains: dict[str, tuple[str, ...]],
                  current_jumps: list[tuple[str, str]]) -> Update:
    """The minimal transaction from the kernel's state of our chains to `desired`.

    `current_chains` holds only our chains (already filtered by `is_ours`), rules normalised;
    `current_jumps` the rules in builtin chains that jump to one of ours. Chains whose rules
    already match are left out entirely, so their counters keep counting.
    """
    write = [c for c, rules in desired.chains.items()
             if tuple(normalise(r) for r in rules) != current_chains.get(c)]
    stale = sorted(c for c in current_chains if c not in desired.chains)
    wanted_jumps = [(h, normalise(r)) for h, r in desired.jumps]
    remove_jumps = []
    kept: set[tuple[str, str]] = set()
    for hook, rule in current_jumps:
        if (hook, rule) in wanted_jumps and (hook, rule) not in kept:
            kept.add((hook, rule))
        else:
            remove_jumps.append((hook, rule))  # a duplicate, or a hook into a chain we no longer want
    add_jumps = [(h, r) for h, r in desired.jumps if (h, normalise(r)) not in kept]
    changes = len(write) + len(stale) + len(remove_jumps) + len(add_jumps)
    if not changes:
        return Update("", 0, ())
    lines = [f"*{TABLE}"]
    lines += [f":{c} - [0:0]" for c in (*write, *stale)]  # declares new chains, flushes existing ones
    for c in write:
        lines += [f"-A {c} {r}" for r in desired.chains[c]]
    lines += [f"-D {h} {r}" for h, r in remove_jumps]
    lines += [f"-I {h} 1 {r}" for h, r in add_jumps]
    lines += [f"-X {c}" for c in stale]
    lines.append("COMMIT")
    rewritten = tuple(c for c in write if c in current_chains)
    return Update("\n".join(lines) + "\n", changes, rewritten)
