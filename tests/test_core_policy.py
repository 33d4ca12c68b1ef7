"""Policy loading and per-pod resolution, and the CRDs' schemas: pure, no cluster."""
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from core.direction import Direction, PerDirection
from core.engine import PodDemandIn, allocate
from core.objects import PodRecord
from core.policy import (DEFAULT_CLASS, REASON_CLASS_NOT_ALLOWED, REASON_INVALID_BANDWIDTH,
                         REASON_INVALID_INGRESS_BANDWIDTH, REASON_UNKNOWN_CLASS, Limits, PolicyError, load_policy,
                         parse_class, resolve_pod, resolve_pods)
from core.quantity import MAX_BPS, parse_bps


def up(annotation: str | None) -> PerDirection[str | None]:
    """The upload's bandwidth annotation alone."""
    return PerDirection(annotation, None)

POLICY = list(yaml.safe_load_all("""
apiVersion: netagent.io/v1alpha1
kind: EgressClass
metadata: {name: gold}
spec: {weight: 4, min: 10M, max: 1G}
---
apiVersion: netagent.io/v1alpha1
kind: EgressClass
metadata: {name: bronze}
spec: {weight: 1, max: 100M}
---
apiVersion: netagent.io/v1alpha1
kind: EgressBudget
metadata: {name: default}
spec:
  total: 10G
  defaultTeam: others
  teams:
  - {name: research, namespaces: [team-a, team-b], weight: 3, min: 1G, defaultClass: gold, allowedClasses: [gold, bronze]}
  - {name: batch, namespaces: [jobs], weight: 1, max: 2G, defaultClass: bronze, allowedClasses: [bronze]}
  - name: labelled
    namespaceSelector: {matchLabels: {org: ml}, matchExpressions: [{key: tier, operator: NotIn, values: [dev]}]}
"""))


def load(docs=None):
    docs = list(POLICY if docs is None else docs)
    classes = [d for d in docs if d["kind"] == "EgressClass"]
    budgets = [d for d in docs if d["kind"] == "EgressBudget"]
    return load_policy(classes, budgets)


def test_loads_the_example():
    policy, problems = load()
    assert problems == []
    assert policy.totals.upload == 10**10 and policy.budget_name == "default"
    assert set(policy.classes) == {"gold", "bronze", DEFAULT_CLASS}
    assert policy.classes["bronze"].limits.upload.max_bps == 100_000_000 and policy.classes["bronze"].limits.upload.min_bps == 0
    assert [t.name for t in policy.teams] == ["research", "batch", "labelled", "others"]  # implicit default team last
    assert policy.team("research").limits.upload.min_bps == 10**9 and policy.team("research").limits.upload.max_bps == MAX_BPS
    assert policy.team_for("team-b").name == "research"
    assert policy.team_for("jobs").name == "batch"
    assert policy.team_for("elsewhere").name == "others"
    assert policy.team_for("x", {"org": "ml"}).name == "labelled"
    assert policy.team_for("x", {"org": "ml", "tier": "dev"}).name == "others"


def test_no_budget_gives_the_builtin_policy():
    policy, problems = load_policy([], [])
    assert problems == [] and policy.totals.upload == MAX_BPS and policy.budget_name == ""
    assert [t.name for t in policy.teams] == ["default"]
    pod = resolve_pod(policy, "anything", None, up("5M"))
    assert (pod.team, pod.egress_class, pod.limits.upload.max_bps, pod.limits.upload.min_bps) == ("default", DEFAULT_CLASS, 5_000_000, 0)


def test_resolve_default_class_and_annotation_cap():
    policy, _ = load()
    pod = resolve_pod(policy, "team-a", None)
    assert (pod.team, pod.egress_class, pod.limits.upload, pod.problems) == \
        ("research", "gold", Limits(4.0, 10_000_000, 10**9), ())
    # the bandwidth annotation tightens the cap and pulls the guarantee down with it
    pod = resolve_pod(policy, "team-a", "gold", up("5M"))
    assert (pod.limits.upload.min_bps, pod.limits.upload.max_bps) == (5_000_000, 5_000_000)
    # ... but never loosens it
    assert resolve_pod(policy, "team-a", "bronze", up("10G")).limits.upload.max_bps == 100_000_000


@pytest.mark.parametrize("ns, cls, bw, reason, expect_class", [
    ("team-a", "platinum", None, REASON_UNKNOWN_CLASS, "gold"),
    ("jobs", "gold", None, REASON_CLASS_NOT_ALLOWED, "bronze"),
    ("team-a", None, "10Mbit", REASON_INVALID_BANDWIDTH, "gold"),
    ("team-a", None, "500m", REASON_INVALID_BANDWIDTH, "gold"),
])
def test_resolve_problems_fall_back_to_the_team_default(ns, cls, bw, reason, expect_class):
    policy, _ = load()
    pod = resolve_pod(policy, ns, cls, up(bw))
    assert pod.egress_class == expect_class
    assert [r for r, _ in pod.problems] == [reason]
    message = pod.problems[0][1]
    assert (cls or bw) in message
    if reason == REASON_INVALID_BANDWIDTH:
        assert pod.limits.upload.max_bps == policy.classes["gold"].limits.upload.max_bps  # annotation ignored, not half-applied


def test_blank_annotations_mean_unset():
    policy, _ = load()
    pod = resolve_pod(policy, "jobs", "  ", up(" "))
    assert pod.egress_class == "bronze" and pod.problems == ()


def bad_class(spec, name="broken"):
    return {"kind": "EgressClass", "metadata": {"name": name}, "spec": spec}


@pytest.mark.parametrize("spec, fragment", [
    ({"weight": 0}, "spec.weight: 0 is not an integer from 1"),
    ({"weight": 1.5}, "spec.weight"),
    ({"weight": True}, "spec.weight"),
    ({"min": "20M", "max": "10M"}, "min (20M) is above max (10M)"),
    ({"max": "fast"}, "spec: max: 'fast' is not a Kubernetes quantity"),
    ({"max": "0"}, "zero"),
    ("nonsense", "spec must be an object"),
])
def test_bad_class_is_skipped_and_described(spec, fragment):
    with pytest.raises(PolicyError) as err:
        parse_class(bad_class(spec))
    assert str(err.value).startswith("EgressClass broken")
    assert fragment in str(err.value)
    policy, problems = load(POLICY + [bad_class(spec)])
    assert "broken" not in policy.classes and "gold" in policy.classes
    assert len(problems) == 1 and fragment in problems[0] and "ignored" in problems[0]


def test_bad_names_and_duplicates():
    _, problems = load_policy([{"metadata": {"name": "Bad_Name"}, "spec": {}}], [])
    assert "must be a lower-case DNS name" in problems[0]
    policy, problems = load_policy([bad_class({"weight": 2}, "a"), bad_class({"weight": 3}, "a")], [])
    assert policy.classes["a"].limits.upload.weight == 2 and "defined twice" in problems[0]


def budget(spec, name="default"):
    return {"kind": "EgressBudget", "metadata": {"name": name}, "spec": spec}


def test_budget_without_total_falls_back_to_builtin():
    policy, problems = load(POLICY[:2] + [budget({"teams": []})])
    assert policy.budget_name == "" and policy.totals.upload == MAX_BPS
    assert "spec.total is required" in problems[0]


def test_bad_team_skipped_others_kept():
    spec = {"total": "1G", "teams": [
        {"name": "ok", "namespaces": ["a"], "weight": 2},
        {"name": "bad", "namespaces": ["b"], "weight": -1},
        {"name": "ok", "namespaces": ["c"]},
        {"name": "clash", "namespaces": ["a", "d"]},
        {"name": "ghost", "defaultClass": "nope"},
        {"name": "restricted", "allowedClasses": ["gold", "missing"], "defaultClass": "bronze"},
    ]}
    policy, problems = load(POLICY[:2] + [budget(spec)])
    names = [t.name for t in policy.teams]
    assert names == ["ok", "clash", "ghost", "restricted", "default"]
    text = "\n".join(problems)
    assert "spec.teams[1] (bad).weight" in text and "team ok is defined twice" in text
    assert "namespace a is listed by teams ok and clash; it belongs to ok" in text
    assert policy.team_for("a").name == "ok" and policy.team_for("d").name == "clash"
    assert "EgressClass nope does not exist" in text and policy.team("ghost").default_class == DEFAULT_CLASS
    assert "EgressClass missing does not exist" in text
    assert "bronze is not in allowedClasses" in text and policy.team("restricted").default_class == "gold"


def test_guarantee_overflow_is_reported():
    spec = {"total": "1G", "teams": [{"name": "a", "min": "800M"}, {"name": "b", "min": "800M"}]}
    policy, problems = load(POLICY[:2] + [budget(spec)])
    assert policy.totals.upload == 10**9 and any("Oversubscribed" in p for p in problems)


def test_several_budgets_prefer_default_then_name():
    policy, problems = load(POLICY[:2] + [budget({"total": "1G"}, "zeta"), budget({"total": "2G"}, "alpha")])
    assert policy.budget_name == "alpha" and policy.totals.upload == 2 * 10**9
    assert any("EgressBudget zeta: only one budget is used" in p for p in problems)
    policy, _ = load(POLICY + [budget({"total": "1G"}, "alpha")])
    assert policy.budget_name == "default"


def test_selector_validation():
    spec = {"total": "1G", "teams": [{"name": "s", "namespaceSelector": {"matchExpressions": [
        {"key": "x", "operator": "Near", "values": ["y"]}]}}]}
    _, problems = load(POLICY[:2] + [budget(spec)])
    assert "operator 'Near' is not one of" in problems[0]
    spec["teams"][0]["namespaceSelector"] = {"matchExpressions": [{"key": "x", "operator": "In"}]}
    _, problems = load(POLICY[:2] + [budget(spec)])
    assert "operator In needs values" in problems[0]
    # without namespace labels a selector still sees the namespace's own name label
    spec["teams"][0]["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": "web"}}
    policy, _ = load(POLICY[:2] + [budget(spec)])
    assert policy.team_for("web").name == "s" and policy.team_for("api").name == "default"


# -- the CRDs (deploy/crds): parse, structural sanity, and agreement with this loader ----------

CRDS = Path(__file__).resolve().parent.parent / "deploy" / "crds"
QUANTITY_RULE = re.compile(r"^string\(self\)\.matches\('(.*)'\)$")  # CEL, for a message users can act on


def crd(name):
    return yaml.safe_load((CRDS / f"{name}.yaml").read_text())


def walk(schema, path=""):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}")
    if "items" in schema:
        yield from walk(schema["items"], f"{path}[]")


@pytest.mark.parametrize("name, kind", [("egressclasses", "EgressClass"), ("egressbudgets", "EgressBudget")])
def test_crd_is_structural_and_named(name, kind):
    doc = crd(name)
    assert doc["kind"] == "CustomResourceDefinition" and doc["metadata"]["name"] == f"{name}.netagent.io"
    spec = doc["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["kind"], spec["names"]["plural"]) == \
        ("netagent.io", "Cluster", kind, name)
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    for path, node in walk(version["schema"]["openAPIV3Schema"]):
        # structural: every node has a type, except int-or-string with exactly the allowed anyOf
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            assert QUANTITY_RULE.match(node["x-kubernetes-validations"][0]["rule"]) and node.get("maxLength"), path
        else:
            assert "type" in node, f"{path} has no type"
        for rule in node.get("x-kubernetes-validations", []):
            assert rule["rule"] and rule["message"], path
    for column in version["additionalPrinterColumns"]:
        assert column["jsonPath"].startswith((".spec", ".status", ".metadata")), column


def test_crd_fields_match_what_the_loader_reads():
    cls = crd("egressclasses")["spec"]["versions"][0]
    cls_spec = cls["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(cls_spec["properties"]) == {"weight", "min", "max", "ingress"}
    assert [c["name"] for c in cls["additionalPrinterColumns"]] == \
        ["Weight", "Min", "Max", "Ingress-Weight", "Ingress-Min", "Ingress-Max", "Age"]
    budget = crd("egressbudgets")["spec"]["versions"][0]
    assert budget["subresources"] == {"status": {}}
    spec = budget["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["total"] and set(spec["properties"]) == {"total", "ingressTotal", "defaultTeam", "teams",
                                                                 "quotaTimeZone"}
    team = spec["properties"]["teams"]
    assert team["x-kubernetes-list-map-keys"] == ["name"]  # team names unique, by the apiserver
    assert set(team["items"]["properties"]) == {"name", "namespaces", "namespaceSelector", "weight", "min", "max",
                                                "defaultClass", "allowedClasses", "ingress", "quota"}
    for ingress in (cls_spec["properties"]["ingress"], team["items"]["properties"]["ingress"]):
        assert set(ingress["properties"]) == {"weight", "min", "max"}
        # no defaults: an absent ingress weight means "the upload weight", which a schema default would hide
        assert "default" not in ingress["properties"]["weight"] and "default" not in ingress
        for rate in ("min", "max"):  # the same rules as the upload fields
            upload = (cls_spec if ingress is cls_spec["properties"]["ingress"] else team["items"])["properties"][rate]
            assert ingress["properties"][rate]["x-kubernetes-validations"] == upload["x-kubernetes-validations"]
        assert "min must not be above" in ingress["x-kubernetes-validations"][0]["message"]
    assert spec["properties"]["ingressTotal"]["x-kubernetes-validations"][1]["rule"] == \
        spec["properties"]["total"]["x-kubernetes-validations"][1]["rule"]  # above zero, as total
    columns = [c["name"] for c in budget["additionalPrinterColumns"]]
    assert columns[:3] == ["Total", "Allocated", "Used"]
    assert {"Ingress-Total", "Ingress-Allocated", "Ingress-Used", "Ingress-Demand"} <= set(columns)
    status = budget["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"allocated", "demand", "used", "pods", "nodes", "conditions", "lastComputed",
            "ingressAllocated", "ingressDemand", "ingressUsed"} <= set(status)


def test_crd_quantity_rule_agrees_with_the_parser():
    node = crd("egressclasses")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["max"]
    pattern = re.compile(QUANTITY_RULE.match(node["x-kubernetes-validations"][0]["rule"])[1])
    for text in ("500k", "10M", "1.5G", "100Mi", "2e9", "1E3", ".5k", "7"):
        assert pattern.match(text) and parse_bps(text, "x") > 0, text
    for text in ("500m", "10Mbit", "-1", "1 G", "", "5u", "1e31"):  # 1e-3 is 1 bit/s for both (ceil)
        assert not pattern.match(text), text


def test_status_written_by_the_controller_is_declared():
    """Fields missing from the schema would be pruned by the apiserver without a word."""
    from controller.allocator import Summary
    from controller.status import budget_status

    declared = crd("egressbudgets")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    down = Summary("default", 2e9, 2e9, 3e9, 1.9e9, 3, 1, False)
    for summary in (Summary("default", 1e9, 5e8, 6e8, 4e8, 3, 2, True),
                    Summary("default", 1e9, 5e8, 6e8, 4e8, 3, 2, True, ingress=down)):
        status = budget_status(summary, 0.0, None)
        assert set(status) <= set(declared["properties"])
        for condition in status["conditions"]:
            assert set(condition) <= set(declared["properties"]["conditions"]["items"]["properties"])
    assert (status["ingressAllocated"], status["ingressDemand"], status["ingressUsed"]) == ("2G", "3G", "1.9G")
    assert [(c["type"], c["status"]) for c in status["conditions"]] == [("Oversubscribed", "True"),
                                                                        ("IngressOversubscribed", "False")]


def test_example_policy_loads_cleanly():
    docs = list(yaml.safe_load_all((CRDS.parent.parent / "docs" / "examples" / "policy.yaml").read_text()))
    policy, problems = load_policy([d for d in docs if d["kind"] == "EgressClass"],
                                   [d for d in docs if d["kind"] == "EgressBudget"])
    assert problems == [] and policy.totals.upload == 10**9 and policy.default_team == "shared"
    assert policy.totals[Direction.DOWNLOAD] == 500 * 10**6  # and a download example: spec.ingressTotal, ingress
    assert policy.classes["bulk"].limits[Direction.DOWNLOAD].max_bps == 50 * 10**6


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=True) |
    st.sampled_from(["", "10M", "gold", "default", "500m", "-1", "a", "In", "Exists"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["metadata", "name", "spec", "weight", "min", "max", "total", "teams", "namespaces", "ingress",
                         "ingressTotal",
                         "defaultClass", "allowedClasses", "defaultTeam", "namespaceSelector", "matchLabels",
                         "matchExpressions", "key", "operator", "values"]), inner, max_size=5),
    max_leaves=25)


CLASS_SHAPED = st.fixed_dictionaries({"metadata": st.fixed_dictionaries({"name": st.sampled_from(["gold", "x", ""])}),
                                      "spec": st.dictionaries(st.sampled_from(["weight", "min", "max", "ingress"]),
                                                              JSONISH)})
TEAM_SHAPED = st.dictionaries(st.sampled_from(["name", "namespaces", "namespaceSelector", "weight", "min", "max",
                                               "defaultClass", "allowedClasses", "ingress"]), JSONISH)
BUDGET_SHAPED = st.fixed_dictionaries({
    "metadata": st.fixed_dictionaries({"name": st.sampled_from(["default", "b"])}),
    "spec": st.fixed_dictionaries({"total": JSONISH, "teams": st.lists(TEAM_SHAPED, max_size=4),
                                   "defaultTeam": JSONISH, "ingressTotal": JSONISH})})


@settings(max_examples=300, deadline=None)
@given(st.lists(JSONISH | CLASS_SHAPED, max_size=3), st.lists(JSONISH | BUDGET_SHAPED, max_size=3),
       st.text(max_size=8), st.none() | st.text(max_size=8))
def test_any_input_loads_or_is_described_never_crashes(classes, budgets, namespace, annotation):
    policy, problems = load_policy(classes, budgets)
    assert all(isinstance(p, str) and p for p in problems)
    pod = resolve_pod(policy, namespace, annotation, PerDirection(annotation, annotation), namespace_labels=None)
    assert pod.egress_class in policy.classes
    for d, limits in pod.limits.items():
        assert 0 <= limits.min_bps <= limits.max_bps and limits.weight >= 1, d
        assert all(0 < t.limits[d].weight and 0 <= t.limits[d].min_bps <= t.limits[d].max_bps for t in policy.teams)


def test_every_text_a_user_reads_says_a_guarantee_is_a_floor_under_the_weighted_share():
    """The engine's semantics (clamp(λ·weight, guarantee, cap)) in every place a user reads them:
    README, docs/crds.md and the CRDs' field descriptions (what `kubectl explain` prints)."""
    repo = CRDS.parent.parent
    texts = {"README.md": (repo / "README.md").read_text(), "docs/crds.md": (repo / "docs/crds.md").read_text()}
    cls = yaml.safe_load((CRDS / "egressclasses.yaml").read_text())
    budget = yaml.safe_load((CRDS / "egressbudgets.yaml").read_text())
    cls_spec = cls["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    team = (budget["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            ["teams"]["items"]["properties"])
    texts["EgressClass spec.min"] = cls_spec["min"]["description"]
    texts["EgressBudget teams[].min"] = team["min"]["description"]
    for where, text in texts.items():
        assert "floor under" in " ".join(text.split()), where
        assert "left after guarantees" not in text, where
    for where, text in (("EgressClass spec.weight", cls_spec["weight"]["description"]),
                        ("EgressBudget teams[].weight", team["weight"]["description"])):
        assert "never less than its min" in " ".join(text.split()), where


# -- downloads (ingress): the same policy, its own values and total -------------------------------

DOWNLOADS = list(yaml.safe_load_all("""
apiVersion: netagent.io/v1alpha1
kind: EgressClass
metadata: {name: gold}
spec: {weight: 4, min: 10M, max: 1G, ingress: {weight: 2, min: 50M, max: 5G}}
---
apiVersion: netagent.io/v1alpha1
kind: EgressClass
metadata: {name: bronze}
spec: {weight: 3, max: 100M}
---
apiVersion: netagent.io/v1alpha1
kind: EgressBudget
metadata: {name: default}
spec:
  total: 10G
  ingressTotal: 2G
  teams:
  - {name: research, namespaces: [ra], weight: 3, min: 1G, ingress: {weight: 1, min: 500M, max: 1500M}}
  - {name: batch, namespaces: [jobs], weight: 1, defaultClass: bronze}
"""))


def test_ingress_values_load_beside_the_upload_ones():
    policy, problems = load(DOWNLOADS)
    assert problems == []
    assert policy.totals == PerDirection(10**10, 2 * 10**9)
    gold, bronze = policy.classes["gold"], policy.classes["bronze"]
    assert gold.limits == PerDirection(Limits(4, 10**7, 10**9), Limits(2, 5 * 10**7, 5 * 10**9))  # uploads untouched
    # no ingress block: the upload weight, no guarantee, no cap (nothing new guaranteed or capped silently)
    assert bronze.limits.download == Limits(3, 0, MAX_BPS)
    research, batch = policy.team("research"), policy.team("batch")
    assert research.limits.download == Limits(1, 5 * 10**8, 15 * 10**8)
    assert batch.limits.download == Limits(1, 0, MAX_BPS)
    assert policy.team("default").limits.download.weight == 1


def test_existing_objects_have_no_download_budget():
    policy, problems = load()
    assert problems == [] and policy.totals.download == MAX_BPS
    for c in policy.classes.values():
        assert c.limits.download == Limits(c.limits.upload.weight, 0, MAX_BPS)


def test_one_parser_reads_both_directions_blocks():
    """The CRD keeps downloads in an `ingress` block (Direction.crd_block): read by the same
    function as the top level, so a bad value names the same field in either place."""
    spec = {"weight": 2, "min": "1M", "max": "9M", "ingress": {"weight": 2, "min": "1M", "max": "9M"}}
    c = parse_class({"metadata": {"name": "x"}, "spec": spec})
    assert c.limits.upload == c.limits.download == Limits(2, 10**6, 9 * 10**6)
    for d in Direction:
        bad = {**spec, "ingress": dict(spec["ingress"])}
        (bad if d.crd_block is None else bad[d.crd_block])["max"] = "-1M"
        with pytest.raises(PolicyError, match=rf"spec\.{d.crd_block}: max" if d.crd_block else r"spec: max"):
            parse_class({"metadata": {"name": "x"}, "spec": bad})


def test_the_engine_allocates_downloads_on_the_ingress_policy():
    """One engine, two directions: the download total split by the ingress weights and guarantees."""
    policy, _ = load(DOWNLOADS)
    pods = []
    for ns, name in (("ra", "a"), ("jobs", "b"), ("jobs", "c")):
        pp = resolve_pod(policy, ns, None)
        d = pp.limits.download
        pods.append(PodDemandIn(f"{ns}/{name}", pp.team, pp.egress_class, d.weight, d.min_bps, d.max_bps, 10**10))
    down = allocate(policy, pods, direction=Direction.DOWNLOAD)
    assert down.total_bps == 2 * 10**9 and down.allocated_bps == pytest.approx(2 * 10**9)
    # research: its download guarantee (500M) is a floor under an equal-weight share (1G) -> 1G; batch 1G
    assert down.teams["research"].allocated_bps == pytest.approx(10**9)
    assert down.teams["batch"].allocated_bps == pytest.approx(10**9)
    assert down.pods["jobs/b"].allocation_bps == pytest.approx(5 * 10**8)
    up = allocate(policy, [PodDemandIn(p.key, p.team, p.egress_class, 1.0, 0, MAX_BPS, 10**11) for p in pods])
    assert up.teams["research"].allocated_bps == pytest.approx(7.5 * 10**9)  # uploads by the upload weights (3:1)


def test_ingress_annotation_lowers_the_download_cap_only():
    policy, _ = load(DOWNLOADS)
    pod = resolve_pod(policy, "ra", "gold", PerDirection("200M", "20M"))
    assert pod.limits == PerDirection(Limits(4.0, 10**7, 2 * 10**8), Limits(2.0, 2 * 10**7, 2 * 10**7))
    assert pod.bandwidth == PerDirection("200M", "20M") and pod.problems == ()
    raised = resolve_pod(policy, "ra", "gold", PerDirection(None, "100G"))
    assert raised.limits.download.max_bps == 5 * 10**9  # never raised above the class's
    assert resolve_pod(policy, "ra", "gold", PerDirection(None, "  ")).problems == ()


@pytest.mark.parametrize("value", ["-5M", "0", "fast", "10Mbit", "1e400", "500m", "99999999999999999999G"])
def test_bad_ingress_annotation_keeps_the_class_values_with_a_problem(value):
    policy, _ = load(DOWNLOADS)
    pod = resolve_pod(policy, "ra", "gold", PerDirection("200M", value))
    ((reason, message),) = pod.problems
    assert reason == REASON_INVALID_INGRESS_BANDWIDTH and "kubernetes.io/ingress-bandwidth" in message
    assert "ignored" in message
    assert (pod.limits.download.max_bps, pod.limits.download.min_bps) == (5 * 10**9, 5 * 10**7)  # the class's
    assert pod.limits.upload.max_bps == 2 * 10**8  # the upload annotation still applies


def test_resolve_pods_reads_the_ingress_annotation():
    policy, _ = load(DOWNLOADS)
    ann = (("kubernetes.io/ingress-bandwidth", "30M"), ("netagent.io/egress-class", "gold"))
    bad = (("kubernetes.io/ingress-bandwidth", "lots"),)
    records = [PodRecord("ra", "p1", "u1", "n", ("10.0.0.1",), False, "Running", ann),
               PodRecord("jobs", "p2", "u2", "n", ("10.0.0.2",), False, "Running", bad)]
    one, two = resolve_pods(policy, records)
    down = one.limits[Direction.DOWNLOAD]
    assert (down.max_bps, down.weight, one.bandwidth[Direction.DOWNLOAD]) == (3 * 10**7, 2.0, "30M")
    assert two.limits.download.max_bps == MAX_BPS and two.problems[0][0] == REASON_INVALID_INGRESS_BANDWIDTH
    assert two.limits.download.weight == 3.0 and two.egress_class == "bronze"
    assert two.bandwidth == PerDirection(None, "lots")  # as the pod carries it


def test_resolved_pod_holds_its_values_per_direction():
    from core.policy import Limits, ResolvedPod
    limits = PerDirection(Limits(3.0, 0, 10**9), Limits(3.0))
    p = ResolvedPod("a/b", "a", "b", "u", ("10.0.0.1",), "web", "default", limits)
    assert p.limits[Direction.DOWNLOAD] == Limits(3.0, 0, MAX_BPS) and p.bandwidth == PerDirection(None, None)


@pytest.mark.parametrize("ingress, fragment", [
    ({"min": "2G", "max": "1G"}, "spec.ingress: min (2G) is above max (1G)"),
    ({"max": "-1M"}, "spec.ingress: max"),
    ({"max": 0}, "spec.ingress: max"),
    ({"weight": 0}, "spec.ingress.weight"),
    ({"weight": 2.5}, "spec.ingress.weight"),
    ("10M", "spec.ingress: must be an object"),
])
def test_bad_class_ingress_is_refused_naming_the_field(ingress, fragment):
    with pytest.raises(PolicyError, match=re.escape(fragment)):
        parse_class({"metadata": {"name": "x"}, "spec": {"weight": 1, "ingress": ingress}})
    policy, problems = load_policy([{"metadata": {"name": "x"}, "spec": {"ingress": ingress}}], [])
    assert "x" not in policy.classes and fragment in problems[0]


def test_bad_team_ingress_skips_the_team_naming_the_field():
    budget = {"metadata": {"name": "default"}, "spec": {"total": "1G", "teams": [
        {"name": "ok", "namespaces": ["a"]}, {"name": "bad", "namespaces": ["b"], "ingress": {"min": "-1"}}]}}
    policy, problems = load_policy([], [budget])
    assert [t.name for t in policy.teams] == ["ok", "default"]
    assert any("spec.teams[1] (bad).ingress: min" in p and "team is ignored" in p for p in problems)


def test_bad_ingress_total_keeps_the_upload_budget():
    budget = {"metadata": {"name": "default"}, "spec": {"total": "1G", "ingressTotal": "-5G"}}
    policy, (problem,) = load_policy([], [budget])
    assert policy.totals == PerDirection(10**9, MAX_BPS) and policy.budget_name == "default"
    assert "spec.ingressTotal" in problem and "no cluster download budget" in problem


def test_download_guarantees_above_the_download_total_are_reported_naming_the_field():
    docs = yaml.safe_load_all("""
kind: EgressClass
metadata: {name: big}
spec: {ingress: {min: 3G}}
---
kind: EgressBudget
metadata: {name: default}
spec:
  total: 10G
  ingressTotal: 1G
  teams:
  - {name: a, ingress: {min: 2G}}
  - {name: b, ingress: {min: 600M}}
""")
    policy, problems = load(list(docs))
    text = "\n".join(problems)
    assert "spec.teams[0] (a).ingress.min" in text and "spec.ingressTotal" in text
    assert "EgressClass big: spec.ingress.min" in text
    assert "spec.teams[].ingress.min) add up to more than spec.ingressTotal" in text
    assert not any("spec.teams[1]" in p for p in problems)  # 600M alone fits
    assert policy.team("a").limits.download.min_bps == 2 * 10**9  # kept: scaled down by the engine, as for uploads
    assert load(DOWNLOADS)[1] == []  # guarantees within the download total: no problem
