"""One grammar for rates: one table of strings through every place that reads a rate, the same verdict in each.

- the agent's flag parser (`netagent run --default-rate`, through the CLI's own argparse and config builder),
- `netagent plan` with an EgressClass whose spec.max is the string (the policy parser of the controller),
- the chart (`helm template` with agent.defaultRate from a values file and from `--set`, and an EgressClass of
  the policy values (classes[].spec.max and .min), the real helm: schema
  and templates/validate-rates.yaml; the policy values the parser accepts in one render, chart_policies),
- the CRDs (an EgressClass with spec.max created through the real kube-apiserver, server-side dry run: CEL).

The grammar itself is core.quantity.RATE_PATTERN; the CRDs and the chart carry that exact string (checked below
without any binary). Where they disagreed the parser was the truth (docs/crds.md, "Rates").
"""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from cli.main import _flags_for, build_parser
from cli.main import main as netagent_main
from core.quantity import MAX_BPS, RATE_MAX_CHARS, RATE_PATTERN, parse_bps
from netagent.config import ConfigError, from_flags
from tests.test_agent_kube import install_crds
from tests.test_deploy import CHART, DEPLOY, helm

# (string, accepted) -- the expected verdict is the parser's; every grammar must give the same.
TABLE = [
    ("10M", True), ("10Mi", True), ("1.5G", True), ("100k", True), ("1T", True), ("1P", True), ("9P", True),
    ("1e3", True), ("1E3", True), ("1e+3", True), ("1e-3", True), ("2e9", True), ("1e030", False), ("1e30", False),
    ("1e31", False), ("+3M", True), (".5k", True), ("1.", True), ("1.e3", True), ("0.1", True), ("1Ki", True),
    ("100Gi", True), ("8Pi", True), ("0.001Ei", True), ("1000000", True),
    ("9007199254740992", True), ("9007199254740993", False), ("8.1Pi", False), ("10P", False), ("1Ei", False),
    ("9223372036854775808", False),  # 2^63: past int64 as well
    ("0", False), ("0.0k", False), ("-1M", False), ("-0", False), ("-1", False),
    ("10Mbit", False), ("10mbit", False), ("10Mbps", False), ("500m", False), ("1u", False), ("100K", False),
    ("", False), ("10 M", False), (" 7k", False), ("7k ", False), ("abc", False), ("1e", False), ("0x10", False),
    ("1,5M", False), ("1_000", False), ("١٠M", False),  # Arabic-Indic digits: Python's \d would take them
    # 2^53 exactly, in every form, and just above it: no float rounding anywhere
    ("9007199254740991.5", True), ("9007199254740992.5", False), ("9007199254.740992M", True),
    ("9007199254.7409925M", False), ("8796093022208Ki", True), ("8796093022208.0001Ki", False),
    ("0.0078125Ei", True), ("0.00781251Ei", False), ("9.007199254740992e15", True),
    ("9.0071992547409921e15", False), ("90071992547409920e-1", True),
    ("9007199254740992.000000000000001", False),  # 31 digits: past Decimal's default precision
    ("0" * 31 + "1", True), ("0" * 32 + "1", False),  # the CRDs' maxLength, RATE_MAX_CHARS
]


def agent_flag(text: str, tmp_path: Path) -> bool:
    """`netagent run --default-rate TEXT` as far as its configuration: the CLI's argparse, then the builder.
    --uplink lo only so the builder needs no default route; nothing is started, nothing is changed."""
    policy = tmp_path / "empty.yaml"
    policy.touch()
    args = build_parser().parse_args(["run", "--from-file", str(policy), "--node", "n1", "--uplink", "lo",
                                      f"--default-rate={text}"])
    try:
        cfg = from_flags(**_flags_for(from_flags, args))
    except ConfigError as exc:
        assert str(exc).startswith("--default-rate"), f"{text!r}: refused for another reason: {exc}"
        return False
    assert 1 <= cfg.datapath.floors.upload <= MAX_BPS
    return True


def plan(text: str, tmp_path: Path, field: str = "max") -> bool:
    """`netagent plan -f policy -d demand` with an EgressClass whose spec.max is TEXT (JSON: always a string):
    accepted means the pod is planned in that class."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(json.dumps({"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass",
                                  "metadata": {"name": "gold"}, "spec": {"weight": 1, field: text}})
                      + "\n---\n" + json.dumps({"apiVersion": "netagent.io/v1alpha1", "kind": "EgressBudget",
                                                "metadata": {"name": "default"}, "spec": {"total": "1G"}}))
    demand = tmp_path / "demand.csv"
    demand.write_text("namespace,pod,class,demand\na,p1,gold,10M\n")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = netagent_main(["plan", "-f", str(policy), "-d", str(demand), "-o", "json"])
    assert code == 0, err.getvalue()
    # a class the parser refuses is ignored with a warning (it never costs the rest of the policy anything)
    refused = f"EgressClass gold: spec: {field}:" in err.getvalue()
    assert refused == ("the EgressClass is ignored" in err.getvalue()), err.getvalue()
    assert refused == ('"gold"' not in out.getvalue()), out.getvalue()
    return not refused


def chart(text: str, tmp_path: Path, how: str) -> bool:
    """`helm template` with agent.defaultRate=TEXT from a values file (always a string) or `--set` (which
    types "1000000" as an integer, as users' command lines do): accepted means the agent's args carry it."""
    if how == "--set":
        given = ["--set", f"agent.defaultRate={text}"]
    else:
        values = tmp_path / "values.yaml"
        values.write_text(json.dumps({"agent": {"defaultRate": text}}))
        given = ["-f", str(values)]
    result = helm("template", "netagent", str(CHART), *given, "--show-only", "templates/agent.yaml", check=False)
    if result.returncode:
        assert "agent.defaultRate" in result.stderr or "/agent/defaultRate" in result.stderr, result.stderr
        return False
    args = yaml.safe_load(result.stdout)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--default-rate={text}" in args, args
    return True


def chart_policy(text: str, tmp_path: Path, field: str = "max") -> bool:
    """`helm template` with an EgressClass's spec.FIELD=TEXT in the chart's policy values: accepted means
    the rendered EgressClass carries it (refused at render, before anything is applied)."""
    values = tmp_path / "policy-values.yaml"
    values.write_text(json.dumps({"classes": [{"name": "rate-table", "spec": {"weight": 1, field: text}}],
                                  "budget": {"spec": {"total": "10G"}}}))
    result = helm("template", "netagent", str(CHART), "-f", str(values), "--show-only", "templates/policy.yaml",
                  check=False)
    if result.returncode:
        assert f"classes[0] (rate-table).spec.{field}=" in result.stderr, result.stderr
        return False
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "EgressClass"]
    assert str(rendered[0]["spec"][field]) == text, rendered
    return True


def parser_accepts(text: str, field: str) -> bool:
    """The parser's verdict on TEXT as an EgressClass's spec.FIELD (a min may be zero, a max not)."""
    try:
        parse_bps(text, "x", allow_zero=field == "min")
    except ValueError:
        return False
    return True


def chart_policies(texts: list[str], tmp_path: Path) -> dict[tuple[str, str], bool]:
    """chart_policy's verdict for every (text, field) of TEXTS x (max, min), in fewer renders.

    The pairs the parser accepts go into one `helm template` together, one EgressClass each
    (classes[i].spec.FIELD = text and nothing else, as chart_policy's one class): if it renders, the chart
    accepts every one of them. That holds because the chart checks each class on its own, as it would alone:
    values.schema.json's `items` (per class), validate-values.yaml's name pattern (per class) and
    validate-rates.yaml's netagent.checkLimits (per class: netagent.rate on that value alone; its min-above-max
    check needs both in one class, and each class here holds one); no check spans classes, so none can pass in
    the batch where one class alone would be refused. A refused batch says only that some pair is refused,
    not which (the chart stops at the first): then every pair of it is rendered alone, so each verdict is still
    exact. A pair the parser refuses is rendered alone too (a refusal is only seen where it is the first)."""
    pairs = [(text, field) for field in ("max", "min") for text in texts]
    batch = [pair for pair in pairs if parser_accepts(*pair)]
    verdicts: dict[tuple[str, str], bool] = {}
    if batch:
        values = tmp_path / "policy-batch-values.yaml"
        values.write_text(json.dumps({"classes": [{"name": f"rate-table-{i}", "spec": {"weight": 1, field: text}}
                                                  for i, (text, field) in enumerate(batch)],
                                      "budget": {"spec": {"total": "10G"}}}))
        result = helm("template", "netagent", str(CHART), "-f", str(values), "--show-only",
                      "templates/policy.yaml", check=False)
        if result.returncode == 0:
            rendered = {d["metadata"]["name"]: d for d in yaml.safe_load_all(result.stdout)
                        if d and d["kind"] == "EgressClass"}
            assert len(rendered) == len(batch), sorted(rendered)
            for i, (text, field) in enumerate(batch):
                assert str(rendered[f"rate-table-{i}"]["spec"][field]) == text, rendered[f"rate-table-{i}"]
                verdicts[text, field] = True
    for text, field in pairs:
        if (text, field) not in verdicts:
            verdicts[text, field] = chart_policy(text, tmp_path, field)
    return verdicts


def crd(objects: client.CustomObjectsApi, text: str, field: str = "max") -> bool:
    """An EgressClass with spec.max=TEXT created through the real API server (dry run: nothing is stored)."""
    body = {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": "rate-table"},
            "spec": {"weight": 1, field: text}}
    try:
        objects.create_cluster_custom_object("netagent.io", "v1alpha1", "egressclasses", body, dry_run="All")
    except ApiException as exc:
        assert exc.status == 422, f"{text!r}: {exc.status} {exc.body}"
        assert f"spec.{field}" in exc.body, exc.body
        return False
    return True


def test_every_grammar_gives_the_same_verdict(kube_api, tmp_path):
    install_crds(kube_api)
    objects = client.CustomObjectsApi(kube_api.admin)
    rows, disagree = [], []
    policy = chart_policies([text for text, _ in TABLE], tmp_path)
    for text, accepted in TABLE:
        verdicts = {"agent --default-rate": agent_flag(text, tmp_path), "netagent plan": plan(text, tmp_path),
                    "helm -f": chart(text, tmp_path, "-f"), "helm policy": policy[text, "max"],
                    "kube-apiserver": crd(objects, text)}
        if "," not in text:  # --set splits its argument at commas
            verdicts["helm --set"] = chart(text, tmp_path, "--set")
        rows.append(f"{text!r:24} " + " ".join(f"{k}={'ok' if v else 'refused'}" for k, v in verdicts.items()))
        if set(verdicts.values()) != {accepted}:
            disagree.append(rows[-1] + f"  (expected {'ok' if accepted else 'refused'})")
        # spec.min takes zero (a guarantee of nothing); every other verdict is the same
        at_least_zero = accepted or text in ("0", "0.0k")
        try:
            assert parse_bps(text, "x", allow_zero=True) >= 0 and at_least_zero, text
        except ValueError:
            assert not at_least_zero, text
        guarantees = {"netagent plan spec.min": plan(text, tmp_path, "min"),
                      "helm policy spec.min": policy[text, "min"],
                      "kube-apiserver spec.min": crd(objects, text, "min")}
        if set(guarantees.values()) != {at_least_zero}:
            disagree.append(f"{text!r:24} " + " ".join(f"{k}={'ok' if v else 'refused'}" for k, v in guarantees.items())
                            + f"  (expected {'ok' if at_least_zero else 'refused'})")
    assert not disagree, "grammars disagree:\n" + "\n".join(disagree)


# --- the one string, without any binary ----------------------------------------------------------------


def _rate_rules(node, path=""):
    """(path, matches() pattern) of every int-or-string field of a CRD schema, None where it has no rule."""
    if isinstance(node, dict):
        if node.get("x-kubernetes-int-or-string"):
            rules = [r["rule"] for r in node.get("x-kubernetes-validations", []) if ".matches(" in r["rule"]]
            found = [re.search(r"\.matches\('([^']*)'\)", r)[1] for r in rules]
            assert node.get("maxLength") == RATE_MAX_CHARS, f"{path}: maxLength {node.get('maxLength')}"
            yield path, found
        for key, value in node.items():
            yield from _rate_rules(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _rate_rules(value, f"{path}[{i}]")


@pytest.mark.parametrize("name", ["egressclasses", "egressbudgets"])
def test_crds_carry_the_parsers_pattern(name):
    crd_doc = yaml.safe_load((DEPLOY / "crds" / f"{name}.yaml").read_text())
    fields = list(_rate_rules(crd_doc))
    assert len(fields) >= 4, fields
    for path, patterns in fields:
        assert patterns == [RATE_PATTERN], f"{name}{path}: {patterns}"
    text = (CHART / "crds" / f"{name}.netagent.io.yaml").read_text()
    assert text.count(".matches('") == text.count(f".matches('{RATE_PATTERN}')") == len(fields)


def test_chart_checks_the_parsers_pattern():
    text = (CHART / "templates" / "_rates.tpl").read_text()
    assert f'regexMatch "{RATE_PATTERN}" $rate' in text
    assert f"gt (len $rate) {RATE_MAX_CHARS}" in text
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert "pattern" not in schema["properties"]["agent"]["properties"]["defaultRate"]  # one grammar, not two


def test_the_pattern_is_plain_enough_for_every_engine():
    """RE2 (CEL, helm) and Python's re read it alike: no classes whose meaning differs (\\d is Unicode in
    Python), no \\Z, no lookaround."""
    assert "\\" not in RATE_PATTERN and "(?" not in RATE_PATTERN
    assert RATE_PATTERN.startswith("^") and RATE_PATTERN.endswith("$")
    with pytest.raises(ValueError):
        parse_bps("10M\n", "x")  # "$" before a trailing newline matches in Python: the parser fullmatches


@pytest.mark.parametrize("given, words", [
    ("10Mbit", ['agent.defaultRate="10Mbit" is refused', "e.g. 500k, 10M", "write 10M, not 10Mbit"]),
    ("500m", ['agent.defaultRate="500m" is refused', "m means milli", "write M"]),
    ("0", ['agent.defaultRate="0" is refused', "it is zero", "e.g. 1M"]),
    ("10P", ['agent.defaultRate="10P" is refused', "largest rate, 8Pi (2^53)", "e.g. 1M"]),
    ("", ['agent.defaultRate="" is refused', "expected a rate in bit/s"]),
])
def test_chart_refusal_names_the_value_what_it_expected_and_an_example(given, words):
    result = helm("template", "netagent", str(CHART), "--set", f"agent.defaultRate={given}", check=False)
    assert result.returncode != 0
    for word in words:
        assert word in result.stderr, result.stderr
