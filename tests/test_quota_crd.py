"""Issue 38's quota fields in the EgressBudget CRD (charts/netagent/crds/, the one source; deploy/crds/ is
rendered from it): the real kube-apiserver refuses the issue's Bad-input list and accepts its example, by a
server-side dry run against the installed CRD, and the parser (core/quota.py) refuses each too; the chart
refuses each at render (`helm template` with the quota in its policy values: values.schema.json and
templates/validate-rates.yaml), so an upgrade never applies half a release and then fails on the budget."""
from __future__ import annotations

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from core.direction import PerDirection
from core.quantity import RATE_PATTERN
from core.quota import PERIODS, parse_team_quota, parse_time_zone
from tests.kube import REPO
from tests.test_deploy import CHART, helm
from tests.test_agent_kube import install_crds

CRD = REPO / "charts" / "netagent" / "crds" / "egressbudgets.netagent.io.yaml"


def _schema() -> dict:
    doc = yaml.safe_load(CRD.read_text())
    version, = [v for v in doc["spec"]["versions"] if v.get("storage")]
    return version["schema"]["openAPIV3Schema"]


GOOD = {"period": "Month", "bytes": "50Ti", "exhaustedRate": "100M",
        "ingress": {"bytes": "200Ti", "exhaustedRate": "500M"}}
BAD = [
    ({"period": "Month", "bytes": "-1Ti"}, "bytes"),
    ({"period": "Month", "bytes": "0"}, "must be above zero"),
    ({"period": "Month", "bytes": 0}, "must be above zero"),
    ({"period": "Year", "bytes": "1Ti"}, "Unsupported value"),
    ({"period": "month", "bytes": "1Ti"}, "Unsupported value"),
    ({"bytes": "1Ti"}, "period"),
    # 2^63 and more, in every form (the parser's exact refusals: tests/test_quantity_bytes.py)
    ({"period": "Month", "bytes": "8Ei"}, "below 2^63-1"), ({"period": "Month", "bytes": "9223372036854775807"}, "below"),
    ({"period": "Month", "bytes": "9Ei"}, "below 2^63-1"),
    ({"period": "Month", "bytes": "10000000000000000000"}, "below 2^63-1"),
    ({"period": "Month", "bytes": "1e30"}, "below 2^63-1"),
    ({"period": "Month", "bytes": "8.5Ei"}, "below 2^63-1"), ({"period": "Month", "bytes": "100Ei"}, "below 2^63-1"),
    ({"period": "Month", "bytes": "9.5E"}, "below 2^63-1"), ({"period": "Month", "bytes": "20E"}, "below 2^63-1"),
    ({"period": "Month", "bytes": "9000Pi"}, "below 2^63-1"), ({"period": "Month", "bytes": "1e19"}, "below 2^63-1"),
    ({"period": "Month", "bytes": "50TB"}, "must be a byte count"),
    ({"period": "Month", "bytes": "lots"}, "must be a byte count"),
    ({"period": "Month", "bytes": "1" * 40}, "bytes"),
    ({"period": "Month", "ingress": {"bytes": "-5"}}, "ingress.bytes"),
    ({"period": "Month", "bytes": "1Ti", "exhaustedRate": "10Mbit"}, "must be a rate"),
    ({"period": "Month", "bytes": "1Ti", "exhaustedRate": "2G"}, "must not be above its max"),
    ({"period": "Month", "ingress": {"bytes": "1Ti", "exhaustedRate": "3G"}}, "must not be above its ingress.max"),
    ({"period": "Month"}, "needs bytes"),
    ({"period": "Month", "exhaustedRate": "1M", "ingress": {"bytes": "1G"}}, "exhaustedRate needs bytes"),
]


# accepted by the schema, the parser and the chart (the largest byte count the schema takes is 2^63-2)
ACCEPTED = [GOOD, {"period": "Day", "ingress": {"bytes": "1G"}}, {"period": "Week", "bytes": "9223372036854775806"},
            {"period": "Week", "bytes": "7Ei"}]


@pytest.fixture
def budgets(kube_api):
    install_crds(kube_api)
    return client.CustomObjectsApi(kube_api.admin)


def _create(objects, quota, zone=None) -> str | None:
    spec: dict = {"total": "10G", "teams": [{"name": "research", "max": "1G", "ingress": {"max": "2G"}, "quota": quota}]}
    if zone is not None:
        spec["quotaTimeZone"] = zone
    body = {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressBudget", "metadata": {"name": "q"}, "spec": spec}
    try:
        objects.create_cluster_custom_object("netagent.io", "v1alpha1", "egressbudgets", body, dry_run="All")
    except ApiException as exc:
        assert exc.status == 422, f"{quota!r}: {exc.status} {exc.body}"
        return exc.body
    return None


def test_schema_refuses_the_bad_input_and_accepts_the_example(budgets):
    assert _create(budgets, GOOD, zone="Europe/Berlin") is None
    for quota in ACCEPTED:
        assert _create(budgets, quota) is None, quota
    wrong = []
    for quota, fragment in BAD:
        body = _create(budgets, quota)
        if body is None or fragment not in body:
            wrong.append(f"{quota!r}: {body}")
        # the parser refuses each too (the previous valid policy stays in force there), but 2^63-1 (its largest)
        if quota.get("bytes") != "9223372036854775807":
            assert parse_team_quota(quota, "q", team_max_bps=PerDirection(10**9, 2 * 10**9))[0] is None, quota
    assert not wrong, "\n".join(wrong)
    for zone in ("../etc/passwd", "Europe Berlin", "x" * 65):
        assert _create(budgets, GOOD, zone=zone) is not None, zone
        assert parse_time_zone(zone, "z")[1], zone


def test_schema_carries_the_parsers_pattern_and_periods():
    team = _schema()["properties"]["spec"]["properties"]["teams"]["items"]
    quota = team["properties"]["quota"]
    text = yaml.safe_dump(quota, width=10**6)
    assert text.count(".matches('") == text.count(f".matches('{RATE_PATTERN}')") == 4
    assert quota["properties"]["period"]["enum"] == list(PERIODS)
    fields = {r.get("fieldPath") for r in team["x-kubernetes-validations"]}
    assert {".quota.exhaustedRate", ".quota.ingress.exhaustedRate"} <= fields


def _render(tmp_path, quotas: list) -> str | None:
    """`helm template` of the chart's policy with one team per quota (as _create's team): None when it renders
    them all, else helm's message."""
    teams = [{"name": f"t{i}", "namespaces": [f"t{i}"], "max": "1G", "ingress": {"max": "2G"}, "quota": q}
             for i, q in enumerate(quotas)]
    values = tmp_path / "quota-values.yaml"
    values.write_text(yaml.safe_dump({"budget": {"spec": {"total": "10G", "teams": teams}}}))
    result = helm("template", "netagent", str(CHART), "-f", str(values), "--show-only", "templates/policy.yaml",
                  check=False)
    if result.returncode:
        return result.stderr
    rendered, = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "EgressBudget"]
    assert [t["quota"] for t in rendered["spec"]["teams"]] == quotas
    return None


def test_the_chart_refuses_at_render_what_the_schema_refuses(tmp_path):
    assert _render(tmp_path, ACCEPTED) is None
    wrong = []
    for quota, _ in BAD:
        refusal = _render(tmp_path, [quota])
        # named: the quota's path (templates) or its key (values.schema.json: period)
        if refusal is None or not ("teams[0] (t0).quota" in refusal or "period" in refusal):
            wrong.append(f"{quota!r}: {refusal}")
    assert not wrong, "\n".join(wrong)
    for quota, words in [({"period": "Month", "bytes": "1Ti", "cost": "0.00"}, "cost=\"0.00\" is refused: it is zero"),
                         ({"period": "Month", "cost": "12,50"}, "cost=\"12,50\" is refused"),
                         ({"period": "Month", "bytes": "0.5"}, None),  # half a byte: one byte, as the parser
                         ({"period": "Month", "bytes": "1Ti", "exhaustedRate": "1G"}, None)]:  # at the max
        refusal = _render(tmp_path, [quota])
        assert (refusal is None) if words is None else (refusal is not None and words in refusal), (quota, refusal)
