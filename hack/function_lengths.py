"""Functions over 50 lines per product package at a git revision (docs/architecture.md's table).

    python3 hack/function_lengths.py 3f752b3 HEAD

Counts `def`s (methods and nested functions too) from their `def` line to their last line, as ast
gives them, in the .py files git holds at each revision: the working tree's edits are not counted.
"""
from __future__ import annotations

import ast
import subprocess
import sys

PACKAGES = ("cli", "core", "netagent", "controller", "tc", "iptables", "nlwire")
LIMIT = 50


def long_functions(rev: str, package: str) -> list[tuple[int, str]]:
    files = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, f"{package}/"], capture_output=True,
                           text=True, check=True).stdout.split()
    out = []
    for f in files:
        if not f.endswith(".py"):
            continue
        src = subprocess.run(["git", "show", f"{rev}:{f}"], capture_output=True, text=True, check=True).stdout
        for n in ast.walk(ast.parse(src)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (n.end_lineno or n.lineno) - n.lineno + 1
                if length > LIMIT:
                    out.append((length, f"{f}:{n.name}"))
    return sorted(out, reverse=True)


def main(revs: list[str]) -> None:
    table = {rev: {p: long_functions(rev, p) for p in PACKAGES} for rev in revs}
    print(f"| package | " + " | ".join(f"over {LIMIT} lines at {rev} (longest)" for rev in revs) + " |")
    print("|---|" + "---|" * len(revs))
    for p in PACKAGES:
        cells = []
        for rev in revs:
            rows = table[rev][p]
            cells.append(f"{len(rows)}" + (f" ({rows[0][1].split(':')[1]} {rows[0][0]})" if rows else ""))
        print(f"| `{p}/` | " + " | ".join(cells) + " |")
    print("| all | " + " | ".join(str(sum(len(v) for v in table[rev].values())) for rev in revs) + " |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["HEAD"])
