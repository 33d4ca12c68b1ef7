"""Keep the chart's values.schema.json for the policy values (classes[].spec, budget.spec) equal to the
CRDs' own schemas, so Helm refuses a wrong type, range, size, enum or unknown key in them before anything
is applied (an upgrade the API server refuses halfway leaves a half-applied release).

    python3 hack/chart_policy_schema.py          # write $defs.egressClassSpec / egressBudgetSpec
    python3 hack/chart_policy_schema.py --check  # exit 1 when they are stale (tests/test_chart_upgrade.py)

From each CRD's openAPIV3Schema.properties.spec: the Kubernetes extensions (x-kubernetes-*) go, and so do
`pattern` and the int-or-string `anyOf`, whose Helm messages are a bare regular expression: the
rates, names and the CRDs' CEL rules are checked by templates/validate-rates.yaml instead, whose
messages name the value, what is expected and an example. Objects refuse unknown keys (the API server
would drop them silently: a misspelt `ingres:` would be lost).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "netagent"
SCHEMA = CHART / "values.schema.json"
CRDS = {"egressClassSpec": CHART / "crds" / "egressclasses.netagent.io.yaml",
        "egressBudgetSpec": CHART / "crds" / "egressbudgets.netagent.io.yaml"}
DROPPED = ("pattern", "anyOf", "default")


def convert(node: Any) -> Any:
    if isinstance(node, list):
        return [convert(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: convert(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k not in DROPPED}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("maxLength", None)  # a rate: its length is the template's check, with the grammar's message
    if out.get("type") == "object" and "properties" in out and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def spec_schema(crd: Path) -> dict:
    doc = yaml.safe_load(crd.read_text())
    version, = [v for v in doc["spec"]["versions"] if v.get("storage")]
    return convert(version["schema"]["openAPIV3Schema"]["properties"]["spec"])


def updated(schema: dict) -> dict:
    out = json.loads(json.dumps(schema))
    for name, crd in CRDS.items():
        out["$defs"][name] = spec_schema(crd)
    out["properties"]["classes"]["items"]["properties"]["spec"] = {"$ref": "#/$defs/egressClassSpec"}
    out["properties"]["budget"]["properties"]["spec"] = {"$ref": "#/$defs/egressBudgetSpec"}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    current = json.loads(SCHEMA.read_text())
    want = updated(current)
    if args.check:
        if want != current:
            print(f"{SCHEMA.relative_to(REPO)} is stale for the CRDs: run python3 hack/chart_policy_schema.py")
            return 1
        return 0
    SCHEMA.write_text(json.dumps(want, indent=2, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
