"""A tenant's junk-token flood at the controller's TokenReview gate, with figures: runs
tests/test_controller_authflood.py's flood (100 tenant addresses posting well-formed junk tokens
naming agent pods with guessed uids, ten real agents reporting every second with real projected
tokens whose cached verdicts expire every 2 s; the real kube-apiserver of tests/kube.py and a real
controller process) and prints the reviews made, refusals by reason and the agents' answers.

    python3 bench/auth_flood.py                      # this tree, about 1.5 minutes
    python3 bench/auth_flood.py --baseline 86adc46~2 # and the same against an older tree's controller

The baseline row comes from `git archive REV` run the same way (the test fails there: that is the
figure). Junk per second is what one Python process on the bench machine sends, not a bound.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEST = "tests/test_controller_authflood.py::test_junk_from_a_hundred_tenant_addresses_never_locks_out_ten_agents"


def run(tree: Path | None, out: Path) -> tuple[int, dict]:
    env = {**os.environ, "NETAGENT_AUTHFLOOD_OUT": str(out),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if tree is not None:
        env["NETAGENT_AUTHFLOOD_TREE"] = str(tree)
    rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST], cwd=REPO,
                        env=env).returncode
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return rc, rows[-1] if rows else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", metavar="REV", help="also run the controller of this git revision")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="netagent-authflood-") as tmp:
        if args.baseline:
            tree = Path(tmp) / "baseline"
            tree.mkdir()
            archive = subprocess.run(["git", "archive", args.baseline], cwd=REPO, check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
            results.append((f"baseline {args.baseline}", *run(tree, Path(tmp) / "baseline.jsonl")))
        results.append(("this tree", *run(None, Path(tmp) / "current.jsonl")))
    print("| controller | junk/s | agent reports | answered 200 | agents' answers | reviews made "
          "| refusals by reason | agents' p99 answer s | test |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rc, r in results:
        codes = r.get("agent_codes", {})
        refusals = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.get("refusals", {}).items())) or "none"
        print(f"| {name} | {r.get('junk_per_second')} | {r.get('agent_reports')} | {codes.get('200', 0)} "
              f"| {json.dumps(codes)} | {r.get('reviews', 0):.0f} | {refusals} | {r.get('agent_p99_s')} "
              f"| {'passes' if rc == 0 else 'FAILS'} |")
    return results[-1][1]


if __name__ == "__main__":
    sys.exit(main())
