"""The executor: makes the kernel's mangle table and ipsets match a `ClassifierState`.

One `iptables-restore --noflush -w` transaction per family, holding only the chains that
differ from what the kernel has (flushed and refilled inside the transaction, as kube-proxy
does), hook rules inserted only when missing, stale chains of ours deleted. When the kernel
already matches, nothing is executed but the read-back: a restarted agent adopts, it never
flushes. The internal-CIDR ipsets are replaced atomically (build a temporary set, swap).
"""
from __future__ import annotations

import ipaddress
import logging
import shutil

from iptables import render as R
from iptables.backend import BACKENDS, Runner, detect
from iptables.errors import IptablesError
from iptables.model import ClassifierState
from iptables.nfnl import NetfilterReader, NetlinkUnavailable, XtablesReader
from iptables.parse import SavedTable, comment_of, counted_comments, jump_target, mark_masks, parse_ipset_entries, parse_save

log = logging.getLogger(__name__)

FAMILIES = (4, 6)
BUILTIN = ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING")
_SET_FAMILY = {4: "inet", 6: "inet6"}
_EXTENSIONS = ("counters", "comment", "skbinfo")
# what `_read_sets` returns per existing set: the set as it is, and each member's byte counter
SetView = tuple[R.IpSet, dict[str, int]]


def _empty_counts(kinds: tuple[str, ...] = R.KINDS) -> dict[str, int]:
    return {k: 0 for k in kinds}


def _canonical_member(kind: str, member: str) -> str:
    if kind == "hash:net":
        return str(ipaddress.ip_network(member, strict=False))
    return str(ipaddress.ip_address(member))


def _member_line(verb: str, name: str, member: str, ext: tuple[tuple[str, str], ...], fresh: bool = False) -> str:
    """One `ipset restore` line. `fresh`: the member is new to a counted set, so its counters are set to 0
    explicitly: the kernel's hash sets reuse a deleted member's slot without clearing its counters when an
    add names none (ip_set_hash_gen.h mtype_add), so an address deleted and added back in one restore
    (it passed to another pod) would otherwise keep the old pod's bytes."""
    words = [verb, name, member]
    if verb == "add":
        for option, value in ext:
            words += ["nomatch"] if option == "nomatch" else [option, f'"{value}"' if option == "comment" else value]
        if fresh:
            words += ["packets", "0", "bytes", "0"]
    return " ".join(words)


def _our_state(table: SavedTable | None, prefix: str) -> tuple[dict[str, tuple[str, ...]], list[tuple[str, str]]]:
    """(our chains -> normalised rules, [(builtin chain, rule) that jump into ours]).

    Only rules in the builtin chains count as our hooks: a rule in another component's
    chain that jumps to ours is theirs, and is never edited.
    """
    if table is None:
        return {}, []
    chains: dict[str, list[str]] = {c: [] for c in table.chains if R.is_ours(c, prefix)}
    jumps: list[tuple[str, str]] = []
    for r in table.rules:
        if r.chain in chains:
            chains[r.chain].append(r.rule)
        elif r.chain in BUILTIN and (target := jump_target(r.rule)) and R.is_ours(target, prefix):
            jumps.append((r.chain, r.rule))
    return {c: tuple(rules) for c, rules in chains.items()}, jumps


def _foreign_references(table: SavedTable | None, prefix: str) -> list[str]:
    """Rules in other components' chains that jump to one of ours."""
    if table is None:
        return []
    return [f"-A {r.chain} {r.rule}" for r in table.rules
            if r.chain not in BUILTIN and not R.is_ours(r.chain, prefix)
            and (target := jump_target(r.rule)) and R.is_ours(target, prefix)]


class Classifier:
    """Programs and reads netagent's classification and accounting rules on one node."""

    def __init__(self, backend: str = "auto", netns: str | None = None, prefix: str = "NETAGENT"):
        R.validate_prefix(prefix)
        if backend not in ("auto", *BACKENDS):
            raise IptablesError(f"iptables backend {backend!r} is not one of auto, nft, legacy")
        self.prefix = prefix
        self.netns = netns
        self.runner = Runner(netns)
        if netns:
            self.runner.require("ip", "iproute2")
        self.runner.require("ipset", "ipset")
        self.backend = detect(self.runner, prefix) if backend == "auto" else backend
        for family in FAMILIES:
            for action in ("save", "restore"):
                self.runner.require(self.runner.tool(family, self.backend, action), "iptables")
        self._ip_keys: dict[str, str] = {}  # pod address -> pod key, from the last apply (set comments may be cut)
        # bytes counted by set members we deleted (a pod's address changed): added back so counters never go down
        self._carried: dict[str, dict[str, int]] = {}
        self._node_carried = _empty_counts(R.NODE_KINDS)
        self._built: tuple[ClassifierState | None, dict[int, R.Ruleset]] = (None, {})
        self._other_backend_clear = False  # our chains in the other backend are removed by the first apply
        self._nl: NetfilterReader | None = None  # the in-process counter reader (counters())
        self._xt: XtablesReader | None = None  # ... of the legacy backend's rules
        self._nl_error: str | None = None  # why it cannot be used here: the tools read the counters

    def _keep(self, chain: str) -> bool:
        return chain in BUILTIN or R.is_ours(chain, self.prefix)

    # -- apply ------------------------------------------------------------------------
    def _rulesets(self, state: ClassifierState) -> dict[int, R.Ruleset]:
        """`state` rendered per family (validating all input first), kept while the state stays."""
        if state != self._built[0]:
            self._built = (state, {f: R.build(state, f, self.prefix) for f in FAMILIES})
        return self._built[1]

    def apply(self, state: ClassifierState) -> dict[str, int]:
        rulesets = self._rulesets(state)
        wanted = {name: s for rs in rulesets.values() for name, s in rs.sets.items()}
        previous_sets = self._read_sets()
        done: list[tuple[int, dict, list]] = []
        changes = 0
        set_changes = 0
        try:
            set_changes = self._apply_sets(wanted, previous_sets, carry=True)
            self._ip_keys = {str(ipaddress.ip_address(ip)): p.key for p in state.pods for ip in p.ips}
            for family in FAMILIES:
                tables = parse_save(self.runner.save(family, self.backend, R.TABLE, counters=True), self._keep)
                current, jumps = _our_state(tables.get(R.TABLE), self.prefix)
                update = R.render_update(rulesets[family], current, jumps)
                if not update.text:
                    continue
                # node counters never go down: a removed catch-all's bytes are kept too
                names = R.names(self.prefix)
                dropped = tuple(c for c in (names["UNKNOWN"], names["UNKNOWN-IN"], names["NODE-IN"], names["INET-OUT"])
                                if c in current and c not in rulesets[family].chains)
                self._carry_counts(tables.get(R.TABLE), update.rewritten + dropped)
                self.runner.restore(family, self.backend, update.text)
                done.append((family, current, jumps))
                changes += update.changes
        except IptablesError as exc:
            self._roll_back(done, previous_sets, wanted)
            raise IptablesError(f"applying the classifier rules failed; the previous rules stay in force: {exc}") from exc
        if not self._other_backend_clear:
            # a node that switched backends: our old rules there would still mark packets
            changes += len(self._remove_chains(next(b for b in BACKENDS if b != self.backend)))
            self._other_backend_clear = True
        keys = {p.key for p in state.pods}
        self._carried = {k: v for k, v in self._carried.items() if k in keys}
        return {"iptables": changes, "ipset": set_changes}

    def expected_lines(self, state: ClassifierState) -> tuple[int, ...]:
        """Per family (FAMILIES), the lines naming our prefix that `iptables-save -t mangle` shows once
        `state` is applied: our chains' declarations and rules, and the hooks into them. Computed from
        the desired rules, never read back: a flush that lands between an apply and a read-back would
        otherwise become the expected state, and the drift watch would never see it."""
        rulesets = self._rulesets(state)
        return tuple(len(rs.chains) + sum(len(rules) for rules in rs.chains.values()) + len(rs.jumps)
                     for rs in (rulesets[f] for f in FAMILIES))

    def _read_sets(self, names: list[str] | None = None, source: str = "auto") -> dict[str, SetView]:
        """Our existing ipsets (all of `R.set_names`, or `names`), as they are, with member byte counts.

        In-process, one ipset netlink dump per set (`source` "auto" or "netlink", as `counters`);
        with the tools ("exec", or netlink unavailable) two execs whatever the number of sets:
        `ipset list -n`, then one batch of `save <set>`.
        """
        wanted = [n for n in (names or R.set_names(self.prefix)) if not n.endswith(R.SWAP_SUFFIX)]
        reader = self._netlink() if source != "exec" else None
        if source == "netlink" and reader is None:
            raise NetlinkUnavailable(self._nl_error or "netfilter netlink is not available")
        if reader is not None:
            try:
                found = {name: reader.read_set(name) for name in wanted}
            except NetlinkUnavailable as exc:
                if source == "netlink":
                    raise
                self._netlink_failed(exc)
            else:
                return {name: self._set_view(name, *view) for name, view in found.items() if view is not None}
        listed = set(self.runner.run(["ipset", "list", "-n"]).stdout.split())
        ours = [n for n in wanted if n in listed]
        if not ours:
            return {}
        text = self.runner.run(["ipset", "restore"], stdin="".join(f"save {n}\n" for n in ours)).stdout
        out: dict[str, SetView] = {}
        for name, (opts, members) in parse_ipset_entries(text).items():
            words = opts.split()
            known = len(words) >= 3 and words[0] in ("hash:net", "hash:ip") and words[1] == "family" \
                and words[2] in ("inet", "inet6")
            if not known:
                raise IptablesError(f"ipset {name} exists but is not a hash:net or hash:ip set ({opts}): "
                                    "another program owns that name; remove it or choose another prefix")
            kind = words[0]
            out[name] = self._set_view(name, kind, 4 if words[2] == "inet" else 6,
                                       tuple(w for w in words if w in _EXTENSIONS),
                                       {_canonical_member(kind, m): entry for m, entry in members.items()})
        return out

    @staticmethod
    def _set_view(name: str, kind: str, family: int, extensions: tuple[str, ...],
                  members: dict[str, tuple[tuple[tuple[str, str], ...], int]]) -> SetView:
        if kind not in ("hash:net", "hash:ip") or family not in (4, 6):
            raise IptablesError(f"ipset {name} exists but is not a hash:net or hash:ip set ({kind}, family {family}): "
                                "another program owns that name; remove it or choose another prefix")
        return (R.IpSet(name, kind, family, extensions, {m: ext for m, (ext, _) in members.items()}),
                {m: nbytes for m, (_, nbytes) in members.items()})

    def _apply_sets(self, wanted: dict[str, R.IpSet], current: dict[str, SetView], carry: bool = False) -> int:
        """Make our ipsets hold `wanted` in one `ipset -exist restore`; -> how many sets changed.

        Uncounted sets (internal CIDRs, peers) are filled as `<name>-tmp` and swapped in, so rules
        never see a half-filled set. Counted sets (per pod) are changed member by member: a member
        that stays keeps its counters, also when its class (skbprio) changes; the bytes of a member
        that goes are carried (when `carry`) into the pod's offset, so counters() never goes down.
        """
        lines: list[str] = []
        changed = 0
        for name, want in wanted.items():
            have = current.get(name)
            if have is not None and have[0].members == want.members:
                if (have[0].type, have[0].family, set(have[0].extensions)) != (want.type, want.family, set(want.extensions)):
                    raise IptablesError(f"ipset {name} exists as '{have[0].create}', not '{want.create}': another "
                                        "program owns that name, or an older netagent made it; remove it or choose another prefix")
                continue
            changed += 1
            if have is None:
                lines.append(f"create {name} {want.create}")
                lines += [_member_line("add", name, m, ext) for m, ext in sorted(want.members.items())]
                continue
            if (have[0].type, have[0].family) == (want.type, want.family) and want.counted and \
                    set(have[0].extensions) < set(want.extensions):
                # made by an older netagent with fewer extensions (ingress-inet gained skbinfo):
                # refilled as <name>-tmp and swapped in; the members' bytes are carried to their pods
                kind = R.set_kind(name, self.prefix)
                if carry and kind:
                    for m, ext in have[0].members.items():
                        key = self._ip_keys.get(m) or dict(ext).get("comment", m)
                        self._carried.setdefault(key, _empty_counts())[kind] += have[1].get(m, 0)
                tmp = name + R.SWAP_SUFFIX
                lines += [f"create {tmp} {want.create}", f"flush {tmp}"]
                lines += [_member_line("add", tmp, m, ext) for m, ext in sorted(want.members.items())]
                lines += [f"swap {tmp} {name}", f"destroy {tmp}"]
                continue
            if (have[0].type, have[0].family, set(have[0].extensions)) != (want.type, want.family, set(want.extensions)):
                raise IptablesError(f"ipset {name} exists as '{have[0].create}', not '{want.create}': another "
                                    "program owns that name, or an older netagent made it; remove it or choose another prefix")
            if want.counted:
                # a member that goes, or whose address now belongs to another pod (its comment, the pod
                # key, changes), is deleted: its counters stay with the pod that counted them
                gone = sorted(m for m, ext in have[0].members.items()
                              if m not in want.members or dict(ext).get("comment") != dict(want.members[m]).get("comment"))
                lines += [_member_line("del", name, m, ()) for m in gone]
                # a member that stays and only changes its class (skbprio) is overwritten in place with
                # -exist and keeps its counters; one added anew starts from 0
                lines += [_member_line("add", name, m, ext, fresh=m in gone or m not in have[0].members)
                          for m, ext in sorted(want.members.items()) if have[0].members.get(m) != ext or m in gone]
                kind = R.set_kind(name, self.prefix)
                if carry and kind:
                    for m in gone:
                        key = self._ip_keys.get(m) or dict(have[0].members[m]).get("comment", m)
                        self._carried.setdefault(key, _empty_counts())[kind] += have[1].get(m, 0)
                continue
            # a leftover temporary set from an interrupted run is reused: -exist on create, then flushed
            tmp = name + R.SWAP_SUFFIX
            lines += [f"create {tmp} {want.create}", f"flush {tmp}"]
            lines += [_member_line("add", tmp, m, ext) for m, ext in sorted(want.members.items())]
            lines += [f"swap {tmp} {name}", f"destroy {tmp}"]
        if lines:
            self.runner.run(["ipset", "-exist", "restore"], stdin="\n".join(lines) + "\n")
        return changed

    def _carry_counts(self, table: SavedTable | None, rewritten: tuple[str, ...]) -> None:
        if table is None:
            return
        for chain in rewritten:
            for rule in table.chain_rules(chain):
                found = self._classify_counter(chain, comment_of(rule.rule))
                if found is None:
                    continue
                key, kind = found
                if key is None:
                    self._node_carried[kind] += rule.bytes
                else:
                    self._carried.setdefault(key, _empty_counts())[kind] += rule.bytes

    def _roll_back(self, done: list[tuple[int, dict, list]], previous_sets: dict[str, SetView],
                   wanted: dict[str, R.IpSet]) -> None:
        """Best effort: put back the rules of families already changed, then the old ipset contents."""
        for family, chains, jumps in done:
            try:
                tables = parse_save(self.runner.save(family, self.backend, R.TABLE))
                now, now_jumps = _our_state(tables.get(R.TABLE), self.prefix)
                old = R.Ruleset(family, dict(chains), tuple(jumps), {})
                update = R.render_update(old, now, now_jumps)
                if update.text:
                    self.runner.restore(family, self.backend, update.text)
            except IptablesError:
                pass  # the error that started the roll-back is the one reported
        try:
            now = self._read_sets()
            created = [n for n in now if n in wanted and n not in previous_sets]
            if created:
                self.runner.run(["ipset", "-exist", "restore"], stdin="".join(f"destroy {n}\n" for n in created))
            self._apply_sets({n: view[0] for n, view in previous_sets.items()}, now)
        except IptablesError:
            pass

    # -- counters -----------------------------------------------------------------------
    def _classify_counter(self, chain: str, text: str | None) -> tuple[str | None, str] | None:
        """(pod key or None for the node, kind) from a counting rule's chain and comment, else None."""
        if not text:
            return None
        if chain == f"{self.prefix}-UNKNOWN":
            return None, R.UNKNOWN_KIND
        if chain == f"{self.prefix}-UNKNOWN-IN":
            return None, R.UNKNOWN_INGRESS_KIND
        head, _, scope = text.rpartition(" ")
        who, _, direction = head.rpartition(" ")
        kind = f"{direction}_{scope}"
        if kind not in R.KINDS:
            return None
        if chain in (f"{self.prefix}-NODE-OUT", f"{self.prefix}-NODE-IN", f"{self.prefix}-INET-OUT"):
            return None, kind
        return None  # per-pod bytes are counted by the pod sets, not by rules

    def counters(self, source: str = "auto") -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        """Bytes per pod and for the node by direction and scope, IPv4 and IPv6 summed.

        Per pod: the counters of its members in the four pod sets of each family. Node: the
        commented rules of our node chains, per family. Node totals count everything through the
        uplinks, host traffic included; the node's `egress_unknown_internet` is the part of its
        internet egress that it forwarded from no known pod (shaped in the default class; 0 without
        one).

        `source`: "netlink" reads in-process (`iptables/nfnl.py`: the sets and, on the nft backend,
        the rules over netfilter netlink; on legacy the rules through the xtables socket options
        that iptables-legacy-save uses), "exec" with the tools only (`ipset save` in one batch,
        `iptables-save -c -t mangle` per family), "auto" over netlink unless it proved unavailable
        here, then with the tools for good. Both read the same.
        """
        if source not in ("auto", "netlink", "exec"):
            raise ValueError(f"counters source {source!r} is not one of auto, netlink, exec")
        reader = self._netlink() if source != "exec" else None
        if source == "netlink" and reader is None:
            raise NetlinkUnavailable(self._nl_error or "netfilter netlink is not available")
        if reader is not None:
            try:
                return self._count(*self._read_counters_netlink(reader))
            except NetlinkUnavailable as exc:
                if source == "netlink":
                    raise
                self._netlink_failed(exc)
        return self._count(*self._read_counters_exec())

    def _pod_set_names(self) -> list[str]:
        return [f"{self.prefix.lower()}-{suffix}{family}" for family in FAMILIES for suffix in R.POD_SET_KINDS]

    def _read_counters_exec(self) -> tuple[dict[str, dict[str, tuple[int, str | None]]], list[tuple[str, str, int]]]:
        """(set -> canonical member -> (bytes, comment), [(chain, comment, bytes)] of both families) by the tools.
        The node's rules are read before the pods' sets (see `_read_counters_netlink`)."""
        rules = [found for family in FAMILIES for found in self._rule_counters_exec(family)]
        names = self._pod_set_names()
        proc = self.runner.run(["ipset", "restore"], stdin="".join(f"save {n}\n" for n in names), check=False)
        if proc.returncode == 0:
            text = proc.stdout
        else:  # a set is missing (nothing applied yet, or removed behind our back): read those that exist
            listed = set(self.runner.run(["ipset", "list", "-n"]).stdout.split())
            present = [n for n in names if n in listed]
            text = self.runner.run(["ipset", "restore"], stdin="".join(f"save {n}\n" for n in present)).stdout if present else ""
        sets = {name: {_canonical_member("hash:ip", m): (nbytes, dict(ext).get("comment")) for m, (ext, nbytes) in members.items()}
                for name, (_, members) in parse_ipset_entries(text).items()}
        return sets, rules

    def _rule_counters_exec(self, family: int) -> list[tuple[str, str, int]]:
        return counted_comments(self.runner.save(family, self.backend, R.TABLE, counters=True), self.prefix)

    def _read_counters_netlink(self, reader: NetfilterReader) -> tuple[dict[str, dict[str, tuple[int, str | None]]],
                                                                         list[tuple[str, str, int]]]:
        """As `_read_counters_exec`, in-process: no process started. The node's rules first, then the pods'
        sets: every counter only grows, so the node's count less the pods' read after it is never more than
        the traffic that bypassed the pods (a flood between the reads made it up to ~100 KB more the other
        way round, which netagent.datapath's bypass then kept)."""
        rules_reader = reader if self.backend == "nft" else self._xt
        rules = [found for family in FAMILIES for found in rules_reader.rule_counters(family, R.TABLE, self.prefix)]
        sets = {}
        for name in self._pod_set_names():
            members = reader.set_members(name)
            if members is not None:
                sets[name] = members
        return sets, rules

    def _count(self, sets: dict[str, dict[str, tuple[int, str | None]]],
               rules: list[tuple[str, str, int]]) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        pods: dict[str, dict[str, int]] = {k: dict(v) for k, v in self._carried.items()}
        node = dict(self._node_carried)
        for name, members in sets.items():
            kind = R.set_kind(name, self.prefix)
            if kind is None:
                continue
            for member, (nbytes, comment) in members.items():
                key = self._ip_keys.get(member) or (member if comment is None else comment)
                counts = pods.get(key)
                if counts is None:
                    counts = pods[key] = _empty_counts()
                counts[kind] += nbytes
        for chain, text, nbytes in rules:
            found = self._classify_counter(chain, text)
            if found is None:
                continue
            key, kind = found
            if key is None:
                node[kind] += nbytes
        return dict(sorted(pods.items())), node

    def rules_version(self) -> object | None:
        """A token that changes whenever our backend's mangle table may have changed, read in-process
        (nft: the ruleset generation, any table's commit bumps it; legacy: a digest of both families'
        rules, counters left out); None when it cannot be read so (read the rules every time)."""
        reader = self._netlink()
        if reader is None:
            return None
        try:
            if self.backend == "nft":
                return reader.generation()
            return tuple(self._xt.digest(family, R.TABLE) for family in FAMILIES)
        except NetlinkUnavailable as exc:
            self._netlink_failed(exc)
            return None

    def _netlink(self) -> NetfilterReader | None:
        """The in-process counter reader, opened on first use; None once it proved unavailable."""
        if self._nl is None and self._nl_error is None:
            try:
                self._nl = NetfilterReader(self.netns)
                if self.backend == "legacy":
                    self._xt = XtablesReader(self.netns)
            except NetlinkUnavailable as exc:
                self._netlink_failed(exc)
        return self._nl

    def _netlink_failed(self, exc: Exception) -> None:
        if self._nl_error is None:
            log.warning("reading the byte counters with ipset and iptables-save from now on: %s", exc)
        self._nl_error = str(exc)
        self.close()

    def close(self) -> None:
        """Close the counter reader's socket (a later counters() opens it again)."""
        for reader in (self._nl, self._xt):
            if reader is not None:
                reader.close()
        self._nl = self._xt = None

    # -- coexistence ----------------------------------------------------------------------
    def check_conflicts(self, mark_bit: int) -> None:
        """Refuse a mark bit that another component's rules (any table, family, backend) already use."""
        bit = R.validate_mark_bit(mark_bit)
        owners: list[str] = []
        for backend in BACKENDS:
            if shutil.which(self.runner.tool(4, backend, "save")) is None:
                continue
            for family in FAMILIES:
                for table in parse_save(self.runner.save(family, backend, None)).values():
                    for r in table.rules:
                        if R.is_ours(r.chain, self.prefix):
                            continue
                        for option, mask in mark_masks(r.rule):
                            if mask & bit:
                                tool = self.runner.tool(family, backend, "cmd")
                                owners.append(f"{tool} -t {table.name} -A {r.chain} {r.rule} (uses {option})")
                                break
        if owners:
            shown = "; ".join(owners[:3]) + (f"; and {len(owners) - 3} more" if len(owners) > 3 else "")
            raise IptablesError(
                f"mark bit {bit:#x} is already used by another component's rules: {shown}. "
                "Choose a free bit for netagent (--mark-bit) or change that component's mark")

    # -- cleanup --------------------------------------------------------------------------
    def cleanup(self) -> list[str]:
        """Remove exactly what netagent created (chains, hook rules, ipsets), in both backends; idempotent."""
        removed: list[str] = []
        for backend in BACKENDS:
            removed += self._remove_chains(backend)
        existing = set(self.runner.run(["ipset", "list", "-n"]).stdout.split())
        gone = [name for name in R.set_names(self.prefix) if name in existing]
        if gone:
            self.runner.run(["ipset", "restore"], stdin="".join(f"destroy {n}\n" for n in gone))
            removed += [f"ipset {name}" for name in gone]
        self._ip_keys.clear()
        self._carried.clear()
        self._node_carried = _empty_counts(R.NODE_KINDS)
        return removed

    def _remove_chains(self, backend: str) -> list[str]:
        """Delete our hooks and chains from one backend, both families; -> what was removed."""
        removed: list[str] = []
        if shutil.which(self.runner.tool(4, backend, "save")) is None:
            return removed
        for family in FAMILIES:
            # the whole dump, never `-t mangle`: on legacy that would create the table
            table = parse_save(self.runner.save(family, backend, None)).get(R.TABLE)
            chains, jumps = _our_state(table, self.prefix)
            if not chains and not jumps:
                continue
            if foreign := _foreign_references(table, self.prefix):
                raise IptablesError(
                    f"cannot remove netagent's chains: other rules jump to them ({'; '.join(foreign[:3])} in "
                    f"{self.runner.tool(family, backend, 'cmd')} -t {R.TABLE}); remove those rules first")
            lines = [f"*{R.TABLE}"]
            lines += [f"-D {hook} {rule}" for hook, rule in jumps]
            lines += [f":{c} - [0:0]" for c in chains]
            lines += [f"-X {c}" for c in chains]
            lines.append("COMMIT")
            self.runner.restore(family, backend, "\n".join(lines) + "\n")
            tool = self.runner.tool(family, backend, "cmd")
            removed += [f"{tool} -t {R.TABLE} -D {hook} {rule}" for hook, rule in jumps]
            removed += [f"{tool} -t {R.TABLE} chain {c}" for c in sorted(chains)]
        return removed
