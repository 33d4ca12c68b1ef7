"""A real Kubernetes node for the tests: containerd, runc, the CNI plugins and a kubelet on this
machine, registered with a :class:`tests.kube.ControlPlane`'s kube-apiserver.

Pods scheduled to it (or created with ``spec.nodeName`` set to :attr:`RealNode.name`) really run:
runc starts them in their own namespaces and cgroups, the CNI ``ptp`` (default) or ``bridge``
plugin with ``host-local`` IPAM gives each pod a veth and an address from ``pod_cidr`` (native
routing: a route per pod, or the bridge's subnet route, in the host's namespace; no overlay, no
masquerade), and the pod's IP answers from the host.

Everything is private to one :class:`RealNode` and removed by :meth:`RealNode.stop`, also after a
failed start: containerd's root, state and socket (``/run/netagent-test/<id>``), the kubelet's
root directory and pod logs, the cgroup subtree (``cgroupRoot`` ``/netagent-<id>`` in every
hierarchy), the CNI network (named ``netagent-<id>``: its veths, routes, IPAM store and libcni's
cache entries), the kubelet's iptables chains and the kernel settings it changes (both put back as
they were), and every process started for it (kubelet, containerd, its shims, the pods). The
kubelet runs on cgroup v1 hosts too (``failCgroupV1: false``; Kubernetes >= 1.35 refuses cgroup v1
unless told), with the ``cgroupfs`` driver (no systemd needed) and ``failSwapOn: false``.

No registry is used: images are OCI archives built here and imported with ``ctr``.
:func:`busybox_image` writes one from Debian's static busybox (``busybox-static``); the node's
pod sandbox ("pause") image is such an image whose shell waits for SIGTERM.

Fixture (registered through tests/conftest.py): ``real_node``, a started RealNode on ``kube_api``.

The binaries come from ``make node-assets`` (hack/node-assets/build.sh) or
``NETAGENT_NODE_ASSETS``; runc and busybox-static from Debian (scripts/bootstrap.sh). Missing
assets skip the test, or fail it under ``NETAGENT_REQUIRE_KUBE=1`` (as in tests/kube.py).

Usage::

    with RealNode(kube_api) as node:            # Node Ready when this returns
        node.import_image(busybox_image(tmp / "bb.tar", "localhost/netagent-test/busybox:1"))
        ... create pods with spec.nodeName=node.name, imagePullPolicy: Never ...
"""
from __future__ import annotations

import base64
import hashlib
import io
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import yaml

from lab.netns import require_root
from tests.kube import (
    REPO,
    ControlPlane,
    KubeAssetsMissing,
    KubeHarnessError,
    Process,
    free_port,
    kube_version,
    required,
    write_kubeconfig,
)

NODE_ASSETS_MODULE = REPO / "hack" / "node-assets"
NODE_BINARIES = (
    "kubelet", "containerd", "containerd-shim-runc-v2", "ctr",
    "cni/ptp", "cni/bridge", "cni/host-local", "cni/loopback", "cni/portmap", "cni/bandwidth",
)
RUNC = "runc"
BUSYBOX = Path("/bin/busybox")
RUN_ROOT = Path("/run/netagent-test")  # short: containerd's socket path must stay under 108 bytes
SHIM_SOCKET_DIR = Path("/run/containerd/s")  # hard-coded in containerd's shim code
CGROUP_ROOT = Path("/sys/fs/cgroup")
CNI_CACHE = Path("/var/lib/cni")  # libcni's cache (results/), not configurable through containerd
CONTAINER_LOG_LINKS = Path("/var/log/containers")  # the kubelet's symlinks; a constant in the kubelet
# the kubelet's device-plugin socket: a constant path, whatever its --root-dir (so two RealNodes at
# once would take it from each other; nothing here uses device plugins)
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
K8S_NAMESPACE = "k8s.io"  # containerd namespace of the CRI plugin
PAUSE_IMAGE = "localhost/netagent-test/pause:busybox"
BUSYBOX_IMAGE_NAME = "localhost/netagent-test/busybox:latest"
DEFAULT_POD_CIDR = "10.213.0.0/24"
# The kubelet sets these on start (protectKernelDefaults: false; true makes it refuse to start
# instead) and the CNI plugins turn on forwarding: RealNode puts the host's values back.
KERNEL_TUNABLES = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes", "net/ipv4/ip_forward")
# Chains the kubelet makes in the host's iptables (v4 and v6): the backend hint, its canary (in
# mangle, nat and filter), and KUBE-FIREWALL (filter INPUT/OUTPUT: drops non-loopback traffic to
# 127.0.0.0/8). RealNode removes those that were not there before it started.
KUBELET_CHAINS = ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY", "KUBE-FIREWALL")
STOP_GRACE_SECONDS = 10


# ---------------------------------------------------------------------------------------------
# Assets


def node_assets_dir() -> Path:
    override = os.environ.get("NETAGENT_NODE_ASSETS")
    if override:
        return Path(override)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "netagent" / "node-assets" / kube_version() / "bin"


def _static_busybox() -> bool:
    try:
        # a dynamically linked ELF names its interpreter (PT_INTERP) as a path in the file
        return BUSYBOX.is_file() and b"/lib64/ld-linux" not in BUSYBOX.read_bytes()[:8192]
    except OSError:
        return False


def find_node_assets(names: Iterable[str] = NODE_BINARIES) -> Path:
    directory = node_assets_dir()
    problems = []
    missing = [n for n in names if not os.access(directory / n, os.X_OK)]
    if missing:
        problems.append(
            f"real-node binaries missing from {directory}: {', '.join(missing)}; build them with "
            "`make node-assets` (or set NETAGENT_NODE_ASSETS to a directory holding them)"
        )
    if shutil.which(RUNC) is None:
        problems.append("runc is not installed (apt-get install runc)")
    if not _static_busybox():
        problems.append(f"no static busybox at {BUSYBOX} for the test images (apt-get install busybox-static)")
    if problems:
        raise KubeAssetsMissing("; ".join(problems))
    return directory


def require_node_assets(names: Iterable[str] = NODE_BINARIES) -> Path:
    """The node asset directory (see tests.kube.required)."""
    return required(find_node_assets, names)


IMAGE_BUILD = REPO / "hack" / "image" / "build.sh"
IMAGE_TOOLS = ("buildah", "debootstrap")


def find_image_builder(tools: Iterable[str] = IMAGE_TOOLS) -> Path:
    """hack/image/build.sh, when the tools it builds the netagent image with are installed."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise KubeAssetsMissing(f"{', '.join(missing)} not installed: the netagent image is built with "
                                f"hack/image/build.sh (apt-get install {' '.join(IMAGE_TOOLS)}; "
                                "scripts/bootstrap.sh installs them)")
    return IMAGE_BUILD


def require_image_builder() -> Path:
    """hack/image/build.sh, or skip (fail under NETAGENT_REQUIRE_KUBE=1; see tests.kube.required)."""
    return required(find_image_builder, IMAGE_TOOLS)


# ---------------------------------------------------------------------------------------------
# Images without a registry


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def busybox_image(path: Path, name: str = BUSYBOX_IMAGE_NAME, *, entrypoint: list[str] | None = None,
                  cmd: list[str] | None = None, files: dict[str, bytes] | None = None) -> Path:
    """Write an OCI image archive (``ctr images import`` reads it) holding Debian's static busybox
    with a symlink per applet in /bin, /etc/passwd and /etc/group, and `files` (path -> content).
    The archive's index names the image `name` (annotation io.containerd.image.name)."""
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, data: bytes | None = None, mode: int = 0o644, kind: bytes = tarfile.REGTYPE,
                link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.mode, info.type, info.linkname, info.mtime = mode, kind, link, 0
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)

        for d in ("bin", "etc", "proc", "sys", "dev", "tmp", "root", "var", "run"):
            add(d, mode=0o1777 if d == "tmp" else 0o755, kind=tarfile.DIRTYPE)
        add("bin/busybox", BUSYBOX.read_bytes(), mode=0o755)
        for applet in sorted(set(applets) - {"busybox"}):
            if "/" not in applet:
                add(f"bin/{applet}", kind=tarfile.SYMTYPE, link="busybox")
        add("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
        add("etc/group", b"root:x:0:\nnogroup:x:65534:\n")
        for file_path, content in sorted((files or {}).items()):
            add(file_path.lstrip("/"), content, mode=0o755)
    layer_bytes = layer.getvalue()
    config = {
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": {"Env": ["PATH=/bin"], "Entrypoint": entrypoint, "Cmd": cmd if cmd is not None else ["/bin/sh"],
                   "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [_sha256(layer_bytes)]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": _sha256(config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": _sha256(layer_bytes), "size": len(layer_bytes)}],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    index = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": manifest["mediaType"], "digest": _sha256(manifest_bytes), "size": len(manifest_bytes),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]},
        }],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as out:
        def put(member: str, data: bytes) -> None:
            info = tarfile.TarInfo(member)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            out.addfile(info, io.BytesIO(data))

        put("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        put("index.json", json.dumps(index).encode())
        for blob in (layer_bytes, config_bytes, manifest_bytes):
            put(f"blobs/sha256/{_sha256(blob).split(':')[1]}", blob)
    return path


def pause_image(path: Path, name: str = PAUSE_IMAGE) -> Path:
    """The pod sandbox image: busybox's shell as PID 1 of the pod, waiting until SIGTERM/SIGINT
    (what registry.k8s.io/pause does; a pause process reaps nothing here, as pods do not share
    their PID namespace by default)."""
    return busybox_image(path, name, entrypoint=[
        "/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done",
    ], cmd=[])


# ---------------------------------------------------------------------------------------------
# Host state helpers (all scoped to one node's own paths and names)


def _mounts_under(*roots: Path) -> list[str]:
    """Mount points at or below `roots`, deepest first (from /proc/self/mountinfo)."""
    found = []
    prefixes = [str(r.resolve()) for r in roots]
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if any(point == p or point.startswith(p + "/") for p in prefixes):
                found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def _unmount_all(*roots: Path) -> list[str]:
    """Unmount everything under `roots`; returns what could not be unmounted."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    MNT_DETACH = 2
    for _ in range(3):
        left = _mounts_under(*roots)
        for point in left:
            if libc.umount2(point.encode(), 0) != 0:
                libc.umount2(point.encode(), MNT_DETACH)
        if not _mounts_under(*roots):
            return []
    return _mounts_under(*roots)


def _pids_with_arg(argument: str) -> list[int]:
    """PIDs whose command line contains `argument` as one argument (e.g. our containerd socket)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argument.encode() in args:
            pids.append(int(entry.name))
    return pids


def _cgroup_dirs(cgroup_root: str) -> list[Path]:
    """Our cgroup subtree's top directory in every mounted hierarchy (v1 and the unified one)."""
    return [d / cgroup_root.strip("/") for d in CGROUP_ROOT.iterdir()
            if d.is_dir() and (d / cgroup_root.strip("/")).is_dir()]


def _cgroup_pids(cgroup_root: str) -> set[int]:
    pids: set[int] = set()
    for top in _cgroup_dirs(cgroup_root):
        for procs in top.rglob("cgroup.procs"):
            try:
                pids.update(int(p) for p in procs.read_text().split())
            except (OSError, ValueError):
                pass
    return pids


def _remove_cgroups(cgroup_root: str) -> list[str]:
    """rmdir the subtree (deepest first) in every hierarchy; returns what is left."""
    left = []
    for top in _cgroup_dirs(cgroup_root):
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [top]:
            for _ in range(20):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                left.append(str(d))
    return left


def _create_cgroup_root(cgroup_root: str) -> None:
    """The kubelet refuses a cgroupRoot that does not exist: make it in every v1 hierarchy (cpuset
    needs its cpus and mems copied from the parent before anything can join it)."""
    for d in CGROUP_ROOT.iterdir():
        if not d.is_dir() or not (d / "cgroup.procs").exists() or d.name == "unified":
            continue
        target = d / cgroup_root.strip("/")
        target.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (target / knob).exists() and not (target / knob).read_text().strip():
                (target / knob).write_text((d / knob).read_text())


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _log_errors(process: Process, lines: int = 8) -> str:
    """The last error lines of a kubelet (klog E/F) or containerd (level=error/fatal) log, else its tail."""
    try:
        text = process.log_file.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in text if line[:1] in ("E", "F") and line[1:2].isdigit()
              or "level=error" in line or "level=fatal" in line]
    return "\n".join((errors or text)[-lines:])


def _read_tunables() -> dict[str, str]:
    values = {}
    for name in KERNEL_TUNABLES:
        try:
            values[name] = (Path("/proc/sys") / name).read_text().strip()
        except OSError:
            pass
    return values


def _restore_tunables(saved: dict[str, str]) -> list[str]:
    failed = []
    for name, value in saved.items():
        path = Path("/proc/sys") / name
        try:
            if path.read_text().strip() != value:
                path.write_text(value)
        except OSError as e:
            failed.append(f"sysctl {name}={value}: {e}")
    return failed


def _kubelet_chains() -> set[tuple[str, str, str]]:
    """(tool, table, chain) for the kubelet's chains present now."""
    found = set()
    for tool in ("iptables", "ip6tables"):
        for table in ("mangle", "nat", "filter"):
            out = subprocess.run([tool, "-w", "-t", table, "-S"], capture_output=True, text=True).stdout
            for line in out.splitlines():
                fields = line.split()
                if fields[:1] == ["-N"] and fields[1] in KUBELET_CHAINS:
                    found.add((tool, table, fields[1]))
    return found


def _remove_chains(chains: Iterable[tuple[str, str, str]]) -> list[str]:
    """Delete the jumps to these chains, then flush and delete them."""
    import shlex

    failed = []
    for tool, table, chain in sorted(chains):
        out = subprocess.run([tool, "-w", "-t", table, "-S"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            rule = shlex.split(line)
            if rule[:1] == ["-A"] and rule[1] != chain and "-j" in rule and rule[rule.index("-j") + 1] == chain:
                subprocess.run([tool, "-w", "-t", table, "-D", *rule[1:]], capture_output=True)
        for op in ("-F", "-X"):
            done = subprocess.run([tool, "-w", "-t", table, op, chain], capture_output=True, text=True)
            if done.returncode:
                failed.append(f"{tool} -t {table} {op} {chain}: {done.stderr.strip()}")
                break
    return failed


def _default_route_ip() -> str:
    """The source address of the default route (the kubelet's node IP must be a non-loopback
    address of the host; it is only registered, no traffic is sent to it by these tests)."""
    out = subprocess.run(["ip", "-j", "route", "get", "192.0.2.255"], capture_output=True, text=True)
    try:
        return json.loads(out.stdout)[0]["prefsrc"]
    except (ValueError, LookupError, KeyError):
        raise KubeHarnessError(f"cannot find the host's default-route address: {out.stderr.strip()}") from None


# ---------------------------------------------------------------------------------------------
# The node


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
            self.node_ip = self.node_ip or _default_route_ip()
            self._tunables = _read_tunables()
            self._chains_before = _kubelet_chains()
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
        _kill(_pids_with_arg(str(self.socket)))  # shims outlive containerd by design
        self._remove_shim_sockets()
        self.processes.clear()
        _kill(_cgroup_pids(self.cgroup_root))
        leftovers += [f"mount {m}" for m in _unmount_all(self.workdir, self.run_dir)]
        leftovers += [f"cgroup {c}" for c in _remove_cgroups(self.cgroup_root)]
        if self.cni == "bridge":
            subprocess.run(["ip", "link", "del", self.bridge_name], capture_output=True)
        if self._chains_before is not None:
            leftovers += _remove_chains(_kubelet_chains() - self._chains_before)
        leftovers += _restore_tunables(self._tunables)
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
                        f"{process.name} exited with code {code}; log: {self._kept_log(process)}\n{_log_errors(process)}"
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
                    f"kubelet log: {self._kept_log(kubelet)}\n{_log_errors(kubelet) if kubelet else ''}"
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
                    f"containerd did not start; log: {self._kept_log(containerd)}\n{_log_errors(containerd)}"
                )
            time.sleep(0.2)

    def _start_kubelet(self) -> None:
        api = self.api
        _create_cgroup_root(self.cgroup_root)
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


@pytest.fixture
def real_node(kube_api: ControlPlane) -> Iterator[RealNode]:
    """A RealNode (ptp + host-local) on the session's control plane, Ready; torn down after the test."""
    require_root()
    require_node_assets()
    node = RealNode(kube_api)
    node.start()
    try:
        yield node
    finally:
        node.stop()
