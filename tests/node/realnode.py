"""RealNode: containerd, runc, the CNI plugins and a kubelet on this machine (see tests/node/__init__.py)."""
from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import yaml

from tests.kube import ControlPlane, KubeHarnessError, Process, free_port, write_kubeconfig
from tests.node.assets import CNI_CACHE, CONTAINER_LOG_LINKS, DEFAULT_POD_CIDR, DEVICE_PLUGIN_DIR, K8S_NAMESPACE, PAUSE_IMAGE, RUNC, RUN_ROOT, SHIM_SOCKET_DIR, find_node_assets
from tests.node.host import cgroup_pids, create_cgroup_root, default_route_ip, kill, kubelet_chains, log_errors, pids_with_arg, read_tunables, remove_cgroups, remove_chains, restore_tunables, unmount_all
from tests.node.images import pause_image



class RealNode:
    """containerd + kubelet + CNI on this machine as Node `name` of `control_plane`.

    Use as a context manager, or call start() and stop() (stop() is safe to call twice, and after
    a failed start). Logs of a failed start or of a node stopped with failures are kept in
    ``$TMPDIR/netagent-node-logs/<id>/``.
    """

    def __init__(
        self,
        control_plane: ControlPlane,
        *,
        name: str | None = None,
        assets: Path | None = None,
        cni: str = "ptp",
        pod_cidr: str = DEFAULT_POD_CIDR,
        bandwidth_plugin: bool = False,
        node_ip: str | None = None,
        ready_timeout: float = 120.0,
        kubelet_config: dict | None = None,
        labels: dict[str, str] | None = None,
    ):
        if cni not in ("ptp", "bridge"):
            raise ValueError(f"cni must be 'ptp' or 'bridge', not {cni!r}")
        self.api = control_plane
        self.id = uuid.uuid4().hex[:8]
        self.name = name or f"real-node-{self.id}"
        self.assets = assets
        self.cni = cni
        self.pod_cidr = ipaddress.ip_network(pod_cidr)
        self.bandwidth_plugin = bandwidth_plugin
        self.node_ip = node_ip
        self.ready_timeout = ready_timeout
        self.extra_kubelet_config = kubelet_config or {}
        self.labels = labels or {}
        self.workdir = Path(tempfile.mkdtemp(prefix=f"netagent-node-{self.id}-"))
        self.run_dir = RUN_ROOT / self.id
        self.socket = self.run_dir / "containerd.sock"
        self.network = f"netagent-{self.id}"
        self.bridge_name = f"nab{self.id[:8]}"
        self.cgroup_root = f"/netagent-{self.id}"
        self.processes: list[Process] = []
        self._started = False
        # host directories the kubelet and libcni create if missing: removed again if we made them
        self._host_dirs = [d for d in (CONTAINER_LOG_LINKS, CNI_CACHE / "results", CNI_CACHE,
                                       DEVICE_PLUGIN_DIR, DEVICE_PLUGIN_DIR.parent) if not d.exists()]
        self._tunables: dict[str, str] = {}
        self._chains_before: set[tuple[str, str, str]] | None = None
        self._containers: list[str] = []

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> RealNode:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self.assets = self.assets or find_node_assets()
            self.node_ip = self.node_ip or default_route_ip()
            self._tunables = read_tunables()
            self._chains_before = kubelet_chains()
            self._write_cni_config()
            self._start_containerd()
            self.import_image(pause_image(self.workdir / "pause.tar"))
            self._start_kubelet()
            self.wait_ready()
            self._started = True
        except BaseException as start_error:
            self._preserve_logs()
            try:
                self.stop()
            except KubeHarnessError as e:  # the start's own error stays the one raised
                start_error.add_note(str(e))
            raise

    def stop(self) -> None:
        """Tear everything down; raises KubeHarnessError afterwards if something was left behind."""
        leftovers: list[str] = []
        kubelet = self._process("kubelet")
        if kubelet is not None and kubelet.exit_code() is None and self._started:
            self._drain()  # pods deleted through the kubelet: CNI DEL and unmounts done by their owners
        for process in reversed(self.processes):
            if process.name == "kubelet":
                process.stop()
        self._kill_workloads()
        leftovers += self._cni_teardown()
        containerd = self._process("containerd")
        if containerd is not None:
            containerd.stop()
        kill(pids_with_arg(str(self.socket)))  # shims outlive containerd by design
        self._remove_shim_sockets()
        self.processes.clear()
        kill(cgroup_pids(self.cgroup_root))
        leftovers += [f"mount {m}" for m in unmount_all(self.workdir, self.run_dir)]
        leftovers += [f"cgroup {c}" for c in remove_cgroups(self.cgroup_root)]
        if self.cni == "bridge":
            subprocess.run(["ip", "link", "del", self.bridge_name], capture_output=True)
        if self._chains_before is not None:
            leftovers += remove_chains(kubelet_chains() - self._chains_before)
        leftovers += restore_tunables(self._tunables)
        self._remove_log_links()
        if DEVICE_PLUGIN_DIR in self._host_dirs:
            (DEVICE_PLUGIN_DIR / "kubelet.sock").unlink(missing_ok=True)
        if leftovers:
            self._preserve_logs()
        shutil.rmtree(self.workdir, ignore_errors=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        # containerd's shims always put their sockets in /run/containerd/s (a constant): drop the
        # directories if nothing else (another containerd) uses them
        for d in (RUN_ROOT, SHIM_SOCKET_DIR, SHIM_SOCKET_DIR.parent, *self._host_dirs):
            try:
                d.rmdir()
            except OSError:
                pass
        if leftovers:
            raise KubeHarnessError(f"node {self.name} left behind: {'; '.join(leftovers)}")

    # -- images and containerd --------------------------------------------------------------

    def ctr(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        argv = [str(self.assets / "ctr"), f"--address={self.socket}", f"--namespace={K8S_NAMESPACE}", *args]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode:
            raise KubeHarnessError(f"ctr {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def import_image(self, archive: Path) -> None:
        """Import an OCI/Docker image archive into the CRI's namespace, unpacked for overlayfs;
        pods use it with imagePullPolicy: Never or IfNotPresent."""
        self.ctr("images", "import", "--snapshotter=overlayfs", str(archive))

    def images(self) -> list[str]:
        return self.ctr("images", "ls", "-q").stdout.split()

    # -- status -----------------------------------------------------------------------------

    def wait_ready(self, timeout: float | None = None) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        core = client.CoreV1Api(self.api.admin)
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        last = "not registered"
        while True:
            for process in self.processes:
                code = process.exit_code()
                if code is not None:
                    raise KubeHarnessError(
                        f"{process.name} exited with code {code}; log: {self._kept_log(process)}\n{log_errors(process)}"
                    )
            try:
                node = core.read_node(self.name)
                conditions = {c.type: c for c in node.status.conditions or []}
                ready = conditions.get("Ready")
                if ready is not None and ready.status == "True":
                    return
                if ready is not None:
                    last = f"Ready={ready.status} ({ready.reason}: {ready.message})"
            except ApiException as e:
                if e.status != 404:
                    raise
            if time.monotonic() > deadline:
                kubelet = self._process("kubelet")
                raise KubeHarnessError(
                    f"node {self.name} not Ready within {timeout or self.ready_timeout:g} s: {last}; "
                    f"kubelet log: {self._kept_log(kubelet)}\n{log_errors(kubelet) if kubelet else ''}"
                )
            time.sleep(0.5)

    # -- internals: configuration -------------------------------------------------------------

    def _write_cni_config(self) -> None:
        ipam = {
            "type": "host-local",
            "ranges": [[{"subnet": str(self.pod_cidr)}]],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": str(self.workdir / "cni-ipam"),
        }
        if self.cni == "ptp":
            main = {"type": "ptp", "ipMasq": False, "ipam": ipam}
        else:
            main = {"type": "bridge", "bridge": self.bridge_name, "isGateway": True, "ipMasq": False,
                    "hairpinMode": True, "ipam": ipam}
        plugins = [main, {"type": "portmap", "capabilities": {"portMappings": True}}]
        if self.bandwidth_plugin:
            plugins.append({"type": "bandwidth", "capabilities": {"bandwidth": True}})
        conf_dir = self.workdir / "cni-conf"
        conf_dir.mkdir()
        (conf_dir / "10-netagent.conflist").write_text(
            json.dumps({"cniVersion": "1.0.0", "name": self.network, "plugins": plugins}, indent=2)
        )

    def _start_containerd(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        runc = os.environ.get("NETAGENT_TEST_RUNC") or shutil.which(RUNC)
        config = f"""\
version = 3
root = "{self.workdir / 'containerd'}"
state = "{self.run_dir / 'state'}"
temp = "{self.workdir / 'tmp'}"
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{self.socket}"

[ttrpc]
  address = "{self.run_dir / 'containerd.sock.ttrpc'}"

[plugins.'io.containerd.internal.v1.opt']
  path = "{self.workdir / 'opt'}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins.'io.containerd.cri.v1.runtime']
  netns_mounts_under_state_dir = true
  # Pods ask for oom_score_adj below containerd's own (sandboxes -998, Guaranteed pods -997):
  # that needs CAP_SYS_RESOURCE, which root lacks in some sandboxes and VMs (runc then fails with
  # "can't get final child's PID from pipe"). Clamp to containerd's own value instead.
  restrict_oom_score_adj = true
  enable_unprivileged_ports = true
  enable_unprivileged_icmp = true
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{self.assets / 'cni'}"]
    conf_dir = "{self.workdir / 'cni-conf'}"
    max_conf_num = 1
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{self.run_dir / 'runc'}"
        SystemdCgroup = false

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""
        config_file = self.workdir / "containerd.toml"
        config_file.write_text(config)
        env_path = f"{self.assets}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        containerd = self._spawn("containerd", [
            "env", f"PATH={env_path}",  # containerd finds containerd-shim-runc-v2 on its PATH
            str(self.assets / "containerd"), f"--config={config_file}", "--log-level=info",
        ])
        deadline = time.monotonic() + 60
        while self.ctr("version", check=False, timeout=10).returncode != 0:
            if containerd.exit_code() is not None or time.monotonic() > deadline:
                raise KubeHarnessError(
                    f"containerd did not start; log: {self._kept_log(containerd)}\n{log_errors(containerd)}"
                )
            time.sleep(0.2)

    def _start_kubelet(self) -> None:
        api = self.api
        create_cgroup_root(self.cgroup_root)
        cert, key = api.pki.client(f"kubelet-{self.id}", f"system:node:{self.name}", ["system:nodes"])
        kubeconfig = write_kubeconfig(
            self.workdir / "kubelet.kubeconfig", api.url, api.ca_file,
            {"client-certificate": str(cert), "client-key": str(key)},
        )
        (self.workdir / "manifests").mkdir()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "failCgroupV1": False,  # Kubernetes >= 1.35 refuses cgroup v1 hosts unless told
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": "127.0.0.1",
            "port": free_port(),
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": free_port(),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(api.ca_file)},
            },
            "authorization": {"mode": "Webhook"},
            "staticPodPath": str(self.workdir / "manifests"),
            "podLogsDir": str(self.workdir / "pod-logs"),
            "resolvConf": "/etc/resolv.conf" if Path("/etc/resolv.conf").exists() else "",
            # a test machine's disk may be fuller than a node's: never evict or GC images for it
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "nodeStatusUpdateFrequency": "2s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "5s",
            "podPidsLimit": 4096,
            "containerLogMaxSize": "10Mi",
            **self.extra_kubelet_config,
        }
        config_file = self.workdir / "kubelet.yaml"
        config_file.write_text(yaml.safe_dump(config))
        labels = ",".join(f"{k}={v}" for k, v in {"netagent.io/real-node": "true", **self.labels}.items())
        self._spawn("kubelet", [
            str(self.assets / "kubelet"),
            f"--config={config_file}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={self.workdir / 'kubelet'}",
            f"--cert-dir={self.workdir / 'kubelet-pki'}",
            f"--hostname-override={self.name}",
            f"--node-ip={self.node_ip}",
            f"--node-labels={labels}",
            "--v=2",
        ])

    # -- internals: teardown ----------------------------------------------------------------

    def _drain(self) -> None:
        """Delete the node's pods through the API and wait (bounded) until the kubelet has
        stopped them: their sandboxes' CNI DEL and volume unmounts are then done by the kubelet.
        The Node object goes first, so that no controller (a DaemonSet's, whatever it tolerates)
        puts new pods on it; a running kubelet does not register itself again."""
        from kubernetes import client

        core = client.CoreV1Api(self.api.admin)
        selector = f"spec.nodeName={self.name}"
        try:
            for manifest in (self.workdir / "manifests").glob("*"):
                manifest.unlink()
            core.delete_node(self.name)
            for pod in core.list_pod_for_all_namespaces(field_selector=selector).items:
                core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=1)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                pods = core.list_pod_for_all_namespaces(field_selector=selector).items
                running = [line for line in self.ctr("tasks", "ls", check=False).stdout.splitlines()[1:]
                           if "RUNNING" in line.split()]
                if not pods and not running:
                    return
                time.sleep(0.5)
        except Exception:  # noqa: BLE001 - the fallback below cleans up whatever is left
            pass

    def _kill_workloads(self) -> None:
        if self._process("containerd") is None or not self.socket.exists():
            return
        for task in self.ctr("tasks", "ls", "-q", check=False, timeout=20).stdout.split():
            self.ctr("tasks", "kill", "--signal=SIGKILL", task, check=False, timeout=20)
        self._containers = self.ctr("containers", "ls", "-q", check=False, timeout=20).stdout.split()
        for container in self._containers:
            # a shim exits (and removes its socket) once its containers are gone
            self.ctr("tasks", "rm", "--force", container, check=False, timeout=20)
            self.ctr("containers", "rm", container, check=False, timeout=20)
            # containerd attaches each sandbox's lo through libcni too (network "cni-loopback"):
            # its DEL does nothing, but its cache entry stays unless the sandbox was torn down
            (CNI_CACHE / "results" / f"cni-loopback-{container}-lo").unlink(missing_ok=True)

    def _remove_shim_sockets(self) -> None:
        """Sockets of shims that were killed: /run/containerd/s/<sha256 of address/ns/id>."""
        for container in self._containers:
            digest = hashlib.sha256(f"{self.socket}/{K8S_NAMESPACE}/{container}".encode()).hexdigest()
            (SHIM_SOCKET_DIR / digest).unlink(missing_ok=True)

    def _cni_teardown(self) -> list[str]:
        """CNI DEL for every attachment libcni still has cached for our network (the kubelet or
        containerd did not get to it): runs the plugins in reverse order as libcni would."""
        leftovers = []
        results = CNI_CACHE / "results"
        if not results.is_dir():
            return leftovers
        for cached in results.glob(f"{self.network}-*"):
            try:
                info = json.loads(cached.read_text())
                conflist = json.loads(base64.b64decode(info["config"]))
                for plugin in reversed(conflist["plugins"]):
                    conf = {"cniVersion": conflist["cniVersion"], "name": conflist["name"], **plugin,
                            "prevResult": info.get("result")}
                    wanted = {k for k, v in plugin.get("capabilities", {}).items() if v}
                    runtime = {k: v for k, v in (info.get("capabilityArgs") or {}).items() if k in wanted}
                    if runtime:
                        conf["runtimeConfig"] = runtime
                    env = {
                        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin"), "CNI_COMMAND": "DEL",
                        "CNI_CONTAINERID": info["containerId"], "CNI_NETNS": info.get("netns", ""),
                        "CNI_IFNAME": info["ifName"], "CNI_PATH": str(self.assets / "cni"),
                        "CNI_ARGS": ";".join(f"{k}={v}" for k, v in info.get("cniArgs") or []),
                    }
                    done = subprocess.run([str(self.assets / "cni" / plugin["type"])], input=json.dumps(conf),
                                          env=env, capture_output=True, text=True, timeout=30)
                    if done.returncode:
                        leftovers.append(f"CNI DEL {plugin['type']} {info['containerId'][:12]}: "
                                         f"{(done.stdout + done.stderr).strip()[:200]}")
            except (OSError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
                leftovers.append(f"CNI cache {cached.name}: {e}")
            cached.unlink(missing_ok=True)
        return leftovers

    def _remove_log_links(self) -> None:
        if not CONTAINER_LOG_LINKS.is_dir():
            return
        ours = str(self.workdir / "pod-logs")
        for link in CONTAINER_LOG_LINKS.iterdir():
            try:
                if link.is_symlink() and os.readlink(link).startswith(ours):
                    link.unlink()
            except OSError:
                pass

    # -- internals: processes and logs ------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> Process:
        process = Process(name, argv, self.workdir / f"{name}.log")
        self.processes.append(process)
        process.start()
        return process

    def _process(self, name: str) -> Process | None:
        return next((p for p in self.processes if p.name == name), None)

    @property
    def _failure_log_dir(self) -> Path:
        return Path(tempfile.gettempdir()) / "netagent-node-logs" / self.id

    def _kept_log(self, process: Process | None) -> Path | None:
        return None if process is None else self._failure_log_dir / process.log_file.name

    def _preserve_logs(self) -> None:
        logs = [p for p in self.workdir.glob("*.log") if p.is_file()]
        if logs:
            self._failure_log_dir.mkdir(parents=True, exist_ok=True)
            for log in logs:
                shutil.copy2(log, self._failure_log_dir / log.name)
