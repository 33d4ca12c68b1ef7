"""Where a real node's binaries and the image builder come from, and the constants of a node's paths,
images and host state (see tests/node/__init__.py)."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from lab.kube import cached_bin_dir
from tests.kube import REPO, KubeAssetsMissing, required


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


def node_assets_dir() -> Path:
    return cached_bin_dir("NETAGENT_NODE_ASSETS", "node-assets")


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
