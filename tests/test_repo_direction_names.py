"""Issue 35: the direction is a value inside the code, and the edges keep their names.

The refactor from `ingress_` twins to `Direction` changes no name a user or an older agent
sees: the JSON wire fields (core/wire.py), the CRD fields and the controller's metric names
are held here as snapshots (a name may be added; none renamed or removed). And outside those
edges no identifier carries a direction as an `ingress_`/`egress_` prefix (the guard)."""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import msgspec
import pytest
import yaml

import core.wire as wire
from core.direction import Direction, PerDirection
from dashboards.contract import exported_names

REPO = Path(__file__).resolve().parent.parent

WIRE = {
    "NodeReport": ("node", "pods", "seq", "period_seconds", "node_internet_egress_bps", "node_internet_ingress_bps",
                   "shapes_ingress"),
    "PodReport": ("namespace", "name", "usage_bps", "demand_bps", "throttled", "egress_class", "egress_bandwidth",
                  "ingress_usage_bps", "ingress_demand_bps", "ingress_throttled", "ingress_bandwidth",
                  "bytes_total", "ingress_bytes_total", "scope_bytes_total", "ingress_scope_bytes_total"),
    "NodeAnswer": ("node", "generation", "lease_seconds", "safe_floor_bps", "node_rate_bps", "pods", "problems",
                   "refused", "node_ingress_rate_bps", "safe_ingress_floor_bps", "report_period_seconds", "quota"),
    # volume quotas in the answer (docs/quotas.md): `egress` is the uploads' block, `ingress` the downloads'
    "TeamQuotaState": ("team", "period", "period_start", "period_end", "egress", "ingress"),
    "QuotaFigures": ("bytes", "used", "exhausted", "exhausted_bps", "forecast_seconds"),
    "PodAllocation": ("namespace", "name", "team", "egress_class", "allocation_bps", "limit_bps",
                      "ingress_allocation_bps", "ingress_limit_bps"),
    "Refused": ("namespace", "name", "reason"),
    "ErrorBody": ("error", "reason", "leader"),
}

CRD = {
    "networkscopes": {"spec": {"zones", "regions", "prices"},
                      "spec.prices": {"currency", "internet", "cross-zone", "cross-region"}},
    "egressclasses": {"spec": {"weight", "min", "max", "ingress"}, "spec.ingress": {"weight", "min", "max"}},
    "egressbudgets": {"spec": {"total", "ingressTotal", "defaultTeam", "teams"},
                      "spec.teams[]": {"name", "weight", "min", "max", "ingress"},
                      "spec.teams[].ingress": {"weight", "min", "max"},
                      "spec.teams[].quota": {"period", "bytes", "cost", "exhaustedRate", "ingress"},
                      "spec.teams[].quota.ingress": {"bytes", "exhaustedRate"},
                      "status.quota.teams[]": {"name", "periodStart", "used", "ingressUsed", "exhausted", "ingressExhausted"},
                      "status": {"allocated", "demand", "used", "ingressAllocated", "ingressDemand", "ingressUsed"}},
}

CONTROLLER_METRICS = {
    "netagent_controller_" + name for name in (
        "agents", "pods", "is_leader", "last_round_timestamp_seconds", "policy_problems", "held_back_bytes_per_second",
        "safe_floor_bytes_per_second", "budget_bytes_per_second", "oversubscribed", "feedback_gain",
        "allocated_bytes_per_second", "demand_bytes_per_second", "used_bytes_per_second", "group_pods",
        "team_guarantee_bytes_per_second", "guarantee_unmet",
        "ingress_agents", "ingress_held_back_bytes_per_second", "ingress_safe_floor_bytes_per_second",
        "ingress_budget_bytes_per_second", "ingress_oversubscribed", "ingress_feedback_gain",
        "ingress_allocated_bytes_per_second", "ingress_demand_bytes_per_second", "ingress_used_bytes_per_second",
        "ingress_group_pods", "ingress_team_guarantee_bytes_per_second", "ingress_guarantee_unmet",
        "reports_total", "rejected_reports_total", "allocation_rounds_total", "allocation_failures_total",
        "allocation_duration_seconds_bucket", "allocation_duration_seconds_sum", "allocation_duration_seconds_count",
        "status_writes_total", "refused_pods_total", "events_total", "tls_secret_changes_total",
        "token_reviews_total", "watch_events_total", "namespaces_missing_total")
}


@pytest.mark.parametrize("struct", sorted(WIRE))
def test_the_wire_json_keeps_its_field_names(struct):
    cls = getattr(wire, struct)
    assert issubclass(cls, msgspec.Struct)
    names = cls.__struct_encode_fields__
    missing = [n for n in WIRE[struct] if n not in names]
    assert not missing, f"{struct}: wire field(s) {missing} renamed or removed; older agents/controllers read them"


def test_the_wire_scope_bytes_are_the_priced_scopes_and_old_agents_decode():
    from core.scopes import PRICED, Scope
    keys = set(wire.ScopeBytes.__origin__.__args__[0].__args__)  # type: ignore[attr-defined]
    assert keys == {s.value for s in PRICED if s is not Scope.INTERNET}
    old = wire.PodReport("ns", "p", usage_bps=0.0, demand_bps=0.0)
    assert dict(wire.POD_SCOPE_BYTES[Direction.UPLOAD](old)) == dict(wire.POD_SCOPE_BYTES[Direction.DOWNLOAD](old)) == {}
    pod = wire.PodReport("ns", "p", usage_bps=0.0, demand_bps=0.0, scope_bytes_total={"cross-zone": 5},
                         ingress_scope_bytes_total={"cross-region": 7})
    assert wire.POD_SCOPE_BYTES.map(lambda get: dict(get(pod))) == PerDirection({"cross-zone": 5}, {"cross-region": 7})


def test_the_wire_edge_reads_each_direction_from_its_json_name():
    pod = wire.PodReport("ns", "p", usage_bps=1.0, demand_bps=2.0, ingress_usage_bps=3.0, ingress_demand_bps=4.0)
    assert (wire.POD_USAGE[Direction.UPLOAD](pod), wire.POD_USAGE[Direction.DOWNLOAD](pod)) == (1.0, 3.0)
    assert wire.POD_DEMAND.map(lambda get: get(pod)) == PerDirection(2.0, 4.0)
    encoded = msgspec.json.decode(msgspec.json.encode(pod))
    assert (encoded["ingress_usage_bps"], encoded["ingress_demand_bps"]) == (3.0, 4.0)


def _crd_properties(schema: dict, path: str) -> set[str]:
    node = schema
    for part in path.split("."):
        node = node["properties"][part.removesuffix("[]")]
        if part.endswith("[]"):
            node = node["items"]
    return set(node["properties"])


@pytest.mark.parametrize("crd", sorted(CRD))
def test_the_crd_keeps_its_direction_field_names(crd):
    doc = yaml.safe_load((REPO / "charts/netagent/crds" / f"{crd}.netagent.io.yaml").read_text())
    schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, names in CRD[crd].items():
        missing = names - _crd_properties(schema, path)
        assert not missing, f"{crd} {path}: field(s) {sorted(missing)} renamed or removed"
    assert Direction.UPLOAD.crd_block is None and Direction.DOWNLOAD.crd_block == "ingress"


def test_the_controller_keeps_its_metric_names():
    names = exported_names((REPO / "controller/metrics.py").read_text())
    missing = CONTROLLER_METRICS - names
    assert not missing, f"controller metric(s) {sorted(missing)} renamed or removed; dashboards and alerts query them"
    assert {d.metric_word for d in Direction} == {"egress", "ingress"}


# -- the guard: a direction is a value, never a name prefix, outside the edges ---------------------

# Packages held to it.
PACKAGES = ("core", "controller", "cli", "netagent")
EDGE_FILES = {
    "core/wire.py",  # its dataclass fields mirror the JSON names
    "netagent/view.py",  # PodView/NodeView fields are the agent's /state JSON keys (tests/test_agent_names.py)
    "netagent/metrics.py",  # renders those views' fields into the metric families of the same names
}
PREFIXED = re.compile(r"^(ingress|egress)_[a-z_]+$")
# not a direction: the EgressClass kind, and the kubernetes.io/egress-bandwidth annotation's wire field
NOT_A_DIRECTION = {"egress_class", "egress_bandwidth"}
# Edge names used outside the edge files, each for its reason
COMPAT = {
    # the agent's flags: from_flags' keywords are the flags' argparse names (--ingress-*), users type them
    "cli/main.py": {"ingress_ifb"},
    "netagent/config.py": {"ingress_rate", "ingress_default_rate", "ingress_ifb"},
    # the controller's answer read by its JSON names (core/wire.py has no per-direction reader for
    # them), and the view's byte counters (/state keys) the quota counters come from
    "netagent/reporter.py": {"ingress_allocation_bps", "ingress_limit_bps", "egress_bytes", "ingress_bytes"},
}


def prefixed_names(path: Path) -> set[str]:
    """Identifiers in `path` with a direction prefix (strings and comments are edge words: metric
    names, JSON keys, CSV columns)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in tokens
            if t.type == tokenize.NAME and PREFIXED.match(t.string) and t.string not in NOT_A_DIRECTION}


def test_no_direction_prefix_outside_the_edges():
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            names = prefixed_names(path) - COMPAT.get(rel, set())
            if rel not in EDGE_FILES and names:
                found[rel] = sorted(names)
    assert not found, f"a direction as a name prefix (use Direction / PerDirection): {found}"


def test_the_guard_sees_a_prefix_in_code_but_not_in_strings(tmp_path):
    f = tmp_path / "x.py"
    f.write_text('ingress_rate = 1\nname = "netagent_pod_ingress_bytes"  # ingress_comment\negress_class = 2\n')
    assert prefixed_names(f) == {"ingress_rate"}
