"""Destination scopes (issue 39, foundations): the NetworkScopes description, its checks, the
userspace reference classification and the plain data the kernel's LPM trie needs.

Pure: no I/O. The caller keeps the last valid description in force (`keep_last_valid`); nothing
here is wired into the counters yet (docs/scopes.md says what is and is not built).

Rules (issue 39): an address in a CIDR of the node's own zone is `internal`; in another described
zone `cross-zone`; in a described region `cross-region`; in the cluster's own (pod/service) CIDRs
and in no described zone `internal`; anything else `internet`. Overlaps are refused, not ranked,
so each address has exactly one scope.
"""
from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Mapping, Sequence, Union

from core.direction import Direction

Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

# A bound on the described CIDRs (zones + regions together): the LPM map is sized from it and
# a description above it is refused whole rather than counted partly.
MAX_CIDRS = 4096
GIB = 2**30

# ISO 4217 active codes (no maintained library is installed; a short table, tested).
CURRENCIES = frozenset("""
AED AFN ALL AMD ANG AOA ARS AUD AWG AZN BAM BBD BDT BGN BHD BIF BMD BND BOB BRL BSD BTN BWP BYN BZD
CAD CDF CHF CLP CNY COP CRC CUP CVE CZK DJF DKK DOP DZD EGP ERN ETB EUR FJD FKP GBP GEL GHS GIP GMD
GNF GTQ GYD HKD HNL HTG HUF IDR ILS INR IQD IRR ISK JMD JOD JPY KES KGS KHR KMF KPW KRW KWD KYD KZT
LAK LBP LKR LRD LSL LYD MAD MDL MGA MKD MMK MNT MOP MRU MUR MVR MWK MXN MYR MZN NAD NGN NIO NOK NPR
NZD OMR PAB PEN PGK PHP PKR PLN PYG QAR RON RSD RUB RWF SAR SBD SCR SDG SEK SGD SHP SLE SOS SRD SSP
STN SVC SYP SZL THB TJS TMT TND TOP TRY TTD TWD TZS UAH UGX USD UYU UZS VES VND VUV WST XAF XCD XOF
XPF YER ZAR ZMW ZWL
""".split())


class Scope(enum.Enum):
    INTERNAL = "internal"
    CROSS_ZONE = "cross-zone"
    CROSS_REGION = "cross-region"
    INTERNET = "internet"


# Values stored in the kernel's LPM trie, relative to the node's zone (internet = no entry).
SCOPE_IDS: dict[Scope, int] = {Scope.INTERNAL: 0, Scope.CROSS_ZONE: 1, Scope.CROSS_REGION: 2, Scope.INTERNET: 3}
PRICED = (Scope.INTERNET, Scope.CROSS_ZONE, Scope.CROSS_REGION)


@dataclass(frozen=True)
class Area:
    name: str
    cidrs: tuple[Network, ...]


@dataclass(frozen=True)
class Prices:
    currency: str
    per_gib: Mapping[tuple[Scope, Direction], Decimal]


@dataclass(frozen=True)
class ScopesDescription:
    zones: tuple[Area, ...] = ()
    regions: tuple[Area, ...] = ()
    internal: tuple[Network, ...] = ()  # the cluster's pod and service CIDRs
    prices: Prices | None = None


@dataclass
class Parsed:
    description: ScopesDescription | None  # None when any problem was found
    problems: list[str] = field(default_factory=list)


def _areas(spec: Mapping[str, Any], key: str, problems: list[str]) -> list[tuple[str, str, Network]]:
    out: list[tuple[str, str, Network]] = []
    items = spec.get(key) or []
    if not isinstance(items, list):
        problems.append(f"spec.{key}: expected a list")
        return out
    names: set[str] = set()
    for i, item in enumerate(items):
        where = f"spec.{key}[{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str) or not item["name"]:
            problems.append(f"{where}.name: expected a non-empty string")
            continue
        name = str(item["name"])
        if name in names:
            problems.append(f"{where}.name: {name!r} named twice")
        names.add(name)
        cidrs = item.get("cidrs")
        if not isinstance(cidrs, list) or not cidrs:
            problems.append(f"{where}.cidrs: expected a non-empty list of CIDRs")
            continue
        for j, text in enumerate(cidrs):
            try:
                out.append((f"{where}.cidrs[{j}]", name, ipaddress.ip_network(str(text), strict=True)))
            except ValueError as exc:
                problems.append(f"{where}.cidrs[{j}]: {text!r} is not a CIDR ({exc})")
    return out


def _price(value: Any, where: str, problems: list[str]) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        problems.append(f"{where}: expected a decimal number as a string, e.g. \"0.09\"")
        return None
    try:
        d = Decimal(str(value))
    except InvalidOperation:
        problems.append(f"{where}: {value!r} is not a decimal number, e.g. \"0.09\"")
        return None
    if not d.is_finite() or d < 0:
        problems.append(f"{where}: {value!r} must be a finite number >= 0")
        return None
    return d


def _prices(raw: Any, problems: list[str]) -> Prices | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        problems.append("spec.prices: expected an object")
        return None
    currency = raw.get("currency")
    if currency not in CURRENCIES:
        problems.append(f"spec.prices.currency: {currency!r} is not an ISO 4217 code, e.g. USD")
    known = {s.value for s in PRICED} | {"currency"}
    for key in raw:
        if key not in known:
            problems.append(f"spec.prices.{key}: unknown scope (there are {', '.join(sorted(known))})")
    per: dict[tuple[Scope, Direction], Decimal] = {}
    for scope in PRICED:
        block = raw.get(scope.value)
        if block is None:
            continue
        if not isinstance(block, Mapping):
            problems.append(f"spec.prices.{scope.value}: expected {{egress, ingress}}")
            continue
        for d in (Direction.UPLOAD, Direction.DOWNLOAD):
            if d.metric_word in block:
                p = _price(block[d.metric_word], f"spec.prices.{scope.value}.{d.metric_word}", problems)
                if p is not None:
                    per[(scope, d)] = p
    return Prices(str(currency), per)


def parse(obj: Mapping[str, Any], *, pod_cidrs: Sequence[str] = (), service_cidrs: Sequence[str] = ()) -> Parsed:
    """A NetworkScopes object (as from the API server) into a description, or the problems, each
    naming its field. Any problem refuses the whole description (the caller keeps the last one)."""
    problems: list[str] = []
    spec = obj.get("spec") or {}
    if not isinstance(spec, Mapping):
        return Parsed(None, ["spec: expected an object"])
    zones = _areas(spec, "zones", problems)
    regions = _areas(spec, "regions", problems)
    described = zones + regions
    if len(described) > MAX_CIDRS:
        problems.append(f"spec: {len(described)} CIDRs described, at most {MAX_CIDRS}")
    internal = [ipaddress.ip_network(c, strict=False) for c in (*pod_cidrs, *service_cidrs)]
    # Overlaps: sort by (version, first address) so each CIDR is compared with its successors
    # only while they start inside it; O(n log n + overlaps).
    ordered = sorted(described, key=lambda t: (t[2].version, int(t[2].network_address), -t[2].prefixlen))
    for i, (where, _name, net) in enumerate(ordered):
        for where2, _n2, net2 in ordered[i + 1:]:
            if net2.version != net.version or int(net2.network_address) > int(net.broadcast_address):
                break
            problems.append(f"{where2}: {net2} overlaps {where} ({net})")
        for cluster in internal:
            if cluster.version == net.version and net.overlaps(cluster):
                problems.append(f"{where}: {net} overlaps the cluster's pod/service CIDR {cluster}")
    prices = _prices(spec.get("prices"), problems)
    if problems:
        return Parsed(None, problems)

    def group(items: list[tuple[str, str, Network]]) -> tuple[Area, ...]:
        by: dict[str, list[Network]] = {}
        for _w, name, net in items:
            by.setdefault(name, []).append(net)
        return tuple(Area(n, tuple(c)) for n, c in by.items())

    return Parsed(ScopesDescription(group(zones), group(regions), tuple(internal), prices), [])


def keep_last_valid(last: ScopesDescription | None, parsed: Parsed) -> ScopesDescription | None:
    """The description in force after an update: the new one if valid, else the last valid one."""
    return parsed.description if parsed.description is not None else last


def lpm_entries(desc: ScopesDescription, node_zone: str | None) -> dict[Network, int]:
    """Prefix -> scope id (SCOPE_IDS) for the node's zone; internet is the absence of an entry.
    A dict, so an update is the upsert/delete of the difference (`diff_entries`). A node without a
    zone sees every described zone as cross-zone (documented precedence)."""
    out: dict[Network, int] = {net: SCOPE_IDS[Scope.INTERNAL] for net in desc.internal}
    for zone in desc.zones:
        sid = SCOPE_IDS[Scope.INTERNAL if zone.name == node_zone else Scope.CROSS_ZONE]
        out.update({net: sid for net in zone.cidrs})
    for region in desc.regions:
        out.update({net: SCOPE_IDS[Scope.CROSS_REGION] for net in region.cidrs})
    return out


def diff_entries(old: Mapping[Network, int], new: Mapping[Network, int]) -> tuple[dict[Network, int], list[Network]]:
    """(upserts, deletes) turning the map's `old` entries into `new`."""
    upserts = {k: v for k, v in new.items() if old.get(k) != v}
    deletes = [k for k in old if k not in new]
    return upserts, deletes


_BY_ID = {v: k for k, v in SCOPE_IDS.items()}


def scope_of(desc: ScopesDescription, address: str, node_zone: str | None) -> Scope:
    """The userspace reference of the kernel's lookup: longest matching prefix, else internet."""
    ip = ipaddress.ip_address(address)
    best: tuple[int, int] | None = None
    for net, sid in lpm_entries(desc, node_zone).items():
        if net.version == ip.version and ip in net and (best is None or net.prefixlen > best[0]):
            best = (net.prefixlen, sid)
    return Scope.INTERNET if best is None else _BY_ID[best[1]]


def cost(prices: Prices, nbytes: int, scope: Scope, direction: Direction) -> Decimal:
    """Cost of `nbytes` in `prices.currency` (prices are per GiB; unpriced scope or direction: 0)."""
    return prices.per_gib.get((scope, direction), Decimal(0)) * Decimal(nbytes) / Decimal(GIB)
