"""The suite's time by test file, from pytest's JUnit XML: where CI's minutes go (issue 35).

    python hack/suite_time.py .ci/junit.xml [--top 30]

Prints each file's total seconds (calls, setup and teardown as pytest's JUnit report sums them),
its test count and share of the whole, slowest first, then each failed test with the first lines of
its message (last, so that a truncated CI log still shows why). Used by .ci/run after the suite.
"""
from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def by_file(path: str) -> tuple[dict[str, float], dict[str, int]]:
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for case in ET.parse(path).getroot().iter("testcase"):
        # classname is the dotted module path plus any class: tests.test_x.TestY -> tests/test_x.py
        parts = case.get("classname", "?").split(".")
        module = [p for p in parts if not p[:1].isupper()]
        name = "/".join(module) + ".py"
        seconds[name] += float(case.get("time", 0) or 0)
        count[name] += 1
    return seconds, count


def failures(path: str, lines: int = 4) -> list[tuple[str, str]]:
    """(test id, the first `lines` lines of its failure or error message) of every test that did not pass."""
    found = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for bad in (*case.iter("failure"), *case.iter("error")):
            text = bad.get("message") or bad.text or ""
            found.append((f"{case.get('classname', '?')}::{case.get('name', '?')}", "\n".join(text.splitlines()[:lines])))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    seconds, count = by_file(args.junit)
    total = sum(seconds.values()) or 1.0
    print(f"===== suite time by file: {sum(count.values())} tests, {total / 60:.1f} min in tests =====")
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{s:8.1f} s  {100 * s / total:5.1f} %  {count[name]:4d} tests  {name}")
    failed = failures(args.junit)
    if failed:
        print(f"===== {len(failed)} failed =====")
        for test, message in failed:
            print(f"{test}\n    " + message[:600].replace("\n", "\n    "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
