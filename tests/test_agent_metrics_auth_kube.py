"""Who may read /metrics (issue 33 item 5): the real agent in a lab node's namespace and a real
kube-apiserver with RBAC. The agent listens on 0.0.0.0 of its node (as the chart's hostNetwork
agent does, where every pod of the node reaches it) with the shipped RBAC: its ClusterRole and
deploy/base/rbac-metrics.yaml (the reviews' create verbs; the /metrics reader bound to the
Prometheus ServiceAccount kube-prometheus-stack names, made here in the test's namespace).

Scrapes go over HTTPS without verification (the agent's certificate is self-signed, as
kubelet's; the chart's monitors say insecureSkipVerify) from inside the node's namespace.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from lab.agentproc import AgentProcess, NetnsPortForward, wait_for
from lab.nsexec import http_get
from lab.netns import require_root
from lab.topology import Lab
from tests.kube import REPO, deployed_rbac, sa_token, write_kubeconfig
from tests.test_agent_kube import agent_rbac_token, delete_rbac, install_crds
from tests.test_controller_kube import _unverified, controller
from tests.test_dashboards import tool
from tests.test_install import pod_role_targets, scrape_configs

pytestmark = [pytest.mark.root]

PROMETHEUS_SA = "kube-prometheus-stack-prometheus"  # the chart's default metrics.auth.prometheusServiceAccount


@pytest.fixture(scope="module")
def lab():
    require_root()
    with Lab(nodes=1, pods_per_node=1) as lab:
        yield lab


def scrape(agent: AgentProcess, path: str, token: str | None = None) -> tuple[int, bytes]:
    """GET https://127.0.0.1:<port><path> from inside the agent's node namespace."""
    def get() -> tuple[int, bytes]:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        req = urllib.request.Request(f"https://127.0.0.1:{agent.port}{path}",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(req, timeout=15, context=context) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except OSError as exc:
            return 0, str(exc).encode()
    return agent.worker.call(get)


def sample(body: bytes, name: str, labels: str = "") -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith(name) and line[len(name)] in "{ " and labels in line)


@contextlib.contextmanager
def secured_agent(kube_api, namespace: str, lab, tmp_path: Path, port: int):
    """The agent with the agent's RBAC and deploy/'s metrics RBAC, on 0.0.0.0 (--metrics-auth left
    at its default); after, its log printed and everything it and the test made gone."""
    node = lab.nodes[0]
    rbac = client.RbacAuthorizationV1Api(kube_api.admin)
    metrics_rbac = [d for d in deployed_rbac("rbac-metrics.yaml", namespace)
                    if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    forward = NetnsPortForward(node.netns, ("127.0.0.1", int(kube_api.url.rsplit(":", 1)[1])))
    agent = None
    try:
        for d in metrics_rbac:
            (rbac.create_cluster_role if d["kind"] == "ClusterRole" else rbac.create_cluster_role_binding)(d)
        token = agent_rbac_token(kube_api, namespace)
        kubeconfig = write_kubeconfig(tmp_path / "agent.kubeconfig", f"https://127.0.0.1:{forward.port}",
                                      kube_api.ca_file, {"token": token})
        agent = AgentProcess(lab, node, [], port=port, log_dir=tmp_path, node_name=f"{namespace}-node0",
                             extra=["--kubeconfig", str(kubeconfig), "--listen", f"0.0.0.0:{port}"])
        yield agent
    finally:
        if agent:
            print(agent.log())
            agent.close()
        forward.close()
        delete_rbac(kube_api, namespace)
        for d in reversed(metrics_rbac):
            try:
                (rbac.delete_cluster_role if d["kind"] == "ClusterRole" else rbac.delete_cluster_role_binding)(
                    d["metadata"]["name"])
            except client.ApiException:
                pass


def test_metrics_need_a_token_with_the_grant_health_stays_open(kube_api, kube_namespace, lab, tmp_path):
    ns = kube_namespace
    core = client.CoreV1Api(kube_api.admin)
    granted = sa_token(core, ns, PROMETHEUS_SA)
    lacking = sa_token(core, ns, "some-tenant")
    with secured_agent(kube_api, ns, lab, tmp_path, 9583) as agent:
        agent.start()
        def ready() -> bool:
            if not agent.alive():
                raise AssertionError(f"the agent exited; log:\n{agent.log()}")
            return scrape(agent, "/readyz")[0] == 200
        wait_for(ready, 60, 0.2, "the agent ready over HTTPS")
        assert scrape(agent, "/healthz")[0] == 200  # the kubelet's probes need no token

        code, body = scrape(agent, "/metrics")
        assert code == 401 and b"missing bearer token" in body, (code, body)
        code, body = scrape(agent, "/metrics", "not-a-jwt")
        assert code == 401 and b"malformed" in body, (code, body)
        code, body = scrape(agent, "/metrics", lacking)
        assert code == 403, (code, body)
        assert f"system:serviceaccount:{ns}:some-tenant may not get /metrics".encode() in body, body
        assert b"netagent_pod" not in body  # nothing of the node's pods in a refusal

        code, body = scrape(agent, "/metrics", granted)
        assert code == 200, (code, body)
        assert sample(body, "netagent_metrics_auth_refusals_total", 'reason="forbidden"') == 1
        assert sample(body, "netagent_metrics_auth_refusals_total", 'reason="missing_token"') == 1
        assert sample(body, "netagent_metrics_auth_refusals_total", 'reason="malformed_token"') == 1
        # two tokens reviewed (the lacking and the granted), each once; access reviewed for both
        assert sample(body, "netagent_metrics_auth_reviews_total", 'kind="token"') == 2
        assert sample(body, "netagent_metrics_auth_reviews_total", 'kind="access"') == 2
        assert sample(body, "netagent_metrics_auth_cache_entries") == 2

        # the refused token again: refused from the cache, no review; the grant still served from it
        assert scrape(agent, "/metrics", lacking)[0] == 403
        code, body = scrape(agent, "/metrics", granted)
        assert code == 200
        assert sample(body, "netagent_metrics_auth_reviews_total", 'kind="token"') == 2
        assert sample(body, "netagent_metrics_auth_refusals_total", 'reason="forbidden"') == 2
        assert agent.alive()

        # plain HTTP on the metrics port: no answer at all (the token would travel in the clear)
        status = agent.worker.call(_plain_get, agent.port)
        assert status == 0, status


def _plain_get(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_the_controllers_metrics_likewise(kube_api, kube_namespace, tmp_path):
    """The controller in cluster mode over TLS (its metrics auth on by default there), its /metrics on
    the agent API's port: 401 without a token, 403 without the grant, 200 with it; health open."""
    ns = kube_namespace
    core = client.CoreV1Api(kube_api.admin)
    rbac = client.RbacAuthorizationV1Api(kube_api.admin)
    reader = [d for d in deployed_rbac("rbac-metrics.yaml", ns) if d["metadata"]["name"].startswith(
        "netagent-metrics-reader")]
    granted = sa_token(core, ns, PROMETHEUS_SA)
    lacking = sa_token(core, ns, "some-tenant")
    install_crds(kube_api)  # the controller's caches sync on them
    try:
        for d in reader:
            (rbac.create_cluster_role if d["kind"] == "ClusterRole" else rbac.create_cluster_role_binding)(d)
        with controller(kube_api, tmp_path, ns, "--agent-service-account", f"{ns}:netagent-agent",
                        "--metrics-auth", "auto", tls=True) as (_, base, _):
            def get(path: str, token: str | None = None) -> tuple[int, bytes]:
                req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"} if token else {})
                try:
                    with urllib.request.urlopen(req, timeout=10, context=_unverified()) as r:
                        return r.status, r.read()
                except urllib.error.HTTPError as exc:
                    return exc.code, exc.read()

            assert get("/healthz")[0] == 200 and get("/readyz")[0] == 200
            assert get("/metrics")[0] == 401
            code, body = get("/metrics", lacking)
            assert code == 403 and b"some-tenant may not get /metrics" in body, (code, body)
            code, body = get("/metrics", granted)
            assert code == 200, (code, body)
            assert sample(body, "netagent_controller_metrics_auth_refusals_total", 'reason="forbidden"') == 1
            assert sample(body, "netagent_controller_metrics_auth_refusals_total", 'reason="missing_token"') == 1
            assert sample(body, "netagent_controller_metrics_auth_reviews_total", 'kind="access"') == 2
            assert b"netagent_controller_is_leader" in body
    finally:
        for d in reversed(reader):
            try:
                (rbac.delete_cluster_role if d["kind"] == "ClusterRole" else rbac.delete_cluster_role_binding)(
                    d["metadata"]["name"])
            except client.ApiException:
                pass


def test_a_real_prometheus_scrapes_through_the_charts_podmonitor(kube_api, kube_namespace, lab, tmp_path):
    """Debian's Prometheus, configured from deploy/'s agent PodMonitor as the operator would configure
    it (tests/test_install.py's translation: HTTPS, insecureSkipVerify, the scraper token from its
    Secret, here the granted ServiceAccount's token), scrapes the secured agent: up 1 and the pods'
    series; the same job without the token: up 0 (401), counted by the agent."""
    ns, node = kube_namespace, lab.nodes[0]
    core = client.CoreV1Api(kube_api.admin)
    granted = sa_token(core, ns, PROMETHEUS_SA)
    docs = [d for d in yaml.safe_load_all((REPO / "deploy/overlays/prometheus-operator/monitoring.yaml").read_text())
            if d]
    monitor = next(d for d in docs if d["kind"] == "PodMonitor" and d["metadata"]["name"] == "netagent-agent")
    daemonset = next(d for d in yaml.safe_load_all((REPO / "deploy/base/agent.yaml").read_text())
                     if d and d["kind"] == "DaemonSet")
    template = daemonset["spec"]["template"]
    with secured_agent(kube_api, ns, lab, tmp_path, 9584) as agent:
        container = template["spec"]["containers"][0]
        pod = client.V1Pod(  # what pod discovery sees of the agent's pod: its labels and port, here
            metadata=client.V1ObjectMeta(namespace=monitor["metadata"]["namespace"], name="netagent-agent-x",
                                         labels=template["metadata"]["labels"]),
            spec=client.V1PodSpec(node_name=f"{ns}-node0", containers=[client.V1Container(
                name=container["name"], ports=[client.V1ContainerPort(container_port=agent.port,
                                                                      name=container["ports"][0]["name"])])]),
            status=client.V1PodStatus(phase="Running", pod_ip="127.0.0.1"))

        def secret_file(namespace: str, name: str, key: str) -> Path:
            assert (name, key) == ("netagent-metrics-scraper", "token")  # the chart's scraper Secret
            path = tmp_path / "scraper-token"
            path.write_text(granted)
            return path

        def discovery(namespace: str) -> dict:
            path = tmp_path / "pods.json"
            path.write_text(json.dumps(pod_role_targets([pod])))
            return {"file_sd_configs": [{"files": [str(path)]}]}

        config, = scrape_configs([monitor], discovery, secret_file)
        assert config["scheme"] == "https" and config["tls_config"] == {"insecure_skip_verify": True}
        config["scrape_interval"] = "1s"
        tokenless = {**{k: v for k, v in config.items() if k != "authorization"}, "job_name": "tokenless",
                     "relabel_configs": [*config["relabel_configs"], {"target_label": "job", "replacement": "tokenless"}]}
        prom_port = 9590
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({"scrape_configs": [config, tokenless]}))
        log = (tmp_path / "prometheus.log").open("w")
        prom = lab.spawn(node.netns, [tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=log, stderr=log)
        try:
            agent.start()

            def query(q: str) -> list:
                assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
                try:
                    code, body = agent.worker.call(
                        http_get, f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": q}))
                except OSError:  # Prometheus still starting
                    return []
                return json.loads(body)["data"]["result"] if code == 200 else []

            def up() -> dict | None:
                got = {r["metric"]["job"]: r["value"][1] for r in query("up")}
                return got if len(got) == 2 else None

            try:
                jobs = wait_for(lambda: (u := up()) and u.get("netagent-agent") == "1" and u, 90, 0.5,
                                "Prometheus scraping the agent with the scraper token")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; targets: {query('up')}; Prometheus' log:\n"
                                     f"{(tmp_path / 'prometheus.log').read_text()[-3000:]}") from None
            assert jobs["tokenless"] == "0", jobs
            assert wait_for(lambda: query('netagent_build_info{node="%s-node0"}' % ns), 30, 0.5, "the agent's series")
            code, body = scrape(agent, "/metrics", granted)
            assert code == 200 and sample(body, "netagent_metrics_auth_refusals_total", 'reason="missing_token"') >= 1
        finally:
            os.killpg(prom.pid, signal.SIGTERM)
            prom.wait(20)
            log.close()
