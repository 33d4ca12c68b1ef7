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

Laid out by concern: assets.py (where binaries and the image builder come from, the paths and
names a node uses), images.py (OCI images without a registry), host.py (host state helpers, each
scoped to one node), realnode.py (RealNode). This module re-exports what tests use.

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

from collections.abc import Iterator

import pytest

from lab.netns import require_root
from tests.kube import ControlPlane
from tests.node.assets import (
    BUSYBOX_IMAGE_NAME,
    PAUSE_IMAGE,
    find_image_builder,
    find_node_assets,
    node_assets_dir,
    require_image_builder,
    require_node_assets,
)
from tests.node.images import busybox_image, pause_image
from tests.node.realnode import RealNode

__all__ = ["BUSYBOX_IMAGE_NAME", "PAUSE_IMAGE", "RealNode", "busybox_image", "find_image_builder", "find_node_assets",
           "node_assets_dir", "pause_image", "real_node", "require_image_builder", "require_node_assets"]


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
