"""The install users do, end to end on the real node (tests/node/): the image built with
hack/image/build.sh and imported into the node's containerd, `helm install` of charts/netagent as
release `egress` into `egress-system` (names not the chart's), pods started by the kubelet through
the CNI with iperf3 in their image and shaped by the agent running in its container, a real
Prometheus scraping through the chart's PodMonitors, `kubectl annotate` to another class, `helm
upgrade` with a changed class (in the API server when helm returns, applied by the agent),
`helm rollback` (the class back), an upgrade the API server refuses (its message, nothing of it
left), the CRDs applied as documented and `helm upgrade` to a new image tag with no unshaped
moment, `helm uninstall` with the documented cleanup leaving nothing behind.

The lab around the node (all removed afterwards, also on failure):
- the "internet": a network namespace holding 203.0.113.1 (and an internal peer, 10.212.0.1),
  reached from the node through the veth `natinet0`, the agents' uplink (`uplinks`);
- Services without kube-proxy: the node has no kube-proxy and no cluster DNS, so the test plays
  kube-proxy's old userspace mode: the Services' ClusterIPs (the `kubernetes` Service and the
  controller's, fixed with `controller.service.clusterIP`) are local addresses of a veth, and a
  small TCP relay forwards each to the apiserver or to a ready controller pod. Agents use the
  ClusterIP in `controller.url` for want of DNS.

TLS as the chart's defaults have it: the controller makes its Secret at first start and serves
HTTPS; agents pin its ca.crt and verify the Service's name, which they resolve to the fixed ClusterIP
through the hostAliases the chart gives them with `controller.service.clusterIP` (the relay passes
the TLS stream through untouched).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from lab.netns import require_root, run
from lab.procs import stop_process, wait_for
from tc.model import ack_minor, bulk_minor
from tests.kube import REPO, KubeAssetsMissing, free_port, required
from tests.test_chart_upgrade import CRD_REVISIONS
from tests.node import busybox_image, node_assets_dir, require_image_builder, require_node_assets

pytestmark = [pytest.mark.kube, pytest.mark.cluster, pytest.mark.root, pytest.mark.traffic]

CHART = REPO / "charts" / "netagent"
# a release and a namespace of other names than the chart's: names come from the release (objects
# <release>-netagent-*), the alerts' jobs do not (docs/alerts.md "Release names")
RELEASE, NAMESPACE = "egress", "egress-system"
FULLNAME = f"{RELEASE}-netagent"
AGENT, CONTROLLER, CLEANUP = f"{FULLNAME}-agent", f"{FULLNAME}-controller", f"{FULLNAME}-cleanup"
WORKLOADS = "shaped"
IPERF_IMAGE = "localhost/netagent-test/iperf3:1"
INTERNET, INTERNAL_PEER = "203.0.113.1", "10.212.0.1"
UPLINK, UPLINK_PEER = "natinet0", "natinet1"
HOST_SIDE, PEER_SIDE = "198.51.100.254", "198.51.100.253"
SERVICE_LINK = "natsvc0"
KUBERNETES_SVC = "10.96.0.1"
CONTROLLER_SVC = "10.96.200.1"
CONTROLLER_PORT = 9561
AGENT_STATE = "http://127.0.0.1:9562/state"  # the agent serves /state on loopback only (--state-listen)
IFB = "netagent0"
TRAFFIC_LOCK = "/tmp/netagent-traffic.lock"
CLASSES = [{"name": "bronze", "spec": {"weight": 1, "max": "20M"}},
           {"name": "silver", "spec": {"weight": 2, "max": "40M"}}]
CAPABILITY_BITS = {"NET_ADMIN": 12, "NET_RAW": 13, "BPF": 39}  # linux/capability.h


# --- the lab around the node -----------------------------------------------------------------


class Relay:
    """A TCP relay (kube-proxy's old userspace mode) from `listen` to what `target()` names."""

    def __init__(self, listen: tuple[str, int], target):
        self.target = target
        self.server = socket.create_server(listen, reuse_port=False)
        self.server.settimeout(0.2)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._pipe_to_target, args=(client,), daemon=True).start()

    def _pipe_to_target(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target(), timeout=3)
        except (OSError, TypeError):
            client.close()
            return
        upstream.settimeout(None)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._copy, args=(a, b), daemon=True).start()

    @staticmethod
    def _copy(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.stopped.set()
        self.server.close()
        self.thread.join(2)


@pytest.fixture
def internet():
    """The "internet" namespace behind the uplink veth, with an iperf3 server on each address."""
    require_root()
    ns = f"na-inet-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    servers = []
    try:
        run(f"ip link add {UPLINK} type veth peer name {UPLINK_PEER}")
        run(f"ip link set {UPLINK_PEER} netns {ns}")
        run(f"ip addr add {HOST_SIDE}/30 dev {UPLINK}")
        run(f"ip link set {UPLINK} up")
        run("ip link set lo up", ns)
        run(f"ip addr add {PEER_SIDE}/30 dev {UPLINK_PEER}", ns)
        run(f"ip addr add {INTERNET}/32 dev lo", ns)
        run(f"ip addr add {INTERNAL_PEER}/32 dev lo", ns)
        run(f"ip link set {UPLINK_PEER} up", ns)
        run(f"ip route add default via {HOST_SIDE}", ns)
        run(f"ip route add {INTERNET}/32 via {PEER_SIDE} dev {UPLINK}")
        run(f"ip route add {INTERNAL_PEER}/32 via {PEER_SIDE} dev {UPLINK}")
        for port in (5201, 5202, 5203):
            servers.append(subprocess.Popen(["ip", "netns", "exec", ns, "iperf3", "-s", "-p", str(port)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield ns
    finally:
        for s in servers:
            s.kill()
            s.wait()
        subprocess.run(["ip", "link", "del", UPLINK], capture_output=True)
        subprocess.run(["ip", "route", "del", f"{INTERNET}/32"], capture_output=True)
        subprocess.run(["ip", "route", "del", f"{INTERNAL_PEER}/32"], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def services(kube_api):
    """ClusterIPs as local addresses, relayed to the apiserver and to a ready controller pod."""
    from kubernetes import client

    core = client.CoreV1Api(kube_api.admin)
    api_host, api_port = kube_api.url.removeprefix("https://").rsplit(":", 1)

    def controller_pod():
        pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"app.kubernetes.io/name={CONTROLLER}").items
        ready = [p for p in pods if p.status.pod_ip and any(
            c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
        return (ready[0].status.pod_ip, CONTROLLER_PORT) if ready else None

    # a veth pair up at both ends holds the addresses (this kernel has no dummy links)
    run(f"ip link add {SERVICE_LINK} type veth peer name {SERVICE_LINK}p")
    relays = []
    try:
        run(f"ip addr add {KUBERNETES_SVC}/32 dev {SERVICE_LINK}")
        run(f"ip addr add {CONTROLLER_SVC}/32 dev {SERVICE_LINK}")
        run(f"ip link set {SERVICE_LINK}p up")
        run(f"ip link set {SERVICE_LINK} up")
        relays.append(Relay((KUBERNETES_SVC, 443), lambda: (api_host, int(api_port))))
        relays.append(Relay((CONTROLLER_SVC, CONTROLLER_PORT), controller_pod))
        yield
    finally:
        for r in relays:
            r.close()
        subprocess.run(["ip", "link", "del", SERVICE_LINK], capture_output=True)


# --- helpers -----------------------------------------------------------------------------------


def helm(kube_api, *args: str, check: bool = True, timeout: float = 330) -> subprocess.CompletedProcess:
    binary = require_node_assets(["helm"]) / "helm"
    try:
        result = subprocess.run([str(binary), f"--kubeconfig={kube_api.kubeconfig}", *args],
                                capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"helm {' '.join(args)}: no answer in {timeout} s\n{release_diagnostics(kube_api)}") from e
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}\n"
                             f"{release_diagnostics(kube_api)}")
    return result


def release_diagnostics(kube_api) -> str:
    """What a failed install or upgrade left: the release's pods, events and containers' last logs."""
    out = [kube_api.kubectl("get", "pods,secrets,podmonitors", "-n", NAMESPACE, "-o", "wide", check=False).stdout,
           kube_api.kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp", check=False).stdout[-3000:]]
    pods = kube_api.kubectl("get", "pods", "-n", NAMESPACE, "-o", "name", check=False).stdout.split()
    for pod in pods:
        for previous in ("--previous=false", "--previous=true"):
            logs = kube_api.kubectl("logs", "-n", NAMESPACE, pod, "--tail=15", "--all-containers", previous, check=False)
            out.append(f"--- {pod} {previous}\n{logs.stdout[-2500:]}{logs.stderr[-300:]}")
    return "\n".join(out)


def chart_copy(tmp: Path, version: str | None = None, crd_note: str | None = None) -> Path:
    """The chart as users get it, with another version and a changed CRD for the upgrade."""
    chart = tmp / f"chart-{len(list(tmp.glob('chart-*')))}" / "netagent"
    shutil.copytree(CHART, chart, symlinks=False)
    if version:
        meta = yaml.safe_load((chart / "Chart.yaml").read_text())
        meta["version"] = version
        (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    if crd_note:  # a new revision of crds/ (tests/test_chart_upgrade.py: how revisions are kept)
        crd = chart / "crds" / "egressclasses.netagent.io.yaml"
        text = crd.read_text()
        revision = int(re.search(r'netagent.io/crd-revision: "(\d+)"', text).group(1))
        text = text.replace(f'netagent.io/crd-revision: "{revision}"', f'netagent.io/crd-revision: "{revision + 1}"')
        crd.write_text(text.replace(
            "    - {name: Age, type: date, jsonPath: .metadata.creationTimestamp}",
            f"    - {{name: Note, type: string, jsonPath: .metadata.name, description: {crd_note}}}\n"
            "    - {name: Age, type: date, jsonPath: .metadata.creationTimestamp}"))
    return chart


def iperf3_image(path: Path) -> Path:
    """busybox plus the host's iperf3 and the shared libraries it loads."""
    binary = Path(shutil.which("iperf3"))
    files = {"/bin/iperf3": binary.read_bytes()}
    for line in subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout.splitlines():
        m = re.search(r"(/\S+) \(0x", line)
        if m:
            files[m.group(1) if "=>" in line else m.group(1)] = Path(m.group(1)).read_bytes()
    return busybox_image(path, IPERF_IMAGE, files=files)


def ctr_pid(node, container_id: str) -> int:
    for line in node.ctr("tasks", "ls").stdout.splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == container_id:
            return int(fields[1])
    raise AssertionError(f"no task for container {container_id}")


def container_pid(core, node, namespace: str, pod_name: str) -> int:
    pod = core.read_namespaced_pod(pod_name, namespace)
    return ctr_pid(node, pod.status.container_statuses[0].container_id.split("://", 1)[1])


def agent_state() -> dict:
    with urllib.request.urlopen(AGENT_STATE, timeout=3) as r:
        return json.load(r)


def tc_class_rates() -> dict[str, str]:
    """classid -> ceil (as tc prints it) of every HTB class on the IFB."""
    out = subprocess.run(["tc", "class", "show", "dev", IFB], capture_output=True, text=True)
    rates = {}
    for line in out.stdout.splitlines():
        m = re.match(r"class htb (\S+) .*\bceil (\S+)", line)
        if m:
            rates[m.group(1)] = m.group(2)
    return rates


def class_sent(minor: int) -> tuple[int, str] | None:
    """(bytes sent, ceil) of the IFB's HTB class with this minor: the pod's egress at L2."""
    out = subprocess.run(["tc", "-s", "class", "show", "dev", IFB], capture_output=True, text=True).stdout
    for block in re.split(r"\n(?=class )", out):
        m = re.match(r"class htb \w+:(\w+) .*?\bceil (\S+).*?Sent (\d+) bytes", block, re.S)
        if m and int(m.group(1), 16) == minor:
            return int(m.group(3)), m.group(2)
    return None


def pod_minor(pod_ip: str) -> int:
    return next(p["minor"] for p in agent_state()["pods"] if pod_ip in p.get("ips", []))


def pod_class_rate(pod_ip: str) -> int | None:
    try:
        state = agent_state()
    except (OSError, ValueError):  # the agent restarting (upgrade)
        return None
    for p in state.get("pods", []):
        if pod_ip in p.get("ips", []) and p.get("minor") is not None:
            return p.get("limit_bps")
    return None


@contextlib.contextmanager
def traffic_lock():
    """Measurements are serialised machine-wide (the lock the benches take). A run already inside
    `flock /tmp/netagent-traffic.lock env NETAGENT_TRAFFIC_LOCKED=1 ...` holds it: taking it again
    through another open file would wait for itself."""
    import fcntl

    if os.environ.get("NETAGENT_TRAFFIC_LOCKED") == "1":
        yield
        return
    with open(TRAFFIC_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def iperf(pid: int, target: str, port: int, seconds: int = 5, omit: int = 0) -> float:
    """Receiver goodput in bit/s of a TCP upload from the container `pid` (its own iperf3), the
    first `omit` seconds left out (while the controller raises a pod's allocation to its demand)."""
    result = subprocess.run(["nsenter", "-t", str(pid), "-a",
                             "/bin/iperf3", "-c", target, "-p", str(port), "-t", str(seconds), "-O", str(omit), "-J"],
                            capture_output=True, text=True, timeout=seconds + 60)
    assert result.returncode == 0, result.stdout[-1500:] + result.stderr[-1500:]
    return json.loads(result.stdout)["end"]["sum_received"]["bits_per_second"]


def proc_status(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)


def residue() -> list[str]:
    found = []
    for tool in ("iptables-save", "ip6tables-save"):
        out = subprocess.run([tool], capture_output=True, text=True).stdout
        found += [f"{tool}: {line}" for line in out.splitlines() if "NETAGENT" in line.upper()]
    out = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True).stdout
    found += [f"ipset {name}" for name in out.split() if name.startswith("netagent")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found += [f"link {line.split(':')[1].strip()}" for line in links.splitlines() if IFB in line]
    for dev in (UPLINK,):
        filters = subprocess.run(["tc", "filter", "show", "dev", dev, "egress"], capture_output=True, text=True).stdout
        if "bpf" in filters or "mirred" in filters:
            found.append(f"tc filter on {dev}: {filters.strip()}")
    return found


# --- Prometheus through the chart's PodMonitors -----------------------------------------------


def _sanitized(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def scrape_configs(podmonitors: list[dict], discovery, secret_file) -> list[dict]:
    """The Prometheus scrape configs the Prometheus operator generates for these PodMonitors
    (selector and port relabelling of pod-role discovery's labels, jobLabel, honorLabels,
    interval, scheme, TLS with the CA from a Secret and serverName or insecureSkipVerify, the
    bearer token of `authorization` from a Secret, the monitor's relabelings),
    with `discovery(namespace)` the service-discovery config for a namespace's pods and
    `secret_file(namespace, name, key)` the file holding a Secret key's value."""
    configs = []
    for pm in podmonitors:
        meta, spec = pm["metadata"], pm["spec"]
        ns = meta["namespace"]
        keep = [{"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"}]
        for key, value in spec["selector"].get("matchLabels", {}).items():
            keep.append({"action": "keep", "source_labels": [f"__meta_kubernetes_pod_label_{_sanitized(key)}",
                                                             f"__meta_kubernetes_pod_labelpresent_{_sanitized(key)}"],
                         "regex": f"({value});true"})
        assert not spec["selector"].get("matchExpressions"), "not translated here"
        for i, ep in enumerate(spec["podMetricsEndpoints"]):
            relabel = keep + [
                {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": ep["port"]},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {"target_label": "job", "replacement": f"{ns}/{meta['name']}"},
            ]
            if spec.get("jobLabel"):
                relabel.append({"source_labels": [f"__meta_kubernetes_pod_label_{_sanitized(spec['jobLabel'])}"],
                                "target_label": "job", "regex": "(.+)", "replacement": "${1}"})
            relabel.append({"target_label": "endpoint", "replacement": ep["port"]})
            for r in ep.get("relabelings", []):
                relabel.append({"source_labels": r.get("sourceLabels"), "target_label": r.get("targetLabel"),
                                **({"regex": r["regex"]} if "regex" in r else {}),
                                **({"replacement": r["replacement"]} if "replacement" in r else {}),
                                **({"action": r["action"].lower()} if "action" in r else {})})
            config = {"job_name": f"podMonitor/{ns}/{meta['name']}/{i}",
                      "honor_labels": bool(ep.get("honorLabels")),
                      "scrape_interval": ep.get("interval", "30s"),
                      "metrics_path": ep.get("path", "/metrics"),
                      "scheme": ep.get("scheme", "http"),
                      **discovery(ns),
                      "relabel_configs": relabel}
            tls = ep.get("tlsConfig")
            if tls and tls.get("insecureSkipVerify"):  # the agents' self-signed certificate (metrics.auth)
                config["tls_config"] = {"insecure_skip_verify": True}
            elif tls:
                ref = tls["ca"]["secret"]
                config["tls_config"] = {"ca_file": str(secret_file(ns, ref["name"], ref["key"])),
                                        "server_name": tls["serverName"]}
            auth = ep.get("authorization")
            if auth:  # the operator reads the Secret's key into the scrape config's credentials
                ref = auth["credentials"]
                config["authorization"] = {"type": auth.get("type", "Bearer"),
                                           "credentials_file": str(secret_file(ns, ref["name"], ref["key"]))}
            configs.append(config)
    return configs


def pod_role_targets(pods) -> list[dict]:
    """What Prometheus' kubernetes_sd_configs `role: pod` discovers: a target per declared
    container port, with its __meta_kubernetes_* labels (Debian's prometheus is built without
    Kubernetes discovery, so the test discovers, and writes it for file_sd; relabelling, TLS and
    scraping are Prometheus' own)."""
    groups = []
    for pod in pods:
        labels = {"__meta_kubernetes_namespace": pod.metadata.namespace,
                  "__meta_kubernetes_pod_name": pod.metadata.name,
                  "__meta_kubernetes_pod_node_name": pod.spec.node_name or "",
                  "__meta_kubernetes_pod_phase": pod.status.phase or "",
                  "__meta_kubernetes_pod_ip": pod.status.pod_ip or ""}
        for key, value in (pod.metadata.labels or {}).items():
            labels[f"__meta_kubernetes_pod_label_{_sanitized(key)}"] = value
            labels[f"__meta_kubernetes_pod_labelpresent_{_sanitized(key)}"] = "true"
        for c in pod.spec.containers:
            for port in c.ports or []:
                if pod.status.pod_ip:
                    groups.append({"targets": [f"{pod.status.pod_ip}:{port.container_port}"], "labels": {
                        **labels, "__meta_kubernetes_pod_container_name": c.name,
                        "__meta_kubernetes_pod_container_port_name": port.name or "",
                        "__meta_kubernetes_pod_container_port_number": str(port.container_port)}})
    return groups


@contextlib.contextmanager
def prometheus_scraping_the_chart(kube_api, workdir: Path):
    """Debian's Prometheus configured from the PodMonitors and PrometheusRule the chart made."""
    from kubernetes import client

    from tests.test_dashboards import _wait_ready, tool

    objects = client.CustomObjectsApi(kube_api.admin)
    core = client.CoreV1Api(kube_api.admin)
    podmonitors = objects.list_namespaced_custom_object("monitoring.coreos.com", "v1", NAMESPACE, "podmonitors")["items"]
    rules = objects.list_namespaced_custom_object("monitoring.coreos.com", "v1", NAMESPACE, "prometheusrules")["items"]
    assert {p["metadata"]["name"] for p in podmonitors} == {AGENT, CONTROLLER}
    assert len(rules) == 1

    def secret_file(ns: str, name: str, key: str) -> Path:
        import base64

        path = workdir / f"{ns}-{name}-{key}"
        path.write_bytes(base64.b64decode(core.read_namespaced_secret(name, ns).data[key]))
        return path

    def discovery(ns: str) -> dict:
        path = workdir / f"pods-{ns}.json"
        path.write_text(json.dumps(pod_role_targets(core.list_namespaced_pod(ns).items)))
        return {"file_sd_configs": [{"files": [str(path)]}]}

    (workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": rules[0]["spec"]["groups"]}))
    (workdir / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"evaluation_interval": "15s"}, "rule_files": ["rules.yaml"],
        "scrape_configs": scrape_configs(podmonitors, discovery, secret_file)}))
    port = free_port()
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen([tool("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
                             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc, workdir / "prometheus.log")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, 20)
        log.close()


def prom_query(url: str, query: str) -> list[dict]:
    import urllib.parse

    with urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": query}), timeout=10) as r:
        return json.load(r)["data"]["result"]


OPERATOR_CRDS = ("podmonitors", "servicemonitors", "prometheusrules")


def find_operator_crds(names) -> Path:
    directory = node_assets_dir() / "crds"
    missing = [n for n in names if not (directory / f"monitoring.coreos.com_{n}.yaml").is_file()]
    if missing:
        raise KubeAssetsMissing(f"the Prometheus operator's CRDs ({', '.join(missing)}) missing from {directory}: "
                                "`make node-assets` copies them from its Go module")
    return directory


@pytest.fixture
def operator_crds(kube_api):
    """The Prometheus operator's PodMonitor, ServiceMonitor and PrometheusRule CRDs in the cluster
    (their real schemas check the chart's objects), removed afterwards."""
    directory = required(find_operator_crds, OPERATOR_CRDS)
    files = [str(directory / f"monitoring.coreos.com_{n}.yaml") for n in OPERATOR_CRDS]
    kube_api.kubectl("create", *[a for f in files for a in ("-f", f)])
    try:
        for n in OPERATOR_CRDS:
            kube_api.kubectl("wait", "--for=condition=Established", f"crd/{n}.monitoring.coreos.com", "--timeout=60s")
        yield
    finally:
        kube_api.kubectl("delete", "--ignore-not-found", *[a for f in files for a in ("-f", f)], check=False)


# --- the test ----------------------------------------------------------------------------------


NETAGENT_CRDS = ("egressclasses.netagent.io", "egressbudgets.netagent.io", "networkscopes.netagent.io")


def leftovers(kube_api) -> list[str]:
    """netagent objects in the cluster (other tests of the session share its API server)."""
    names = kube_api.kubectl("get", "all,sa,role,rolebinding,pdb,cm,secret", "-n", NAMESPACE, "-o", "name",
                             check=False).stdout.split()
    names += kube_api.kubectl("get", "clusterrole,clusterrolebinding,validatingadmissionpolicy,"
                              "validatingadmissionpolicybinding,flowschema", "-o", "name", check=False).stdout.split()
    return [n for n in names if "netagent" in n and "kube-root-ca" not in n]


@pytest.fixture
def clean_slate(kube_api):
    """The session's API server as a new cluster is to `helm install`: the objects of deploy/ that
    earlier tests applied gone (they are deleted without waiting), and the CRDs they left for the
    session deleted (Helm will not adopt objects it did not make; later modules apply them again)."""
    kube_api.kubectl("delete", "crd", "--ignore-not-found", *NETAGENT_CRDS)
    wait_for(lambda: not leftovers(kube_api), 180, what="earlier tests' netagent objects gone", interval=1)


@pytest.fixture
def image_builder() -> Path:
    """hack/image/build.sh with its tools (checked before the node starts)."""
    return require_image_builder()


def test_helm_install_shapes_upgrades_and_uninstalls_on_the_real_node(
        image_builder, kube_api, kube_cluster, clean_slate, operator_crds, real_node, internet, services, tmp_path):
    from kubernetes import client

    core, apps = client.CoreV1Api(kube_api.admin), client.AppsV1Api(kube_api.admin)
    ext = client.ApiextensionsV1Api(kube_api.admin)

    # the image, built as users build it, imported into the node's containerd (no registry)
    archive = tmp_path / "netagent.tar"
    build = subprocess.run([str(image_builder), "--archive", str(archive)],
                           capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    image = build.stdout.strip().splitlines()[-1]
    repository, tag = image.rsplit(":", 1)
    real_node.import_image(archive)
    real_node.ctr("images", "tag", "--force", image, f"{repository}:{tag}-next")
    real_node.import_image(iperf3_image(tmp_path / "iperf3.tar"))

    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "internalCIDRs": ["10.0.0.0/8"],  # the lab's: pods, services and the internal peer
        "podCIDRs": [str(real_node.pod_cidr)],
        "serviceCIDRs": ["10.96.0.0/16"],
        "uplinks": [UPLINK],
        # the Prometheus operator's objects (its CRDs are installed; a Prometheus made from them scrapes)
        "monitoring": {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}, "interval": "5s"},
        "controller": {"service": {"clusterIP": CONTROLLER_SVC}},  # no cluster DNS here (module docstring)
        "classes": CLASSES,
        "budget": {"name": "default", "spec": {"total": "1G", "teams": [{
            "name": "lab", "namespaces": [WORKLOADS], "defaultClass": "bronze",
            "allowedClasses": ["bronze", "silver"]}]}},
    }))
    chart = chart_copy(tmp_path)
    core.create_namespace({"metadata": {"name": WORKLOADS}})
    installed = False
    try:
        helm(kube_api, "install", RELEASE, str(chart), "-n", NAMESPACE, "--create-namespace",
             "-f", str(values), "--wait", "--timeout", "5m")
        installed = True
        ds = apps.read_namespaced_daemon_set(AGENT, NAMESPACE)
        assert ds.status.number_ready == ds.status.desired_number_scheduled == 1
        deploy = apps.read_namespaced_deployment(CONTROLLER, NAMESPACE)
        assert deploy.status.ready_replicas == 2

        # the agent runs with exactly its pod spec's privileges
        agent_pod, = core.list_namespaced_pod(NAMESPACE, label_selector=f"app.kubernetes.io/name={AGENT}").items
        spec_sc = agent_pod.spec.containers[0].security_context
        pid = container_pid(core, real_node, NAMESPACE, agent_pod.metadata.name)
        status = proc_status(pid)
        wanted = sum(1 << CAPABILITY_BITS[c] for c in spec_sc.capabilities.add)
        for field in ("CapEff", "CapPrm", "CapBnd"):
            assert int(status[field], 16) == wanted, f"{field} {status[field]}"
        assert int(status["CapAmb"], 16) == int(status["CapInh"], 16) == 0
        assert status["Uid"].split()[0] == str(spec_sc.run_as_user) == "0"
        assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
        mounts = [line.split() for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]
        root, = [m for m in mounts if m[4] == "/"]
        assert "ro" in root[5].split(","), root
        for m in agent_pod.spec.containers[0].volume_mounts:
            # /var/run is a symlink to /run in the image: the kernel shows the resolved path
            path = re.sub(r"^/var/run/", "/run/", m.mount_path)
            mount, = [x for x in mounts if x[4] == path]
            assert ("ro" in mount[5].split(",")) == bool(m.read_only), f"{path}: {mount[5]}"
        hostpaths = {v.host_path.path for v in agent_pod.spec.volumes if v.host_path}
        assert hostpaths == {"/run/xtables.lock", "/sys/fs/bpf"}  # the bpffs: device counting (chart default)

        # TLS by default: the controller made its Secret; the agent reports over HTTPS to the
        # Service's name, pinning the Secret's CA (mounted alone, no key in the agent)
        secret = core.read_namespaced_secret("netagent-controller-tls", NAMESPACE)
        assert set(secret.data) == {"ca.crt", "ca.key", "tls.crt", "tls.key"}
        ca_dir, = [x for x in mounts if x[4] == "/etc/netagent/controller-ca"]
        ca_files = subprocess.run(["nsenter", "-t", str(pid), "-m", "ls", "/etc/netagent/controller-ca"],
                                  capture_output=True, text=True, check=True).stdout.split()
        assert ca_files == ["ca.crt"], ca_files
        state = wait_for(lambda: (s := agent_state())["controller_reachable"] and s, 60,
                         what="the agent reaching the controller over HTTPS", interval=0.5)
        assert state["controller"] == f"https://{CONTROLLER}.{NAMESPACE}.svc:{CONTROLLER_PORT}", state["controller"]

        # pods through the CNI, with iperf3 in their image, shaped on their internet egress only
        def pod(name, annotations):
            core.create_namespaced_pod(WORKLOADS, {
                "metadata": {"name": name, "annotations": annotations},
                "spec": {"nodeName": real_node.name, "automountServiceAccountToken": False,
                         "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "main", "image": IPERF_IMAGE, "imagePullPolicy": "Never",
                                         "command": ["sleep", "3600"]}]}})

        pod("silver", {"netagent.io/egress-class": "silver"})
        pod("capped", {"netagent.io/egress-class": "silver", "kubernetes.io/egress-bandwidth": "30M"})

        def running(name):
            p = core.read_namespaced_pod(name, WORKLOADS)
            return p if p.status.phase == "Running" and p.status.pod_ip else None

        pods = {n: wait_for(lambda n=n: running(n), 90, what=f"pod {n} running") for n in ("silver", "capped")}
        # silver's limit is its class's max once its demand asks for it (the controller probes above
        # usage); capped's is its egress-bandwidth annotation from the start
        limits = {"silver": 40_000_000, "capped": 30_000_000}
        for name, p in pods.items():
            try:
                wait_for(lambda p=p: pod_class_rate(p.status.pod_ip), 60, what=f"{name} shaped", interval=0.2)
            except AssertionError as e:
                e.add_note(json.dumps(agent_state(), default=str)[:3000])
                e.add_note(kube_api.kubectl("logs", "-n", NAMESPACE, f"daemonset/{AGENT}", "--tail=30",
                                            check=False).stdout[-3000:])
                raise
        wait_for(lambda: pod_class_rate(pods["capped"].status.pod_ip) == limits["capped"], 60,
                 what="capped's limit at its egress-bandwidth", interval=0.2)
        figures = {}
        for name, p in pods.items():
            pid = container_pid(core, real_node, WORKLOADS, name)
            minor = pod_minor(p.status.pod_ip)
            samples, done = [], threading.Event()

            def sample(minor=minor, samples=samples, done=done):
                while not done.is_set():
                    samples.append((time.monotonic(), class_sent(minor), pod_class_rate(p.status.pod_ip)))
                    time.sleep(0.25)

            with traffic_lock():
                sampler = threading.Thread(target=sample, daemon=True)
                start = time.monotonic()
                sampler.start()
                try:
                    figures[f"{name}-goodput"] = iperf(pid, INTERNET, 5201, seconds=12, omit=6)
                finally:
                    done.set()
                    sampler.join()
                figures[f"{name}-internal"] = internal = iperf(pid, INTERNAL_PEER, 5202, seconds=3)
            # the pod's internet egress as the shaper counts it (L2 bytes through its class), over
            # the run's second half where its limit stood at the class's max
            at_limit = [(t, sent[0]) for t, sent, limit in samples
                        if sent and limit == limits[name] and t >= start + 6]
            assert len(at_limit) >= 8, f"{name}: limit {limits[name]} held too briefly: {samples[-3:]}"
            (t0, b0), (t1, b1) = at_limit[2], at_limit[-2]  # away from the run's start and end
            got = (b1 - b0) * 8 / (t1 - t0)
            figures[name] = got
            assert abs(got / limits[name] - 1) <= 0.05, f"{name}: {got / 1e6:.2f} Mbit/s for a {limits[name] / 1e6} M limit"
            assert internal > 5 * limits[name], f"{name}'s internal traffic slowed: {internal / 1e6:.0f} Mbit/s"
        print("goodput (Mbit/s):", {k: round(v / 1e6, 2) for k, v in figures.items()})

        # a real Prometheus scraping both parts through the chart's PodMonitors: the agent on the
        # node's address (its series keep the shaped pods' namespace and pod, and get `node`), both
        # controller replicas over HTTPS verified against the CA in the controller's Secret
        (tmp_path / "prometheus").mkdir()
        with prometheus_scraping_the_chart(kube_api, tmp_path / "prometheus") as prom:
            up = wait_for(lambda: (r := prom_query(prom, "up == 1")) and len(r) >= 3 and r, 90,
                          what="the agent and both controllers scraped", interval=1)
            jobs = sorted((r["metric"]["job"], r["metric"].get("node", "")) for r in up)
            assert jobs == [("netagent-agent", real_node.name), ("netagent-controller", ""),
                            ("netagent-controller", "")], jobs
            limit = wait_for(lambda: prom_query(prom, 'netagent_pod_egress_limit_bytes_per_second'
                                                      f'{{job="netagent-agent",namespace="{WORKLOADS}",pod="capped"}}'),
                             60, what="the agent's pod series", interval=1)
            assert limit[0]["metric"]["node"] == real_node.name
            leaders = wait_for(lambda: prom_query(prom, 'netagent_controller_is_leader{job="netagent-controller"}'),
                               60, what="the controllers' series", interval=1)
            assert sorted(float(r["value"][1]) for r in leaders) == [0.0, 1.0], leaders
            with urllib.request.urlopen(f"{prom}/api/v1/rules", timeout=10) as r:
                assert json.load(r)["data"]["groups"], "the PrometheusRule's rules not loaded"

        # `kubectl get egressbudgets` shows the controller's view: total, allocated, used
        def budget_row():
            out = kube_api.kubectl("get", "egressbudgets", "default", "--no-headers",
                                   "-o", "custom-columns=T:.spec.total,A:.status.allocated,U:.status.used").stdout.split()
            return out if len(out) == 3 and "<none>" not in out else None

        total, allocated, used = wait_for(budget_row, 60, what="the budget's status", interval=1)
        header = kube_api.kubectl("get", "egressbudgets").stdout.splitlines()[0].split()
        assert header[:4] == ["NAME", "TOTAL", "ALLOCATED", "USED"], header
        print(f"kubectl get egressbudgets: total {total}, allocated {allocated}, used {used}")

        # a new class on the running pod: its class's rate follows (polled, not timed by wall clock)
        silver_ip = pods["silver"].status.pod_ip
        kube_api.kubectl("annotate", "pod", "silver", "-n", WORKLOADS, "--overwrite", "netagent.io/egress-class=bronze")
        start = time.monotonic()
        wait_for(lambda: pod_class_rate(silver_ip) == 20_000_000, 30, what="the new class applied", interval=0.02)
        print(f"annotate -> class rate applied in {time.monotonic() - start:.2f} s")

        # the policy is the release's: `helm upgrade` with a changed class changes it in the API server
        # and the agent applies it (bronze lowered: its max caps the pod at once); `helm rollback` puts
        # it back (the pod's limit rises again once the controller answers: at most the class's max)
        def bronze_max():
            return kube_api.kubectl("get", "egressclass", "bronze", "-o", "jsonpath={.spec.max}").stdout

        lowered = [{"name": "bronze", "spec": {"weight": 1, "max": "15M"}}, CLASSES[1]]
        revision = json.loads(helm(kube_api, "status", RELEASE, "-n", NAMESPACE, "-o", "json").stdout)["version"]
        helm(kube_api, "upgrade", RELEASE, str(chart), "-n", NAMESPACE, "--reuse-values",
             "--set-json", f"classes={json.dumps(lowered)}", "--rollback-on-failure", "--timeout", "5m")
        assert bronze_max() == "15M"
        start = time.monotonic()
        wait_for(lambda: pod_class_rate(silver_ip) == 15_000_000, 30, what="the upgraded class applied", interval=0.02)
        print(f"helm upgrade (class changed) -> class rate applied in {time.monotonic() - start:.2f} s")
        helm(kube_api, "rollback", RELEASE, str(revision), "-n", NAMESPACE, "--wait", "--timeout", "5m")
        assert bronze_max() == "20M"
        start = time.monotonic()
        wait_for(lambda: 15_020_000 < (pod_class_rate(silver_ip) or 0) <= 20_020_000, 60,
                 what=f"the rolled-back class applied (last read {pod_class_rate(silver_ip)})", interval=0.02)
        print(f"helm rollback -> class rate {pod_class_rate(silver_ip)} in {time.monotonic() - start:.2f} s")

        # an upgrade with a rate the CRDs' CEL would refuse fails at render (templates/validate-rates.yaml),
        # before Helm applies anything: the lowered bronze beside it never reaches the API server, so the
        # class keeps its rate throughout (before the check, Helm applied bronze, the agent shaped to it,
        # and only --rollback-on-failure put it back)
        refused = [{"name": "bronze", "spec": {"weight": 1, "max": "15M"}},
                   {"name": "silver", "spec": {"weight": 2, "max": "40Mbit"}}]
        seen, stop_sampling = [], threading.Event()

        def sample_rate():
            while not stop_sampling.is_set():
                seen.append(pod_class_rate(silver_ip))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample_rate, daemon=True)
        sampler.start()
        try:
            result = helm(kube_api, "upgrade", RELEASE, str(chart), "-n", NAMESPACE, "--reuse-values",
                          "--set-json", f"classes={json.dumps(refused)}", "--rollback-on-failure",
                          "--timeout", "5m", check=False)
            assert result.returncode != 0
            assert 'classes[1] (silver).spec.max="40Mbit" is refused' in result.stderr, result.stderr[-2000:]
            assert "is invalid" not in result.stderr  # not the API server's refusal: nothing was sent
            assert bronze_max() == "20M"
            status = json.loads(helm(kube_api, "status", RELEASE, "-n", NAMESPACE, "-o", "json").stdout)
            assert status["info"]["status"] == "deployed"
            start = time.monotonic()
            wait_for(lambda: 15_020_000 < (pod_class_rate(silver_ip) or 0) <= 20_020_000, 60,
                     what=f"the class as before the refused upgrade (last read {pod_class_rate(silver_ip)})",
                     interval=0.02)
        finally:
            stop_sampling.set()
            sampler.join()
        print(f"refused upgrade: lowest class rate seen {min(r for r in seen if r)}, "
              f"{pod_class_rate(silver_ip)} {time.monotonic() - start:.2f} s after helm returned")
        assert min(r for r in seen if r) > 15_020_000  # never lowered: nothing of the upgrade was applied

        # helm upgrade to a new image tag (and a changed CRD): rolling update with the tc classes
        # in force at every moment
        before = {p.metadata.uid for p in core.list_namespaced_pod(NAMESPACE).items}
        # the controller's own pods are replaced by the upgrade (their classes go with them): every
        # other class (node, default, the workloads' pods) must stay in force throughout
        # (a pod's class and its two leaves: tc.model)
        replaced = {f"{m:x}" for p in agent_state()["pods"] if p["namespace"] == NAMESPACE
                    for m in (p["minor"], ack_minor(p["minor"]), bulk_minor(p["minor"]))}
        classes_before = {c for c in tc_class_rates() if c.split(":")[1] not in replaced}
        assert len(classes_before) >= 3, classes_before
        gaps, stop = [], threading.Event()

        def watch_classes():
            while not stop.is_set():
                missing = classes_before - set(tc_class_rates())
                if missing:
                    gaps.append(missing)
                time.sleep(0.02)

        watcher = threading.Thread(target=watch_classes, daemon=True)
        watcher.start()
        try:
            next_chart = chart_copy(tmp_path, "0.1.1", "upgraded")
            upgrade = ("upgrade", RELEASE, str(next_chart), "-n", NAMESPACE, "--reuse-values",
                       "--set", f"image.tag={tag}-next", "--rollback-on-failure", "--timeout", "5m")
            # Helm never upgrades crds/: refused until they are applied, as docs/install.md says
            result = helm(kube_api, *upgrade, check=False)
            needs = f"needs revision {max(CRD_REVISIONS) + 1}"  # chart_copy raised the chart's revision by one
            assert result.returncode != 0 and needs in result.stderr, result.stderr[-1500:]
            crds = helm(kube_api, "show", "crds", str(next_chart)).stdout
            kube_api.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=crds)
            helm(kube_api, *upgrade)
            # adopted from the kernel's HTB ceil (frame units) until its first answer: within rounding of
            # 20M; once the new leader has answered, its allocation, which the new leader's feedback gain
            # may put below the cap (CI read 16.67M: a gain of 0.833 after its first rounds), never above
            def adopted_or_answered():
                rate = pod_class_rate(silver_ip) or 0
                if abs(rate - 20_000_000) <= 20_000:
                    return True
                try:
                    source = agent_state().get("allocation_source")
                except (OSError, ValueError):
                    return False
                return source == "controller" and 0 < rate <= 20_020_000

            wait_for(adopted_or_answered, 60,
                     what=f"the new agent adopting the classes (last read {pod_class_rate(silver_ip)})")
        finally:
            stop.set()
            watcher.join()
        assert not gaps, f"tc classes missing during the upgrade: {gaps[:3]}"
        wait_for(lambda: not before & {p.metadata.uid for p in core.list_namespaced_pod(NAMESPACE).items}, 90,
                 what="every old pod replaced", interval=0.5)
        after = core.list_namespaced_pod(NAMESPACE).items
        assert all(c.image.endswith(f":{tag}-next") for p in after for c in p.spec.containers)
        crd = ext.read_custom_resource_definition("egressclasses.netagent.io")
        columns = crd.spec.versions[0].additional_printer_columns
        assert any(c.name == "Note" and c.description == "upgraded" for c in columns), "CRD not updated"
        # chart_copy raised the chart's revision by one
        assert crd.metadata.labels["netagent.io/crd-revision"] == str(max(CRD_REVISIONS) + 1)

        # uninstall as documented: cleanup mode, then helm uninstall, then the CRDs
        helm(kube_api, "upgrade", RELEASE, str(next_chart), "-n", NAMESPACE,
             "--reuse-values", "--set", "cleanup=true", "--wait", "--timeout", "5m")
        kube_api.kubectl("-n", NAMESPACE, "rollout", "status", f"daemonset/{CLEANUP}", "--timeout=120s")
        helm(kube_api, "uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "5m")
        installed = False
        # the release's policy objects went with it (the CRDs stay: Helm never deletes crds/)
        assert kube_api.kubectl("get", "egressclasses,egressbudgets,networkscopes", "-o", "name").stdout.split() == []
        kube_api.kubectl("-n", NAMESPACE, "delete", "secret", "netagent-controller-tls")  # the controller made it
        kube_api.kubectl("delete", "crd", *NETAGENT_CRDS)
        left = residue()
        assert not left, f"left on the node: {left}"
        wait_for(lambda: not core.list_namespaced_pod(NAMESPACE).items, 60, what="the release's pods to go")
        objects = kube_api.kubectl("get", "all,cm,secret,sa,role,rolebinding,pdb", "-n", NAMESPACE, "-o", "name").stdout.split()
        ours = [o for o in objects if "netagent" in o and "kube-root-ca" not in o]
        assert not ours, ours
        cluster_scoped = kube_api.kubectl("get", "clusterrole,clusterrolebinding,validatingadmissionpolicy,"
                                          "validatingadmissionpolicybinding,crd", "-o", "name").stdout.split()
        assert not [o for o in cluster_scoped if "netagent" in o], cluster_scoped
    finally:
        if installed:
            helm(kube_api, "uninstall", RELEASE, "-n", NAMESPACE, "--wait", check=False)
        core.delete_namespace(WORKLOADS)
        kube_api.kubectl("-n", NAMESPACE, "delete", "secret", "netagent-controller-tls", "--ignore-not-found",
                         check=False)
        for crd in NETAGENT_CRDS:
            kube_api.kubectl("delete", "crd", crd, "--ignore-not-found", check=False)
        kube_api.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false", check=False)
        subprocess.run([sys_python(), "-m", "netagent", "cleanup"], capture_output=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})


def sys_python() -> str:
    import sys

    return sys.executable
