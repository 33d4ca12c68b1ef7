"""Policy in values is owned by Helm, and the CRDs' upgrade story (docs/install.md "Policy",
"Upgrade", "Upgrading the CRDs"), with the real `helm` against the real kube-apiserver (tests/kube.py;
no node: the release's workloads are only objects here, the policy objects are what is checked).

- The EgressClasses and EgressBudget of `classes`/`budget` are ordinary templates of release `egress`
  in `egress-system`: install creates them, upgrade changes, adds and deletes them, rollback brings
  the previous ones back, `helm template` (Argo CD, Flux) renders them without hooks.
- An upgrade with a policy value the CRDs would refuse (a rate their CEL refuses, a weight out of range,
  an unknown key, a min above its max...) fails at render, before anything is applied, naming the
  value with an example. One the cluster refuses for its own reasons (an admission policy) fails with
  the API server's message; with `--rollback-on-failure`, as documented, nothing of it stays. Without
  it Helm leaves what it applied before the refusal: the test shows that too, so the docs can say why
  the flag.
- From the chart as it was with its CRDs as templates and the policy as a post-install hook
  (commit f6f7e5b): the upgrade is refused until the new CRDs are applied (their change: negative
  exponents), then until the CRDs are kept (crds.keep=false would have them deleted with every
  policy object), then Helm refuses to adopt the hook's objects until --take-ownership; afterwards
  the policy is the release's, in the new grammar.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from lab.procs import wait_for
from tests.kube import REPO
from tests.node import require_node_assets

CHART = REPO / "charts" / "netagent"
RELEASE = "egress"
# The rollback of --rollback-on-failure waits for the release's workloads to be ready, which none
# becomes on a bare API server (no controller manager, no node): it restores the objects, then waits
# this long and says so (tests/test_install.py runs the same refusal where the wait passes)
ROLLBACK_ON_FAILURE = ("--rollback-on-failure", "--timeout=5s")
CRDS = ("egressclasses.netagent.io", "egressbudgets.netagent.io", "networkscopes.netagent.io")
PREVIOUS_CHART_COMMIT = "f6f7e5b"  # CRDs as templates, policy as a post-install hook
# The spec of each revision of crds/, hashed: a change of crds/ must raise netagent.io/crd-revision
# (templates/validate-crds.yaml refuses an upgrade over an older revision) and add its hash here.
CRD_REVISIONS = {
    2: {"egressclasses.netagent.io": "922804871a1b2d4418fe18d3d568060a6d42e6cc31a020ea63ea39f5611450eb",
        "egressbudgets.netagent.io": "f42df3aed8a696e46882ce8e887fd4200ea15f3740dae9a02569f8ac161574a4"},
    # issue 38: teams[].quota, spec.quotaTimeZone, status.quota
    3: {"egressclasses.netagent.io": "922804871a1b2d4418fe18d3d568060a6d42e6cc31a020ea63ea39f5611450eb",
        "egressbudgets.netagent.io": "7094205deed9c70e67600cd2c64fe2984f0dbd0d82d8ae9470f069816816a152"},
    # issue 39: NetworkScopes (new), teams[].quota.cost
    4: {"egressclasses.netagent.io": "922804871a1b2d4418fe18d3d568060a6d42e6cc31a020ea63ea39f5611450eb",
        "egressbudgets.netagent.io": "bee5ed9148ca7d8f9a87533c8bd35f9f3f9c0fa2f5ac20557117a2ca63231cea",
        "networkscopes.netagent.io": "f32524b50d1c79f12e3e73411bd71c18189ec3b64b150f007eb1698c73face56"},
}

CLASSES = [{"name": "bronze", "spec": {"weight": 1, "max": "20M"}},
           {"name": "silver", "spec": {"weight": 2, "max": "40M"}}]
BUDGET = {"name": "default", "spec": {"total": "1G", "teams": [
    {"name": "lab", "namespaces": ["lab"], "defaultClass": "bronze", "allowedClasses": ["bronze", "silver"]}]}}


def helm(kube_api, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    binary = require_node_assets(["helm"]) / "helm"
    result = subprocess.run([str(binary), f"--kubeconfig={kube_api.kubeconfig}", *args],
                            capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
    return result


def values(tmp_path: Path, **extra) -> Path:
    path = tmp_path / f"values-{len(list(tmp_path.glob('values-*')))}.yaml"
    path.write_text(yaml.safe_dump({"classes": CLASSES, "budget": BUDGET, **extra}))
    return path


def classes(kube_api) -> dict[str, dict]:
    out = kube_api.kubectl("get", "egressclasses", "-o", "json").stdout
    return {o["metadata"]["name"]: o for o in json.loads(out)["items"]}


def maxima(kube_api) -> dict[str, str]:
    return {name: o["spec"].get("max") for name, o in classes(kube_api).items()}


def controller_args(kube_api, namespace: str) -> list[str]:
    out = kube_api.kubectl("get", "deployment", "-n", namespace, "-l", "app.kubernetes.io/component=controller",
                           "-o", "json").stdout
    deployment, = json.loads(out)["items"]
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.fixture
def release(kube_api):
    """A namespace egress-system-<random> for release `egress` (a bare API server never finishes
    deleting a namespace: each test has its own), the cluster without netagent CRDs (Helm installs
    crds/ only where they are missing; earlier modules' copies go, as in tests/test_install.py), and
    everything the test made removed afterwards: the release, the policy objects, the CRDs (which
    Helm never deletes), the namespace."""
    kube_api.kubectl("delete", "crd", "--ignore-not-found", *CRDS)
    namespace = kube_api.create_namespace("egress-system-")
    try:
        yield namespace
    finally:
        helm(kube_api, "uninstall", RELEASE, "-n", namespace, "--ignore-not-found", check=False)
        kube_api.kubectl("delete", "egressclasses,egressbudgets", "--all", "--ignore-not-found", check=False)
        kube_api.kubectl("delete", "crd", "--ignore-not-found", *CRDS, check=False)
        kube_api.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false", check=False)


def install(kube_api, tmp_path, namespace: str, chart: Path = CHART, *args: str) -> None:
    helm(kube_api, "install", RELEASE, str(chart), "-n", namespace,
         "-f", str(values(tmp_path)), *args)


# --- owned by the release ---------------------------------------------------------------------


def test_policy_follows_install_upgrade_and_rollback(kube_api, release, tmp_path):
    install(kube_api, tmp_path, release)
    found = classes(kube_api)
    assert {n: o["spec"]["max"] for n, o in found.items()} == {"bronze": "20M", "silver": "40M"}
    for o in found.values():
        annotations = o["metadata"].get("annotations", {})
        assert annotations["meta.helm.sh/release-name"] == RELEASE, annotations
        assert annotations["meta.helm.sh/release-namespace"] == release
        assert "helm.sh/hook" not in annotations
    budget = json.loads(kube_api.kubectl("get", "egressbudget", "default", "-o", "json").stdout)
    assert budget["spec"]["teams"][0]["allowedClasses"] == ["bronze", "silver"]

    # upgrade: silver changed, gold added, the budget's team allows it
    changed = [CLASSES[0], {"name": "silver", "spec": {"weight": 2, "max": "50M"}},
               {"name": "gold", "spec": {"weight": 4, "max": "80M", "min": "10M"}}]
    team = {**BUDGET["spec"]["teams"][0], "allowedClasses": ["bronze", "silver", "gold"]}
    upgraded = tmp_path / "upgraded.yaml"
    upgraded.write_text(yaml.safe_dump({"classes": changed, "budget": {**BUDGET, "spec": {**BUDGET["spec"],
                                                                                          "teams": [team]}}}))
    helm(kube_api, "upgrade", RELEASE, str(CHART), "-n", release, "-f", str(upgraded))
    assert maxima(kube_api) == {"bronze": "20M", "silver": "50M", "gold": "80M"}
    budget = json.loads(kube_api.kubectl("get", "egressbudget", "default", "-o", "json").stdout)
    assert budget["spec"]["teams"][0]["allowedClasses"] == ["bronze", "silver", "gold"]

    # rollback: silver back, gold deleted
    helm(kube_api, "rollback", RELEASE, "1", "-n", release)
    assert maxima(kube_api) == {"bronze": "20M", "silver": "40M"}

    # a class dropped from the values is deleted by the next upgrade
    dropped = tmp_path / "dropped.yaml"
    dropped.write_text(yaml.safe_dump({"classes": CLASSES[:1], "budget": {**BUDGET, "spec": {**BUDGET["spec"], "teams": [
        {**BUDGET["spec"]["teams"][0], "allowedClasses": ["bronze"]}]}}}))
    helm(kube_api, "upgrade", RELEASE, str(CHART), "-n", release, "-f", str(dropped))
    assert maxima(kube_api) == {"bronze": "20M"}


def resource_versions(kube_api, namespace: str) -> dict[str, str]:
    """kind/name -> resourceVersion of the policy objects and the release's objects in its namespace."""
    out = {}
    for what, args in (("policy", ("egressclasses,egressbudgets",)),
                       ("release", ("deployments,daemonsets,configmaps,serviceaccounts,services", "-n", namespace))):
        items = json.loads(kube_api.kubectl("get", *args, "-o", "json").stdout)["items"]
        out.update({f"{o['kind']}/{o['metadata']['name']}": o["metadata"]["resourceVersion"] for o in items})
    return out


# policy values the API server would refuse, each refused by the chart at render: (values, words of the message)
REFUSED_AT_RENDER = [
    ({"classes": [CLASSES[0], {"name": "silver", "spec": {"weight": 2, "max": "10Mbit"}}]},
     ['classes[1] (silver).spec.max="10Mbit" is refused', "write 10M, not 10Mbit"]),
    ({"classes": [CLASSES[0], {"name": "silver", "spec": {"weight": 2, "min": "50M", "max": "40M"}}]},
     ["classes[1] (silver).spec.min=50M is refused: above", "e.g. min: 5M with max: 20M"]),
    ({"classes": [CLASSES[0], {"name": "silver", "spec": {"weight": 0, "max": "40M"}}]},
     ["/classes/1/spec/weight", "minimum", "e.g. weight: 1"]),
    ({"classes": [CLASSES[0], {"name": "silver", "spec": {"weight": 2, "ingres": {"max": "40M"}}}]},
     ["at '/classes/1/spec/ingres'", "no such key in classes[].spec: expected one of weight, min, max, ingress"]),
    ({"budget": {**BUDGET, "spec": {**BUDGET["spec"], "total": "0"}}},
     ['budget.spec.total="0" is refused: it is zero']),
    ({"budget": {**BUDGET, "spec": {**BUDGET["spec"], "teams": [{**BUDGET["spec"]["teams"][0], "defaultClass": "gold"}]}}},
     ['budget.spec.teams[0] (lab).defaultClass="gold" is refused', "allowedClasses"]),
]


def test_an_upgrade_with_a_policy_value_the_api_server_would_refuse_fails_before_applying_anything(
        kube_api, release, tmp_path):
    """Every refusal of the CRDs (their schema and CEL rules) is checked by the chart at render
    (values.schema.json from hack/chart_policy_schema.py, templates/validate-rates.yaml): the upgrade
    fails with the value's path, what is expected and an example, and nothing changes (every object's
    resourceVersion, the release's revision and status), without --rollback-on-failure."""
    install(kube_api, tmp_path, release)
    before = resource_versions(kube_api, release)
    for bad, words in REFUSED_AT_RENDER:
        upgrade = values(tmp_path, controller={"logLevel": "debug"})  # and a valid change beside it
        upgrade.write_text(yaml.safe_dump({**yaml.safe_load(upgrade.read_text()), **bad}))
        result = helm(kube_api, "upgrade", RELEASE, str(CHART), "-n", release, "-f", str(upgrade), check=False)
        assert result.returncode != 0, bad
        for word in words:
            assert word in result.stderr, result.stderr[-2000:]
        assert "is invalid" not in result.stderr  # not the API server's refusal: nothing was sent
    assert resource_versions(kube_api, release) == before
    status = json.loads(helm(kube_api, "status", RELEASE, "-n", release, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed" and status["version"] == 1


VAP = """
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata: {name: netagent-test-fixed-silver}
spec:
  failurePolicy: Fail
  matchConstraints:
    resourceRules:
    - {apiGroups: [netagent.io], apiVersions: [v1alpha1], operations: [UPDATE], resources: [egressclasses]}
  validations:
  - expression: "object.metadata.name != 'silver' || object.spec.max == oldObject.spec.max"
    message: "the platform team fixed silver's cap"
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata: {name: netagent-test-fixed-silver}
spec: {policyName: netagent-test-fixed-silver, validationActions: [Deny]}
"""


def test_an_upgrade_the_cluster_refuses_fails_and_rolls_back_whole(kube_api, release, tmp_path):
    """A refusal the chart cannot foresee (here the cluster's own admission policy, a
    ValidatingAdmissionPolicy, as Kyverno or Gatekeeper would): the upgrade fails with the API
    server's message; with `--rollback-on-failure`, as documented, nothing of it stays. Without it
    Helm leaves what it applied before the refusal: the test shows that too, so the docs can say why
    the flag."""
    install(kube_api, tmp_path, release)
    before_args = controller_args(kube_api, release)
    kube_api.kubectl("apply", "-f", "-", input=VAP)
    try:
        refusal = "the platform team fixed silver's cap"

        def denies() -> bool:  # the policy is in force once the API server's admission sees it
            patch = kube_api.kubectl("patch", "egressclass", "silver", "--type=merge", "--dry-run=server",
                                     "-p", '{"spec": {"max": "41M"}}', check=False)
            return patch.returncode != 0 and refusal in patch.stderr
        wait_for(denies, timeout=30, what="the admission policy in force")
        bad = values(tmp_path, controller={"logLevel": "debug"})
        bad.write_text(yaml.safe_dump({**yaml.safe_load(bad.read_text()), "classes": [
            {"name": "bronze", "spec": {"weight": 1, "max": "25M"}},
            {"name": "silver", "spec": {"weight": 2, "max": "10M"}}]}))

        # as documented: --rollback-on-failure; the API server's message, and every object as before
        result = helm(kube_api, "upgrade", RELEASE, str(CHART), "-n", release, "-f", str(bad),
                      *ROLLBACK_ON_FAILURE, check=False)
        assert result.returncode != 0
        assert refusal in result.stderr, result.stderr[-2000:]
        assert maxima(kube_api) == {"bronze": "20M", "silver": "40M"}
        assert controller_args(kube_api, release) == before_args

        # without the flag Helm stops at the refusal and keeps what it had applied before it (the
        # release says failed): why the docs give the flag with every upgrade
        result = helm(kube_api, "upgrade", RELEASE, str(CHART), "-n", release, "-f", str(bad), check=False)
        assert result.returncode != 0 and refusal in result.stderr, result.stderr[-2000:]
        assert maxima(kube_api) == {"bronze": "25M", "silver": "40M"}
        assert "--log-level=debug" in controller_args(kube_api, release)
        status = json.loads(helm(kube_api, "status", RELEASE, "-n", release, "-o", "json").stdout)
        assert status["info"]["status"] == "failed"
    finally:
        kube_api.kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy",
                         "netagent-test-fixed-silver", "--ignore-not-found", check=False)


# policy values at the edges of what the chart accepts (bounds, zero guarantees, min equal to max, every
# rate form, dotted class names, every selector operator): the CRDs must accept them too, or the chart's
# render-time checks would pass an upgrade that the API server then refuses halfway
ACCEPTED_AT_THE_EDGES = {
    "classes": [
        {"name": "bronze", "spec": {"weight": 1, "min": "0", "max": "1"}},
        {"name": "gold.v2", "spec": {"weight": 1000000, "min": "10Mi", "max": "10Mi",
                                     "ingress": {"weight": 1, "min": "0.5M", "max": "2e7"}}},
        {"name": "free", "spec": {"weight": 3}},
    ],
    "budget": {"name": "default", "spec": {
        "total": "8Pi", "ingressTotal": "+1.5G", "defaultTeam": "lab",
        "teams": [
            {"name": "lab", "namespaces": ["lab", "lab-2"], "defaultClass": "gold.v2",
             "allowedClasses": ["bronze", "gold.v2"], "weight": 1000000, "min": "0", "max": "1e15",
             "ingress": {"min": "1k", "max": "1k"}},
            {"name": "research", "namespaceSelector": {"matchLabels": {"team": "research"}, "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["gpu"]},
                {"key": "legacy", "operator": "DoesNotExist"}]}},
        ]}},
}


def test_policy_values_the_chart_accepts_the_api_server_accepts(kube_api, release, tmp_path):
    """Parity the other way from the refusals above, sampled: a real install of values at the edges
    the chart accepts creates every object (the API server's schema and CEL rules accept them)."""
    path = tmp_path / "edges.json"
    path.write_text(json.dumps(ACCEPTED_AT_THE_EDGES))  # JSON: "1e15" and "0" stay strings
    helm(kube_api, "install", RELEASE, str(CHART), "-n", release, "-f", str(path))
    assert maxima(kube_api) == {"bronze": "1", "gold.v2": "10Mi", "free": None}
    budget = json.loads(kube_api.kubectl("get", "egressbudget", "default", "-o", "json").stdout)
    given = ACCEPTED_AT_THE_EDGES["budget"]["spec"]
    assert {k: budget["spec"][k] for k in ("total", "ingressTotal", "defaultTeam")} == \
        {k: given[k] for k in ("total", "ingressTotal", "defaultTeam")}
    assert [t["name"] for t in budget["spec"]["teams"]] == ["lab", "research"]  # (the CRDs add defaults)


def test_the_chart_schema_for_policy_values_is_the_crds(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "hack" / "chart_policy_schema.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- from the chart with CRDs as templates ------------------------------------------------------


def previous_chart(tmp_path: Path) -> Path:
    """The chart as of PREVIOUS_CHART_COMMIT (its dashboard files are links into dashboards/)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", PREVIOUS_CHART_COMMIT, "charts/netagent",
                              "dashboards"], capture_output=True, check=True).stdout
    target = tmp_path / "previous"
    archive_path = tmp_path / "previous.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(target, filter="tar")
    return target / "charts" / "netagent"


def test_upgrade_from_the_chart_with_crds_as_templates(kube_api, release, tmp_path):
    old = previous_chart(tmp_path)
    assert (old / "templates" / "crd-egressclasses.yaml").is_file() and not (old / "crds").exists()
    # crds.keep=false: the worst case, the old release would delete its CRDs when they leave it
    install(kube_api, tmp_path, release, old, "--set", "crds.keep=false")
    hooked = classes(kube_api)["bronze"]["metadata"]
    assert "meta.helm.sh/release-name" not in hooked.get("annotations", {}), hooked  # made by the hook
    # the new grammar (docs/crds.md "Rates": negative exponents): the old CRDs refuse it
    new_values = tmp_path / "new.yaml"
    # (JSON, so the string stays a string: unquoted, Helm's YAML would read a float)
    new_values.write_text(json.dumps({"classes": [{"name": "bronze", "spec": {"weight": 1, "max": "200000000e-1"}},
                                                  CLASSES[1]], "budget": BUDGET}))
    upgrade = ("upgrade", RELEASE, str(CHART), "-n", release, "-f", str(new_values))
    probe = json.dumps({"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": "probe"},
                        "spec": {"weight": 1, "max": "200000000e-1"}})

    def crd_accepts_new_grammar() -> bool:
        verdict = kube_api.kubectl("create", "--dry-run=server", "-f", "-", input=probe, check=False)
        assert verdict.returncode == 0 or "spec.max" in verdict.stderr, verdict.stderr
        return verdict.returncode == 0

    assert not crd_accepts_new_grammar()

    # 1. the CRDs in the cluster are older than crds/: refused, naming the command
    result = helm(kube_api, *upgrade, check=False)
    assert result.returncode != 0
    assert ("the CustomResourceDefinition egressclasses.netagent.io in the cluster is revision 1 and this chart "
            f"needs revision {max(CRD_REVISIONS)}") in result.stderr, result.stderr[-2000:]
    assert "helm show crds <this chart> | kubectl apply --server-side --force-conflicts -f -" in result.stderr
    assert maxima(kube_api) == {"bronze": "20M", "silver": "40M"}

    crds = helm(kube_api, "show", "crds", str(CHART)).stdout
    kube_api.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=crds)
    for name in CRDS:
        crd = json.loads(kube_api.kubectl("get", "crd", name, "-o", "json").stdout)
        assert crd["metadata"]["labels"]["netagent.io/crd-revision"] == str(max(CRD_REVISIONS))
    assert crd_accepts_new_grammar()

    # 2. the old release owns the CRDs without keep: the upgrade would delete them, refused
    result = helm(kube_api, *upgrade, check=False)
    assert result.returncode != 0
    assert ("the CustomResourceDefinition egressclasses.netagent.io belongs to release egress"
            in result.stderr), result.stderr[-2000:]
    assert "kubectl annotate crd egressclasses.netagent.io helm.sh/resource-policy=keep" in result.stderr
    for name in CRDS:
        kube_api.kubectl("annotate", "crd", name, "helm.sh/resource-policy=keep")

    # 3. Helm adopts no object it did not record (the hook's): refused until --take-ownership
    result = helm(kube_api, *upgrade, check=False)
    assert result.returncode != 0
    assert "invalid ownership metadata" in result.stderr and '"meta.helm.sh/release-name"' in result.stderr, \
        result.stderr[-2000:]
    assert maxima(kube_api) == {"bronze": "20M", "silver": "40M"}

    helm(kube_api, *upgrade, "--take-ownership")
    found = classes(kube_api)
    assert {n: o["spec"]["max"] for n, o in found.items()} == {"bronze": "200000000e-1", "silver": "40M"}
    for o in found.values():
        assert o["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE
    for name in CRDS:  # kept, though no longer in the release
        kube_api.kubectl("get", "crd", name)
    assert "CustomResourceDefinition" not in helm(kube_api, "get", "manifest", RELEASE, "-n", release).stdout

    # now the policy follows upgrades
    helm(kube_api, "upgrade", RELEASE, str(CHART), "-n", release, "--reuse-values",
         "--set", "classes[0].name=bronze,classes[0].spec.weight=1,classes[0].spec.max=25M")
    assert maxima(kube_api)["bronze"] == "25M"


# --- rendering (Argo CD, Flux) ------------------------------------------------------------------


def render(*args: str) -> list[dict]:
    binary = require_node_assets(["helm"]) / "helm"
    out = subprocess.run([str(binary), "template", RELEASE, str(CHART), "-n", "egress-system", *args],
                         capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_template_renders_the_policy_without_hooks_and_the_crds_on_request(tmp_path):
    docs = render("-f", str(values(tmp_path)))
    policy = [d for d in docs if d["kind"] in ("EgressClass", "EgressBudget")]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in policy) == [
        ("EgressBudget", "default"), ("EgressClass", "bronze"), ("EgressClass", "silver")]
    assert not [d for d in docs if "helm.sh/hook" in d["metadata"].get("annotations", {})]
    assert not [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    crds = [d for d in render("--include-crds") if d["kind"] == "CustomResourceDefinition"]
    assert sorted(d["metadata"]["name"] for d in crds) == sorted(CRDS)
    # user-managed policy
    off = render("-f", str(values(tmp_path)), "--set", "policy.create=false")
    assert not [d for d in off if d["kind"] in ("EgressClass", "EgressBudget")]


def spec_hash(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc["spec"], sort_keys=True).encode()).hexdigest()


def test_crd_revision_is_raised_with_every_change():
    for path in sorted((CHART / "crds").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        name, revision = doc["metadata"]["name"], int(doc["metadata"]["labels"]["netagent.io/crd-revision"])
        assert path.name == f"{name}.yaml"
        assert revision == max(CRD_REVISIONS), f"{path.name}: revision {revision}, the newest known is {max(CRD_REVISIONS)}"
        assert spec_hash(doc) == CRD_REVISIONS[revision][name], (
            f"{path.name} changed without a new netagent.io/crd-revision: raise it (and add its hash, "
            f"{spec_hash(doc)}, to CRD_REVISIONS) so an upgrade over the old CRDs is refused")
