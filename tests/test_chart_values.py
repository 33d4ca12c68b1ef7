"""Chart ergonomics (docs/install.md "Values"): the knobs platform teams expect of a Cilium- or
Antrea-style chart, rendered by the real `helm` and accepted by the real kube-apiserver.

- affinity, extraEnv, extraVolumes/extraVolumeMounts, serviceAccount annotations, PodDisruptionBudget
  and probe timings, for the agent and the controller, land where they belong (the agent's affinity
  on the cleanup DaemonSet too), and a server-side dry run accepts every object they change;
- a PodDisruptionBudget with both or neither of minAvailable/maxUnavailable is refused naming the value.
"""
from __future__ import annotations

import pytest
import yaml

from tests.test_deploy import CHART, find, helm, helm_template, pod_spec

AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "example.com/egress", "operator": "In", "values": ["true"]}]}]}}}
ENV = [{"name": "EXAMPLE_FLAG", "value": "1"}]
VOLUME = [{"name": "extra-config", "configMap": {"name": "netagent-extra", "optional": True}}]
MOUNT = [{"name": "extra-config", "mountPath": "/etc/netagent/extra", "readOnly": True}]
SA_ANNOTATIONS = {"example.com/role": "netagent"}
LIVENESS = {"initialDelaySeconds": 30, "periodSeconds": 20, "timeoutSeconds": 5, "failureThreshold": 3}
READINESS = {"periodSeconds": 7, "timeoutSeconds": 2, "failureThreshold": 2}
KNOBS = {"affinity": AFFINITY, "extraEnv": ENV, "extraVolumes": VOLUME, "extraVolumeMounts": MOUNT,
         "serviceAccount": {"annotations": SA_ANNOTATIONS}, "livenessProbe": LIVENESS, "readinessProbe": READINESS}


def knob_values(tmp_path) -> str:
    path = tmp_path / "knobs.yaml"
    path.write_text(yaml.safe_dump({
        "agent": {**KNOBS, "podDisruptionBudget": {"enabled": True, "maxUnavailable": "20%"}},
        "controller": {**KNOBS, "podDisruptionBudget": {"enabled": True, "minAvailable": None, "maxUnavailable": 1}},
    }))
    return str(path)


def test_defaults_keep_the_probes_and_the_controllers_budget():
    docs = helm_template()
    for kind, name, liveness, readiness in (("DaemonSet", "netagent-agent", "/healthz", "/readyz"),
                                            ("Deployment", "netagent-controller", "/healthz", "/readyz")):
        container, = pod_spec(docs, kind, name)["containers"]
        assert container["livenessProbe"]["httpGet"]["path"] == liveness
        assert container["livenessProbe"]["failureThreshold"] == 6
        assert container["readinessProbe"]["httpGet"]["path"] == readiness
        assert container["readinessProbe"]["periodSeconds"] == 5
    assert "affinity" not in pod_spec(docs, "DaemonSet", "netagent-agent")
    assert "podAntiAffinity" in pod_spec(docs, "Deployment", "netagent-controller")["affinity"]
    assert find(docs, "PodDisruptionBudget", "netagent-controller")["spec"]["minAvailable"] == 1
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == "netagent-agent"]


def test_knobs_land_on_agent_and_controller(tmp_path):
    docs = helm_template("-f", knob_values(tmp_path))
    for kind, name in (("DaemonSet", "netagent-agent"), ("Deployment", "netagent-controller")):
        spec = pod_spec(docs, kind, name)
        assert spec["affinity"] == AFFINITY, kind  # the controller's default anti-affinity is replaced
        container, = spec["containers"]
        assert container["env"][-1] == ENV[0]
        assert container["volumeMounts"][-1] == MOUNT[0]
        assert spec["volumes"][-1] == VOLUME[0]
        assert {k: container["livenessProbe"][k] for k in LIVENESS} == LIVENESS
        assert {k: container["readinessProbe"][k] for k in READINESS} == READINESS
        assert "httpGet" in container["livenessProbe"] and "httpGet" in container["readinessProbe"]
        assert find(docs, "ServiceAccount", name)["metadata"]["annotations"] == SA_ANNOTATIONS
    assert find(docs, "PodDisruptionBudget", "netagent-agent")["spec"]["maxUnavailable"] == "20%"
    controller_pdb = find(docs, "PodDisruptionBudget", "netagent-controller")["spec"]
    assert controller_pdb["maxUnavailable"] == 1 and "minAvailable" not in controller_pdb
    cleanup = helm_template("-f", knob_values(tmp_path), "--set", "cleanup=true")
    assert pod_spec(cleanup, "DaemonSet", "netagent-cleanup")["affinity"] == AFFINITY


@pytest.mark.parametrize("pdb,says", [
    ({"enabled": True, "minAvailable": 1, "maxUnavailable": 1}, "minAvailable=1 and maxUnavailable=1 are both set"),
    ({"enabled": True, "minAvailable": None, "maxUnavailable": None}, "neither minAvailable nor maxUnavailable"),
])
def test_a_budget_needs_exactly_one_bound(tmp_path, pdb, says):
    path = tmp_path / "pdb.yaml"
    path.write_text(yaml.safe_dump({"controller": {"podDisruptionBudget": pdb}}))
    result = helm("template", "netagent", str(CHART), "-f", str(path), check=False)
    assert result.returncode != 0
    assert f"controller.podDisruptionBudget: {says}" in result.stderr, result.stderr[-600:]
    assert "e.g. {maxUnavailable: 1}" in result.stderr


def test_kube_apiserver_accepts_the_knobs(kube_api, kube_namespace, tmp_path):
    """Server-side dry run of everything the knobs change: the API server's own validation of the
    affinity, env, volumes, probes and budgets as rendered."""
    out = helm("template", "netagent", str(CHART), "--namespace", kube_namespace, "-f", knob_values(tmp_path),
               "--show-only", "templates/agent.yaml", "--show-only", "templates/controller.yaml").stdout
    result = kube_api.kubectl("apply", "--dry-run=server", "-f", "-", input=out, check=False)
    assert result.returncode == 0, result.stderr
    for made in ("daemonset.apps/netagent-agent", "deployment.apps/netagent-controller",
                 "poddisruptionbudget.policy/netagent-agent", "poddisruptionbudget.policy/netagent-controller"):
        assert f"{made} created (server dry run)" in result.stdout, result.stdout
