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


# --- readable refusals ------------------------------------------------------------------------------

SCHEMA = CHART / "values.schema.json"


def test_the_schema_keeps_no_pattern():
    """Helm prints a refused pattern as the bare regex and a failed allOf as "at '': 'allOf' failed":
    shapes are checked by templates/validate-values.yaml instead, whose message says what is expected."""
    import json

    from hack.chart_policy_schema import HINT

    def walk(node, path="$"):
        if isinstance(node, dict):
            if node.get("$comment") == HINT:  # the example beside a leaf (hack/chart_policy_schema.py)
                assert set(node) == {"$comment", "const", "not"} and node["not"] == {"const": node["const"]}, path
                return
            if "anyOf" in node:
                assert len(node["anyOf"]) == 2 and node["anyOf"][1].get("$comment") == HINT, path
            for key in ("pattern", "propertyNames", "allOf", "oneOf", "if", "not"):
                assert key not in node, f"{path} has {key!r}: add a row to templates/validate-values.yaml instead"
            for key, sub in node.items():
                yield from walk(sub, f"{path}.{key}")
        elif isinstance(node, list):
            for i, sub in enumerate(node):
                yield from walk(sub, f"{path}[{i}]")
        yield path

    list(walk(json.loads(SCHEMA.read_text())))


# (values, the refused value as the message names it)
REFUSED = [
    ({"internalCIDRs": ["10.0.0.0"]}, 'internalCIDRs[0]="10.0.0.0"'),
    ({"podCIDRs": ["10.0.0.0/33"]}, 'podCIDRs[0]="10.0.0.0/33"'),
    ({"networkPolicy": {"agentCIDRs": ["nodes"]}}, 'networkPolicy.agentCIDRs[0]="nodes"'),
    ({"image": {"repository": "Netagent"}}, 'image.repository="Netagent"'),
    ({"image": {"digest": "md5:0123"}}, 'image.digest="md5:0123"'),
    ({"commonLabels": {"bad key": "x"}}, 'commonLabels key="bad key"'),
    ({"monitoring": {"labels": {"-release": "kps"}}}, 'monitoring.labels key="-release"'),
    ({"classes": [{"name": "Bronze!", "spec": {}}]}, 'classes[0].name="Bronze!"'),
    ({"uplinks": ["eth0/1"]}, 'uplinks[0]="eth0/1"'),
    ({"tls": {"certManager": {"duration": "90d"}}}, 'tls.certManager.duration="90d"'),
    ({"agent": {"resources": {"limits": {"memory": "256MB"}}}}, 'agent.resources.limits.memory="256MB"'),
    ({"controller": {"resources": {"requests": {"cpu": "lots"}}}}, 'controller.resources.requests.cpu="lots"'),
    ({"agent": {"extraArgs": ["-v"]}}, 'agent.extraArgs[0]="-v"'),
    ({"agent": {"maxUnavailable": "0%"}}, 'agent.maxUnavailable="0%"'),
    ({"agent": {"extraVolumeMounts": [{"name": "x", "mountPath": "etc"}]}}, 'agent.extraVolumeMounts[0].mountPath="etc"'),
    ({"controller": {"extraVolumes": [{"name": "Extra", "emptyDir": {}}]}}, 'controller.extraVolumes[0].name="Extra"'),
    ({"controller": {"podDisruptionBudget": {"minAvailable": "half"}}}, 'controller.podDisruptionBudget.minAvailable="half"'),
    ({"monitoring": {"interval": "15"}}, 'monitoring.interval="15"'),
    ({"monitoring": {"runbookBaseURL": "docs/alerts.md"}}, 'monitoring.runbookBaseURL="docs/alerts.md"'),
    ({"dashboards": {"namespace": "Monitoring"}}, 'dashboards.namespace="Monitoring"'),
]


@pytest.mark.parametrize("values,names", REFUSED, ids=[n.split("=")[0] for _, n in REFUSED])
def test_a_refused_value_is_named_with_what_was_expected_and_an_example(tmp_path, values, names):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(values))
    for command in (["template", "netagent"], ["install", "--dry-run=client", "netagent"]):
        result = helm(*command, str(CHART), "-f", str(path), check=False)
        assert result.returncode != 0, f"helm {command[0]} accepted {values}"
        message = result.stderr.split("execution error at", 1)[-1]
        assert f"{names} is refused: expected " in message and ", e.g. " in message, result.stderr[-800:]
        assert "allOf" not in result.stderr and "does not match pattern" not in result.stderr


def test_both_monitor_kinds_are_refused_by_name():
    result = helm("template", "netagent", str(CHART), "--set", "monitoring.podMonitor.enabled=true",
                  "--set", "monitoring.serviceMonitor.enabled=true", check=False)
    assert result.returncode != 0
    assert "monitoring.podMonitor.enabled and monitoring.serviceMonitor.enabled are both true: expected one of them" \
        in result.stderr and "e.g. monitoring.podMonitor.enabled=true" in result.stderr
    assert "allOf" not in result.stderr


@pytest.mark.parametrize("args,says", [
    # a range: the bound and an example
    (["--set", "agent.port=0"], ["at '/agent/port': minimum: got 0, want 1",
                                 "at '/agent/port': value must be 'an integer from 1 to 65535, e.g. port: "]),
    # a type: the type and an example (the default of values.yaml)
    (["--set", "controller.replicas=two"], ["at '/controller/replicas': got string, want integer",
                                            "value must be 'an integer from 1 to 7, e.g. replicas: 2'"]),
    (["--set", "agent.nodeSelector.gpu=1"], ["at '/agent/nodeSelector/gpu': got number, want string",
                                             "e.g. nodeSelector: {key: \"value\"}"]),
    # an enum: the allowed values are the examples (helm prints the enum's refusal alone)
    (["--set", "agent.logLevel=loud"], ["at '/agent/logLevel': value must be one of 'debug', 'info'"]),
    # an unknown key: named by its own path, with the known keys and an example
    (["--set", "agnet.port=9560"], ["at '/agnet': value must be 'no such key in the values: expected one of ",
                                    ", agent, ", "e.g. "]),
    (["--set", "agent.prot=9560"], ["at '/agent/prot': value must be 'no such key in agent: expected one of ",
                                    ", port, "]),
    (["--set", "classes[0].name=a,classes[0].spec.weight=x"],
     ["at '/classes/0/spec/weight': got string, want integer", "e.g. weight: 1'"]),
])
def test_what_the_schema_still_refuses_names_the_value_and_what_is_allowed(args, says):
    """Types, ranges, enums and unknown keys stay in the schema (helm lint refuses them too): helm's own
    message names the value's path and the allowed values or bound, and beneath it the example branch
    (hack/chart_policy_schema.py) what is expected with an example."""
    result = helm("template", "netagent", str(CHART), *args, check=False)
    assert result.returncode != 0, args
    for words in says:
        assert words in result.stderr, result.stderr[-800:]


def test_the_defaults_and_the_documented_examples_pass(tmp_path):
    path = tmp_path / "examples.yaml"
    path.write_text(yaml.safe_dump({
        "internalCIDRs": ["10.0.0.0/8", "fd00::/8"], "commonLabels": {"example.com/team": "net"},
        "agent": {"resources": {"limits": {"memory": "256Mi", "cpu": "100m"}}, "markBit": "0x1000",
                  "extraArgs": ["--log-level=debug"]},
        "tls": {"certManager": {"duration": "1h30m"}}, "monitoring": {"interval": "15s"}}))
    helm("template", "netagent", str(CHART), "-f", str(path))


# --- the chart's README ------------------------------------------------------------------------------


def test_chart_readme_is_generated_from_the_values():
    import subprocess
    import sys

    from tests.test_deploy import REPO

    result = subprocess.run([sys.executable, str(REPO / "hack" / "chart_readme.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"charts/netagent/README.md is stale: run python3 hack/chart_readme.py\n{result.stdout}"
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def leaves(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict) and value and all(isinstance(k, str) and "/" not in k for k in value):
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    # a leaf has its row, or sits in a map written inline (`requests: {cpu: 20m}`) whose row shows it
    missing = [path for path in leaves(values)
               if not any(f"| `{'.'.join(path.split('.')[:n])}` | `" in readme for n in range(1, path.count(".") + 2))]
    assert not missing, f"values without a row in the chart README: {missing}"


def test_helm_show_readme_prints_it():
    shown = helm("show", "readme", str(CHART)).stdout
    assert shown.strip() == (CHART / "README.md").read_text().strip()
    assert "| `monitoring.runbookBaseURL` |" in shown and "| `agent.extraVolumes` |" in shown


# --- docs/install.md's RBAC table ----------------------------------------------------------------------


def _words(cell: str) -> list[str]:
    return [w.strip().strip("`") for w in cell.replace("nonResourceURL", "").split(",") if w.strip()]


def documented_grants() -> set[tuple]:
    """(ServiceAccount, where, API group, resource, name, verb) for every row of "RBAC, exactly"."""
    from tests.test_deploy import REPO

    text = (REPO / "docs" / "install.md").read_text()
    table = text.split("### RBAC, exactly", 1)[1].split("| ServiceAccount |", 1)[1].split("\n\n", 1)[0]
    grants, accounts = set(), []
    for line in table.splitlines()[2:]:
        account, where, group, resources, names, verbs, _why = (c.strip() for c in line.strip().strip("|").split("|"))
        if account:
            accounts = [a if "/" in a else f"netagent-system/{a}" for a in _words(account)]
        group = "" if group in ("core", "") else group.strip("`")
        where = "" if where == "cluster" else where.strip("`")
        for a in accounts:
            for resource in _words(resources):
                for name in _words(names) or [""]:
                    for verb in _words(verbs):
                        grants.add((a, where, group, resource, name, verb))
    return grants


def rendered_grants(docs: list[dict]) -> set[tuple]:
    """The same tuples from the rendered Roles, ClusterRoles and their bindings."""
    roles = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    grants = set()
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        where = binding["metadata"]["namespace"] if binding["kind"] == "RoleBinding" else ""
        ref = binding["roleRef"]
        role = roles[(ref["kind"], where if ref["kind"] == "Role" else "", ref["name"])]
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount", subject
            account = f"{subject['namespace']}/{subject['name']}"
            for rule in role["rules"]:
                for verb in rule["verbs"]:
                    if "nonResourceURLs" in rule:
                        grants |= {(account, where, "", url, "", verb) for url in rule["nonResourceURLs"]}
                        continue
                    for group in rule["apiGroups"]:
                        for resource in rule["resources"]:
                            for name in rule.get("resourceNames") or [""]:
                                grants.add((account, where, group, resource, name, verb))
    return grants


def test_the_rbac_table_is_what_the_chart_grants():
    rendered = rendered_grants(helm_template())
    documented = documented_grants()
    assert len(documented) > 20
    assert rendered == documented, (f"granted, not in docs/install.md: {sorted(rendered - documented)}\n"
                                    f"in docs/install.md, not granted: {sorted(documented - rendered)}")


# --- day one with kube-prometheus-stack ------------------------------------------------------------------

OPERATOR = ["--api-versions", "monitoring.coreos.com/v1/PodMonitor",
            "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"]


def test_default_values_are_scraped_where_the_operator_is():
    """kube-prometheus-stack's defaults select monitors labelled release=<its release> and its Grafana
    sidecar takes ConfigMaps labelled grafana_dashboard=1: the chart's defaults give exactly that where
    the cluster serves PodMonitor (auto), and no monitor where it does not (the install would fail)."""
    docs = helm_template(*OPERATOR)
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"netagent-agent", "netagent-controller"}
    assert all(m["metadata"]["labels"]["release"] == "kube-prometheus-stack" for m in monitors)
    assert not [d for d in docs if d["kind"] in ("ServiceMonitor", "PrometheusRule")]  # the dashboards need no rule
    dashboards = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("netagent-dashboard")]
    assert len(dashboards) == 3 and all(d["metadata"]["labels"]["grafana_dashboard"] == "1" for d in dashboards)
    assert not [d for d in helm_template() if d["kind"] in ("PodMonitor", "ServiceMonitor")]
    services = helm_template(*OPERATOR, "--set", "monitoring.serviceMonitor.enabled=true")
    assert {d["kind"] for d in services if "Monitor" in d["kind"]} == {"ServiceMonitor"}
    off = helm_template(*OPERATOR, "--set", "monitoring.podMonitor.enabled=false")
    assert not [d for d in off if d["kind"] == "PodMonitor"]
