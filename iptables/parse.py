"""Pure parsing of what the kernel tools print: iptables-save (with or without -c) and ipset save.

Rules are compared as normalised token strings, so quoting differences between what we
render and what iptables-save prints never count as a change.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

_COUNTED = re.compile(r"^\[(\d+):(\d+)\]\s+(.*)$")
_SAFE_TOKEN = re.compile(r"^[^\s\"'\\]+$")


@dataclass(frozen=True)
class SavedRule:
    chain: str
    rule: str  # normalised, without "-A <chain> "
    packets: int = 0
    bytes: int = 0


@dataclass
class SavedTable:
    name: str
    chains: dict[str, str] = field(default_factory=dict)  # chain -> policy ("-" for user chains)
    rules: list[SavedRule] = field(default_factory=list)

    def chain_rules(self, chain: str) -> list[SavedRule]:
        return [r for r in self.rules if r.chain == chain]


def normalise(rule: str) -> str:
    """One canonical spelling of a rule: tokens re-joined, double quotes only where needed."""
    try:
        tokens = shlex.split(rule)
    except ValueError:
        return rule.strip()
    return " ".join(t if _SAFE_TOKEN.match(t) else '"' + t + '"' for t in tokens)


def parse_save(text: str) -> dict[str, SavedTable]:
    """iptables-save / ip6tables-save output -> tables by name."""
    tables: dict[str, SavedTable] = {}
    table: SavedTable | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            table = tables.setdefault(line[1:], SavedTable(line[1:]))
            continue
        if line == "COMMIT" or table is None:
            continue
        if line.startswith(":"):
            parts = line[1:].split()
            table.chains[parts[0]] = parts[1] if len(parts) > 1 else "-"
            continue
        packets = nbytes = 0
        m = _COUNTED.match(line)
        if m:
            packets, nbytes, line = int(m.group(1)), int(m.group(2)), m.group(3)
        if not line.startswith("-A "):
            continue
        _, chain, *rest = line.split(" ", 2)
        table.rules.append(SavedRule(chain, normalise(rest[0] if rest else ""), packets, nbytes))
    return tables


def jump_target(rule: str) -> str | None:
    """The chain a rule jumps or goes to, if any."""
    tokens = shlex.split(rule)
    for i, tok in enumerate(tokens[:-1]):
        if tok in ("-j", "--jump", "-g", "--goto"):
            return tokens[i + 1]
    return None


def comment_of(rule: str) -> str | None:
    tokens = shlex.split(rule)
    for i, tok in enumerate(tokens[:-1]):
        if tok == "--comment":
            return tokens[i + 1]
    return None


_FULL = 0xFFFFFFFF


def _value_mask(text: str) -> tuple[int, int]:
    value, _, mask = text.partition("/")
    return int(value, 0), int(mask, 0) if mask else _FULL


def mark_masks(rule: str) -> list[tuple[str, int]]:
    """Every firewall-mark or connmark bit mask a rule reads or writes, as (option, mask).

    Covers the MARK and CONNMARK targets and the mark and connmark matches, in every
    spelling iptables-save prints (--set-xmark v/m, --set-mark, --or/--and/--xor-mark,
    --mark v[/m], --save-mark/--restore-mark with --nfmask/--ctmask/--mask).
    """
    try:
        tokens = shlex.split(rule)
    except ValueError:
        return []
    out: list[tuple[str, int]] = []
    target = jump_target(rule) or ""
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        arg = tokens[i + 1] if i + 1 < len(tokens) else ""
        try:
            if tok in ("--set-xmark", "--set-mark", "--mark"):
                out.append((f"{tok} {arg}", _value_mask(arg)[1]))
            elif tok in ("--or-mark", "--xor-mark"):
                out.append((f"{tok} {arg}", int(arg, 0)))
            elif tok == "--and-mark":
                out.append((f"{tok} {arg}", ~int(arg, 0) & _FULL))
            elif tok in ("--nfmask", "--ctmask", "--mask"):
                out.append((f"{tok} {arg}", int(arg, 0)))
            elif tok in ("--save-mark", "--restore-mark") and target == "CONNMARK":
                if not any(t in ("--nfmask", "--ctmask", "--mask") for t in tokens):
                    out.append((tok, _FULL))
        except ValueError:
            pass
        i += 1
    return out


def parse_ipset_save(text: str) -> dict[str, tuple[str, set[str]]]:
    """`ipset save` output -> set name -> (create line options, members)."""
    sets: dict[str, tuple[str, set[str]]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "create":
            sets[parts[1]] = (" ".join(parts[2:]), set())
        elif len(parts) >= 3 and parts[0] == "add" and parts[1] in sets:
            sets[parts[1]][1].add(parts[2])
    return sets
