"""The executor: makes the kernel's mangle table and ipsets match a `ClassifierState`.

One `iptables-restore --noflush -w` transaction per family, holding only the chains that
differ from what the kernel has (flushed and refilled inside the transaction, as kube-proxy
does), hook rules inserted only when missing, stale chains of ours deleted. When the kernel
already matches, nothing is executed but the read-back: a restarted agent adopts, it never
flushes. The internal-CIDR ipsets are replaced atomically (build a temporary set, swap).
"""
from __future__ import annotations

import ipaddress
import shutil

from iptables import render as R
from iptables.backend import BACKENDS, Runner, detect
from iptables.errors import IptablesError
from iptables.model import ClassifierState
from iptables.parse import (SavedTable, comment_of, counted_comments, jump_target, mark_masks, parse_ipset_save,
                            parse_save)

FAMILIES = (4, 6)
BUILTIN = ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING")
_SET_FAMILY = {4: "inet", 6: "inet6"}


def _empty_counts(kinds: tuple[str, ...] = R.KINDS) -> dict[str, int]:
    return {k: 0 for k in kinds}


def _canonical_members(members: set[str]) -> set[str]:
    return {str(ipaddress.ip_network(m, strict=False)) for m in members}


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
        self._chain_keys: dict[str, str] = {}  # per-pod chain -> pod key, from the last apply
        # bytes counted by rules we flushed and refilled (a class change): added back so counters never go down
        self._carried: dict[str, dict[str, int]] = {}
        self._node_carried = _empty_counts(R.NODE_KINDS)
        self._built: tuple[ClassifierState | None, dict[int, R.Ruleset]] = (None, {})
        self._other_backend_clear = False  # our chains in the other backend are removed by the first apply

    def _keep(self, chain: str) -> bool:
        return chain in BUILTIN or R.is_ours(chain, self.prefix)

    # -- apply ------------------------------------------------------------------------
    def apply(self, state: ClassifierState) -> dict[str, int]:
        if state != self._built[0]:
            self._built = (state, {f: R.build(state, f, self.prefix) for f in FAMILIES})  # validates all input first
        rulesets = self._built[1]
        cidrs = R.set_members(state.internal_cidrs)
        previous_sets = self._read_sets()
        done: list[tuple[int, dict, list]] = []
        changes = 0
        try:
            set_changes = self._apply_sets(cidrs, previous_sets)
            for family in FAMILIES:
                tables = parse_save(self.runner.save(family, self.backend, R.TABLE, counters=True), self._keep)
                current, jumps = _our_state(tables.get(R.TABLE), self.prefix)
                update = R.render_update(rulesets[family], current, jumps)
                if not update.text:
                    continue
                # node counters never go down: a removed catch-all's bytes are kept too
                unknown = R.names(self.prefix)["UNKNOWN"]
                dropped = (unknown,) if unknown in current and unknown not in rulesets[family].chains else ()
                self._carry_counts(tables.get(R.TABLE), update.rewritten + dropped)
                self.runner.restore(family, self.backend, update.text)
                done.append((family, current, jumps))
                changes += update.changes
        except IptablesError as exc:
            self._roll_back(done, previous_sets)
            raise IptablesError(f"applying the classifier rules failed; the previous rules stay in force: {exc}") from exc
        if not self._other_backend_clear:
            # a node that switched backends: our old rules there would still mark packets
            changes += len(self._remove_chains(next(b for b in BACKENDS if b != self.backend)))
            self._other_backend_clear = True
        keys = {p.key for p in state.pods}
        self._chain_keys = {c: k for rs in rulesets.values() for c, k in rs.pod_chains.items()}
        self._carried = {k: v for k, v in self._carried.items() if k in keys}
        return {"iptables": changes, "ipset": set_changes}

    def _set_names(self, family: int) -> tuple[str, str]:
        name = R.ipset_name(self.prefix, family)
        return name, f"{name}-tmp"

    def _read_sets(self) -> dict[str, set[str] | None]:
        out: dict[str, set[str] | None] = {}
        for family in FAMILIES:
            name, _ = self._set_names(family)
            proc = self.runner.run(["ipset", "save", name], check=False)
            if proc.returncode != 0:
                if "does not exist" not in proc.stderr:
                    raise IptablesError(f"ipset save {name} failed: {proc.stderr.strip()}")
                out[name] = None
                continue
            sets = parse_ipset_save(proc.stdout)
            opts, members = sets.get(name, ("", set()))
            words = opts.split()
            if words[:3] != ["hash:net", "family", _SET_FAMILY[family]]:
                raise IptablesError(
                    f"ipset {name} exists but is not a hash:net set of family {_SET_FAMILY[family]} ({opts}): "
                    "another program owns that name; remove it or choose another prefix")
            out[name] = _canonical_members(members)
        return out

    def _apply_sets(self, cidrs: dict[int, tuple[str, ...]], current: dict[str, set[str] | None]) -> int:
        lines: list[str] = []
        changed = 0
        for family, members in cidrs.items():
            name, tmp = self._set_names(family)
            want = set(members)
            have = current.get(name)
            if have == want:
                continue
            changed += 1
            create = f"hash:net family {_SET_FAMILY[family]}"
            if have is None:
                lines.append(f"create {name} {create}")
                lines += [f"add {name} {c}" for c in sorted(want)]
                continue
            # a leftover temporary set from an interrupted run is reused: -exist on create, then flushed
            lines += [f"create {tmp} {create}", f"flush {tmp}"]
            lines += [f"add {tmp} {c}" for c in sorted(want)]
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

    def _roll_back(self, done: list[tuple[int, dict, list]], previous_sets: dict[str, set[str] | None]) -> None:
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
            restore: dict[int, tuple[str, ...]] = {}
            for family in FAMILIES:
                name = self._set_names(family)[0]
                before = previous_sets[name]
                if before is None and now[name] is not None:
                    self.runner.run(["ipset", "destroy", name], check=False)  # created by this apply
                elif before is not None and now[name] != before:
                    restore[family] = tuple(sorted(before))
            self._apply_sets(restore, now)
        except IptablesError:
            pass

    # -- counters -----------------------------------------------------------------------
    def _classify_counter(self, chain: str, text: str | None) -> tuple[str | None, str] | None:
        """(pod key or None for the node, kind) from a counting rule's chain and comment, else None."""
        if not text:
            return None
        if chain == f"{self.prefix}-UNKNOWN":
            return None, R.UNKNOWN_KIND
        head, _, scope = text.rpartition(" ")
        who, _, direction = head.rpartition(" ")
        kind = f"{direction}_{scope}"
        if kind not in R.KINDS:
            return None
        if chain in (f"{self.prefix}-NODE-OUT", f"{self.prefix}-NODE-IN"):
            return None, kind
        return self._chain_keys.get(chain, who), kind

    def counters(self) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        """Bytes per pod and for the node by direction and scope, IPv4 and IPv6 summed.

        One `iptables-save -c -t mangle` per family. Node totals count everything through
        the uplinks, host traffic included; the node's `egress_unknown_internet` is the part of
        its internet egress that it forwarded from no known pod (shaped in the default class;
        0 without one).
        """
        pods: dict[str, dict[str, int]] = {k: dict(v) for k, v in self._carried.items()}
        node = dict(self._node_carried)
        for family in FAMILIES:
            dump = self.runner.save(family, self.backend, R.TABLE, counters=True)
            for chain, text, nbytes in counted_comments(dump, self.prefix):
                found = self._classify_counter(chain, text)
                if found is None:
                    continue
                key, kind = found
                if key is None:
                    node[kind] += nbytes
                else:
                    pods.setdefault(key, _empty_counts())[kind] += nbytes
        return pods, node

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
        for family in FAMILIES:
            for name in self._set_names(family):
                if name in existing:
                    self.runner.run(["ipset", "destroy", name])
                    removed.append(f"ipset {name}")
        self._chain_keys.clear()
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
