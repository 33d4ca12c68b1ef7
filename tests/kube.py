"""The real Kubernetes control plane of lab/kube.py as pytest fixtures.

Fixtures (registered for every test module through tests/conftest.py):

- ``kube_api`` (session): etcd and kube-apiserver on loopback, ephemeral ports, a temporary data
  directory, ``--authorization-mode=Node,RBAC``, service-account signing keys (TokenRequest and
  TokenReview work; bound tokens carry pod and node claims), an admin client certificate
  (O=system:masters) and its kubeconfig. Returns a :class:`ControlPlane`.
- ``kube_namespace``: a fresh namespace (with its ``default`` ServiceAccount) per test, deleted after.
- ``kube_cluster`` (session): kube-controller-manager, kube-scheduler and kwok on the same
  apiserver; kwok turns Nodes annotated ``kwok.x-k8s.io/node=fake`` Ready and runs their pods
  (Running, with an IP). Returns a :class:`Cluster`.

Missing binaries skip the test with a message saying how to build them, unless
``NETAGENT_REQUIRE_KUBE=1`` (set by .ci/run), which makes them fail it.
Tests that use these fixtures are marked ``kube`` (and ``cluster``) automatically.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client

# The harness lives in lab/kube.py (the benchmarks use it too); the tests import it from here.
from lab.kube import (  # noqa: F401
    ASSETS_MODULE,
    CLUSTER_BINARIES,
    CONTROL_PLANE_BINARIES,
    REPO,
    SERVICE_ACCOUNT_ISSUER,
    Cluster,
    ControlPlane,
    KubeAssetsMissing,
    KubeHarnessError,
    Process,
    decode_jwt_claims,
    encode_rs256_jwt,
    find_assets,
    free_port,
    kube_version,
    write_kubeconfig,
)


def required(find, names: Iterable[str]) -> Path:
    """`find(names)`'s asset directory, or skip (fail under NETAGENT_REQUIRE_KUBE=1) when something
    is missing: the one rule for every test that needs built binaries."""
    try:
        return find(names)
    except KubeAssetsMissing as e:
        if os.environ.get("NETAGENT_REQUIRE_KUBE") == "1":
            pytest.fail(f"{e} (NETAGENT_REQUIRE_KUBE=1)", pytrace=False)
        pytest.skip(str(e))


def require_assets(names: Iterable[str]) -> Path:
    """The Kubernetes asset directory (see `required`)."""
    return required(find_assets, names)


def deployed_rbac(name: str, namespace: str) -> list[dict]:
    """deploy/base/<name> (rendered from the chart into netagent-system) moved into a test's
    namespace: its namespaced objects and ServiceAccount subjects there, its cluster-scoped
    objects suffixed with the namespace so tests never collide."""
    docs = [d for d in yaml.safe_load_all((REPO / "deploy" / "base" / name).read_text()) if d]
    for d in docs:
        if "namespace" in d["metadata"]:
            d["metadata"]["namespace"] = namespace
        if d["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            d["metadata"]["name"] += f"-{namespace}"
        if d["kind"] in ("ClusterRoleBinding", "RoleBinding"):
            if d["roleRef"]["kind"] == "ClusterRole":
                d["roleRef"]["name"] += f"-{namespace}"
            for subject in d["subjects"]:
                subject["namespace"] = namespace
    return docs


def sa_token(core, namespace: str, name: str) -> str:
    """A new ServiceAccount `name` in `namespace` and a token for it (an hour)."""
    core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    return core.create_namespaced_service_account_token(name, namespace, {"spec": {"expirationSeconds": 3600}}).status.token


# ---------------------------------------------------------------------------------------------
# pytest wiring


def pytest_collection_modifyitems(items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "kube_cluster" in fixtures:
            item.add_marker(pytest.mark.cluster)
        if fixtures & {"kube_api", "kube_namespace", "kube_cluster"}:
            item.add_marker(pytest.mark.kube)


@pytest.fixture(scope="session")
def kube_api() -> Iterator[ControlPlane]:
    assets = require_assets(CONTROL_PLANE_BINARIES)
    control_plane = ControlPlane(assets)
    try:
        control_plane.start()
    except KubeHarnessError as e:
        # Free ports are picked by binding and releasing them; another process can win the race.
        if "address already in use" not in str(e):
            raise
        control_plane = ControlPlane(assets)
        control_plane.start()
    try:
        yield control_plane
    finally:
        control_plane.stop()


@pytest.fixture
def kube_namespace(kube_api: ControlPlane) -> Iterator[str]:
    name = kube_api.create_namespace()
    try:
        yield name
    finally:
        client.CoreV1Api(kube_api.admin).delete_namespace(name)


@pytest.fixture(scope="session")
def kube_cluster(kube_api: ControlPlane) -> Iterator[Cluster]:
    require_assets(CLUSTER_BINARIES)
    cluster = Cluster(kube_api)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
