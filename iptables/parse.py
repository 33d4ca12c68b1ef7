"""Pure parsing of what the kernel tools print: iptables-save (with or without -c) and ipset save.

Rules are compared as normalised token strings, so quoting differences between what we
render and what iptables-save prints never count as a change.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

_COUNTED = re.compile(r"^\[(\d+):(\d+)\]\s+(.*)$")
_SAFE_TOKEN = re.compile(r"^[^\s\"'\\]+$")
_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|(\S+)')
_ESCAPE = re.compile(r"\\(.)")


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


def tokens(rule: str) -> list[str]:
    """Split a rule as iptables-restore does: whitespace, double quotes, backslash escapes.

    A regex, not shlex: counters are read every second and shlex costs ~0.2 ms per rule.
    """
    if '"' not in rule and "\\" not in rule:
        return rule.split()
    return [bare if bare else _ESCAPE.sub(r"\1", quoted) for quoted, bare in _TOKEN.findall(rule)]


def normalise(rule: str) -> str:
    """One canonical spelling of a rule: tokens re-joined, double quotes only where needed."""
    if '"' not in rule and "'" not in rule and "\\" not in rule:
        return " ".join(rule.split())
    return " ".join(t if _SAFE_TOKEN.match(t) else '"' + t + '"' for t in tokens(rule))


def parse_save(text: str, keep: Callable[[str], bool] | None = None) -> dict[str, SavedTable]:
    """iptables-save / ip6tables-save output -> tables by name; `keep(chain)` skips other chains' rules."""
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
        if keep is not None and not keep(chain):
            continue
        table.rules.append(SavedRule(chain, normalise(rest[0] if rest else ""), packets, nbytes))
    return tables


def counted_comments(text: str, prefix: str) -> list[tuple[str, str, int]]:
    """(chain, comment, bytes) of every commented rule in `prefix`-chains of an iptables-save -c dump.

    One regex pass over the text: the per-second counter read never builds rule objects.
    """
    pattern = _COUNTED_COMMENT.get(prefix)
    if pattern is None:
        pattern = _COUNTED_COMMENT[prefix] = re.compile(
            r'^\[\d+:(\d+)\] -A (' + re.escape(prefix) + r'-\S+) .*?--comment (?:"((?:[^"\\]|\\.)*)"|(\S+))', re.M)
    return [(chain, _ESCAPE.sub(r"\1", quoted) if quoted else bare, int(nbytes))
            for nbytes, chain, quoted, bare in pattern.findall(text)]


_COUNTED_COMMENT: dict[str, re.Pattern] = {}


def jump_target(rule: str) -> str | None:
    """The chain a rule jumps or goes to, if any."""
    words = tokens(rule)
    for i, tok in enumerate(words[:-1]):
        if tok in ("-j", "--jump", "-g", "--goto"):
            return words[i + 1]
    return None


def comment_of(rule: str) -> str | None:
    if "--comment" not in rule:
        return None
    words = tokens(rule)
    for i, tok in enumerate(words[:-1]):
        if tok == "--comment":
            return words[i + 1]
    return None


_FULL = 0xFFFFFFFF


def _value_mask(text: str) -> tuple[int, int]:
    value, _, mask = text.partition("/")
    return int(value, 0), int(mask, 0) if mask else _FULL


def mark_masks(rule: str) -> list[tuple[str, int]]:
    """Every firewall-mark or connmark bit mask a rule reads or writes, as (option, mask).

    Covers the MARK and CONNMARK targets and the mark and connmark matches, in every
    spelling iptables-save prints (--set-xmark v/m, --set-mark, --or/--and/--xor-mark,
    --mark v[/m], --save-mark/--restore-mark with --nfmask/--ctmask/--mask), and the
    TPROXY target's --tproxy-mark (Istio's transparent proxying).
    """
    if "mark" not in rule:
        return []
    words = tokens(rule)
    out: list[tuple[str, int]] = []
    target = jump_target(rule) or ""
    i = 0
    while i < len(words):
        tok = words[i]
        arg = words[i + 1] if i + 1 < len(words) else ""
        try:
            if tok in ("--set-xmark", "--set-mark", "--mark", "--tproxy-mark"):
                out.append((f"{tok} {arg}", _value_mask(arg)[1]))
            elif tok in ("--or-mark", "--xor-mark"):
                out.append((f"{tok} {arg}", int(arg, 0)))
            elif tok == "--and-mark":
                out.append((f"{tok} {arg}", ~int(arg, 0) & _FULL))
            elif tok in ("--nfmask", "--ctmask", "--mask"):
                out.append((f"{tok} {arg}", int(arg, 0)))
            elif tok in ("--save-mark", "--restore-mark") and target == "CONNMARK":
                if not any(t in ("--nfmask", "--ctmask", "--mask") for t in words):
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


_EXT_ORDER = ("nomatch", "comment", "skbmark", "skbprio")


def _canonical_ext(option: str, value: str) -> str:
    if option == "skbmark":
        mark, _, mask = value.partition("/")
        return f"0x{int(mark, 16):x}/0x{int(mask or '0xffffffff', 16):x}"
    if option == "skbprio":
        major, _, minor = value.partition(":")
        return f"{int(major, 16):x}:{int(minor, 16):x}"
    return value


def parse_ipset_entries(text: str) -> dict[str, tuple[str, dict[str, tuple[tuple[tuple[str, str], ...], int]]]]:
    """`ipset save` output with extensions -> set name -> (create options, member -> (extensions, bytes)).

    Members are as printed (canonicalise them by the set's type); extensions are the
    (option, value) pairs that define a member (nomatch, comment, skbmark, skbprio), in one
    fixed order and canonical spelling; `packets`/`bytes` are counters, not definition.
    """
    sets: dict[str, tuple[str, dict]] = {}
    for line in text.splitlines():
        if line.startswith("create "):
            parts = line.split()
            if len(parts) >= 3:
                sets[parts[1]] = (" ".join(parts[2:]), {})
            continue
        if not line.startswith("add "):
            continue
        words = tokens(line)
        if len(words) < 3 or words[1] not in sets:
            continue
        found: dict[str, str] = {}
        nbytes, i = 0, 3
        while i < len(words):
            word = words[i]
            if word == "nomatch":
                found["nomatch"] = ""
                i += 1
                continue
            value = words[i + 1] if i + 1 < len(words) else ""
            if word == "bytes":
                nbytes = int(value)
            elif word in _EXT_ORDER:
                found[word] = _canonical_ext(word, value)
            i += 2
        ext = tuple((k, found[k]) for k in _EXT_ORDER if k in found)
        sets[words[1]][1][words[2]] = (ext, nbytes)
    return sets
