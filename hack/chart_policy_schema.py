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

Then every refusal of the schema gets an example (Helm prints no description and supports no
errorMessage): each typed leaf becomes anyOf [the leaf, a branch that only says what is expected and
an example: {"const": TEXT, "not": {"const": TEXT}}, which no value passes], so Helm prints the leaf's
own refusal (type, range, enum) and beneath it "value must be 'TEXT'"; `additionalProperties: false`
becomes such a branch, so an unknown key is named by its own path with the known keys. The example is
the value's default in values.yaml, else one from EXAMPLES, else from its enum or bounds.
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
VALUES = CHART / "values.yaml"
WHERE = {"egressClassSpec": "classes[].spec", "egressBudgetSpec": "budget.spec"}  # $defs as the user writes them
HINT = "netagent: an example for Helm's message, accepts nothing"
# examples where values.yaml has none (an empty default or a key of a map), by the path's last parts
EXAMPLES = {"image.tag": "0.1.0", "image.digest": "sha256:0123…", "nameOverride": "egress",
            "fullnameOverride": "egress", "uplinks.[]": "eth0", "dnsNames.[]": "netagent.example.com",
            "issuerRef.name": "my-issuer", "issuerRef.kind": "ClusterIssuer", "issuerRef.group": "cert-manager.io",
            "extraArgs.[]": "--log-level=debug", "controller.url": "https://netagent.example.com:9561",
            "clusterIP": "10.96.0.50", "period": 10, "leaseSeconds": 15, "reportPeriod": 10, "resyncPeriod": 300,
            "maxUnavailable": "25%", "minAvailable": 1, "markBit": "0x1000", "defaultRate": "1M",
            "dashboards.namespace": "monitoring", "cidr": "10.0.0.0/8", "quantity": "256Mi",
            "toleration.key": "example.com/gpu", "toleration.value": "true", "name": "research",
            "mountPath": "/etc/netagent/extra", "defaultTeam": "default", "namespaces.[]": "research",
            "matchExpressions.[].key": "team", "values.[]": "research", "defaultClass": "bronze",
            "allowedClasses.[]": "bronze", "quota.period": "Month", "quotaTimeZone": "Europe/Berlin",
            "*": "value"}


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
    out = _plain(schema)  # a new tree without the hints: a rerun rewrites them
    for name, crd in CRDS.items():
        out["$defs"][name] = spec_schema(crd)
    out["properties"]["classes"]["items"]["properties"]["spec"] = {"$ref": "#/$defs/egressClassSpec"}
    out["properties"]["budget"]["properties"]["spec"] = {"$ref": "#/$defs/egressBudgetSpec"}
    defaults = yaml.safe_load(VALUES.read_text())
    defs = {k: with_hints(v, [k], None) for k, v in out.pop("$defs").items()}
    out = with_hints(out, [], defaults)
    return {**out, "$defs": defs}


def _example(path: list[str], node: dict, default: Any) -> Any:
    if default not in (None, "") and not isinstance(default, (dict, list)):
        return default
    for n in range(len(path), 0, -1):
        if ".".join(path[-n:]) in EXAMPLES:
            return EXAMPLES[".".join(path[-n:])]
    if "enum" in node:
        return node["enum"][0]
    types = node["type"] if isinstance(node["type"], list) else [node["type"]]
    if "boolean" in types:
        return True
    if "integer" in types or "number" in types:
        return node.get("minimum", 1)
    return "text"


def _expected(node: dict) -> str:
    if "enum" in node:
        return "one of " + ", ".join(str(v) for v in node["enum"])
    words = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
             "null": "empty"}
    types = node["type"] if isinstance(node["type"], list) else [node["type"]]
    text = " or ".join(words.get(str(t), str(t)) for t in types)
    if "minimum" in node and "maximum" in node:
        text += f" from {node['minimum']} to {node['maximum']}"
    elif "minimum" in node:
        text += f" of at least {node['minimum']}"
    if "maxLength" in node:
        text += f", at most {node['maxLength']} characters"
    return text


def _says(text: str) -> dict:
    return {"$comment": HINT, "const": text, "not": {"const": text}}


def _plain(node: Any) -> Any:
    """The schema without the hints (so a rerun rewrites them)."""
    if isinstance(node, list):
        return [_plain(v) for v in node]
    if not isinstance(node, dict):
        return node
    if "anyOf" in node and node["anyOf"][-1].get("$comment") == HINT:
        return _plain(node["anyOf"][0])
    out = {k: _plain(v) for k, v in node.items()}
    if isinstance(node.get("additionalProperties"), dict) and node["additionalProperties"].get("$comment") == HINT:
        out["additionalProperties"] = False
    return out


def with_hints(node: Any, path: list[str], default: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    props = node.get("properties", {})
    if props:
        out["properties"] = {k: with_hints(v, path + [k], default.get(k) if isinstance(default, dict) else None)
                             for k, v in props.items()}
    if isinstance(node.get("items"), dict):
        out["items"] = with_hints(node["items"], path + ["[]"],
                                  default[0] if isinstance(default, list) and default else None)
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = with_hints(node["additionalProperties"], path + ["*"], None)
    elif node.get("additionalProperties") is False and props:
        where = ".".join(WHERE.get(p, p) for p in path).replace(".[]", "[]") or "the values"
        out["additionalProperties"] = _says(f"no such key in {where}: expected one of {', '.join(props)}, "
                                            f"e.g. {next(iter(props))}")
    leaf = "type" in node and node["type"] not in ("object", "array") and not props
    if leaf:
        example = json.dumps(_example(path, node, default), ensure_ascii=False)
        if len(path) > 1 and path[-1] == "[]":
            example = f"{path[-2]}: [{example}]"
        elif len(path) > 1 and path[-1] == "*":
            example = f"{path[-2]}: {{key: {example}}}"
        elif path:
            example = f"{path[-1]}: {example}"
        return {"anyOf": [out, _says(f"{_expected(node)}, e.g. {example}")]}
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
