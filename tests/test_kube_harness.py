"""The Kubernetes test harness (tests/kube.py) against the real apiserver: the behaviours the agent
and the controller rely on, and the harness's own failure modes."""
from __future__ import annotations

import datetime
import functools
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from lab import procs

from tests.kube import (
    ASSETS_MODULE,
    CONTROL_PLANE_BINARIES,
    SERVICE_ACCOUNT_ISSUER,
    ControlPlane,
    KubeHarnessError,
    decode_jwt_claims,
    encode_rs256_jwt,
    free_port,
    require_assets,
)

pytestmark = pytest.mark.kube
AUDIENCE = "netagent-controller"


# the harness waits longer than the lab by default: an apiserver on a busy 2-core machine
wait_for = functools.partial(procs.wait_for, timeout=60, interval=0.2)


def pod_manifest(name: str, node: str | None = None, service_account: str = "default") -> dict:
    spec = {
        "serviceAccountName": service_account,
        "containers": [{"name": "main", "image": "registry.invalid/pause:1"}],
    }
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


# ---------------------------------------------------------------------------------------------
# Pods and watches


def test_watch_with_node_field_selector_sees_only_that_nodes_pods(kube_api, kube_namespace):
    core = client.CoreV1Api(kube_api.admin)
    start = core.list_namespaced_pod(kube_namespace).metadata.resource_version
    # The other node's pod is written first: had the selector let it through, it would arrive first.
    core.create_namespaced_pod(kube_namespace, pod_manifest("on-b", node="node-b"))
    core.create_namespaced_pod(kube_namespace, pod_manifest("on-a", node="node-a"))

    seen = []
    for event in watch.Watch().stream(
        core.list_namespaced_pod, kube_namespace, field_selector="spec.nodeName=node-a",
        resource_version=start, allow_watch_bookmarks=True, timeout_seconds=30,
    ):
        if event["type"] == "BOOKMARK":
            continue
        seen.append((event["type"], event["object"].metadata.name))
        if event["object"].metadata.name == "on-a":
            break
    assert seen == [("ADDED", "on-a")]


@pytest.fixture(scope="module")
def uncached_api():
    """A second control plane whose apiserver has no watch cache. With the cache (the default),
    watches are served from the apiserver's memory and a recent resourceVersion stays watchable
    after an etcd compaction; without it they go to etcd, and the compaction is what they meet."""
    assets = require_assets(CONTROL_PLANE_BINARIES)
    with ControlPlane(assets, extra_apiserver_args=["--watch-cache=false"]) as control_plane:
        yield control_plane


def test_watch_from_compacted_resource_version_gets_410_and_relists(uncached_api):
    kube_api = uncached_api
    kube_namespace = kube_api.create_namespace()
    core = client.CoreV1Api(kube_api.admin)
    core.create_namespaced_pod(kube_namespace, pod_manifest("before", node="node-a"))
    old_version = core.list_namespaced_pod(kube_namespace).metadata.resource_version
    for i in range(5):
        core.create_namespaced_pod(kube_namespace, pod_manifest(f"churn-{i}", node="node-a"))
    kube_api.compact_etcd()

    def reflector_sync(resource_version: str) -> tuple[set[str], str, bool]:
        """List-then-watch as the agent does: a 410 on the watch makes it relist."""
        names: set[str] = set()
        try:
            for event in watch.Watch().stream(
                core.list_namespaced_pod, kube_namespace, resource_version=resource_version, timeout_seconds=5,
            ):
                names.add(event["object"].metadata.name)
            return names, resource_version, False
        except ApiException as e:
            assert e.status == 410, e
            relisted = core.list_namespaced_pod(kube_namespace)
            return {p.metadata.name for p in relisted.items}, relisted.metadata.resource_version, True

    names, resumed_from, gone = reflector_sync(old_version)
    assert gone, "a watch from a compacted resourceVersion must answer 410 Gone"
    assert names == {"before"} | {f"churn-{i}" for i in range(5)}
    # The relisted resourceVersion is current: a watch from it works and sees new pods.
    core.create_namespaced_pod(kube_namespace, pod_manifest("after", node="node-a"))
    for event in watch.Watch().stream(
        core.list_namespaced_pod, kube_namespace, resource_version=resumed_from, timeout_seconds=30,
    ):
        if event["object"].metadata.name == "after":
            assert event["type"] == "ADDED"
            break
    else:
        raise AssertionError("the watch resumed from the relisted resourceVersion missed a new pod")


def test_watch_resumed_across_apiserver_restart_gets_410(kube_api, kube_namespace):
    core = client.CoreV1Api(kube_api.admin)
    core.create_namespaced_pod(kube_namespace, pod_manifest("survivor", node="node-a"))
    old_version = core.list_namespaced_pod(kube_namespace).metadata.resource_version
    core.create_namespaced_pod(kube_namespace, pod_manifest("later", node="node-a"))

    kube_api.restart_apiserver()
    with pytest.raises(ApiException) as gone:
        for _ in watch.Watch().stream(core.list_namespaced_pod, kube_namespace, resource_version=old_version,
                                      timeout_seconds=5):
            pass
    assert gone.value.status == 410
    assert {p.metadata.name for p in core.list_namespaced_pod(kube_namespace).items} == {"survivor", "later"}


# ---------------------------------------------------------------------------------------------
# Service-account tokens


def review(kube_api, token: str, audiences=(AUDIENCE,)):
    auth = client.AuthenticationV1Api(kube_api.admin)
    body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=list(audiences)))
    return auth.create_token_review(body).status


@pytest.fixture
def bound_pod(kube_api, kube_namespace):
    core = client.CoreV1Api(kube_api.admin)
    node = f"node-{uuid.uuid4().hex[:6]}"
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node)))
    core.create_namespaced_service_account(kube_namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="agent")))
    core.create_namespaced_pod(kube_namespace, pod_manifest("agent-x", node=node, service_account="agent"))
    yield kube_namespace, "agent-x", node
    core.delete_node(node)


def test_bound_token_passes_review_with_pod_and_node(kube_api, bound_pod):
    namespace, pod, node = bound_pod
    token = kube_api.token_for_pod(namespace, "agent", pod, audiences=[AUDIENCE])
    status = review(kube_api, token)
    assert status.authenticated, status.error
    assert status.user.username == f"system:serviceaccount:{namespace}:agent"
    assert status.user.extra["authentication.kubernetes.io/pod-name"] == [pod]
    assert status.user.extra["authentication.kubernetes.io/node-name"] == [node]
    assert status.audiences == [AUDIENCE]
    assert decode_jwt_claims(token)["kubernetes.io"]["node"]["name"] == node
    # Another audience does not accept it.
    assert not review(kube_api, token, audiences=["someone-else"]).authenticated


def test_forged_expired_and_orphaned_tokens_fail_review(kube_api, bound_pod):
    from cryptography.hazmat.primitives.asymmetric import rsa

    namespace, pod, _ = bound_pod
    token = kube_api.token_for_pod(namespace, "agent", pod, audiences=[AUDIENCE])
    claims = decode_jwt_claims(token)

    forged = encode_rs256_jwt(claims, rsa.generate_private_key(public_exponent=65537, key_size=2048))
    assert not review(kube_api, forged).authenticated

    now = int(time.time())
    expired_claims = {**claims, "iat": now - 7200, "nbf": now - 7200, "exp": now - 3600}
    expired = kube_api.sign_service_account_token(expired_claims)
    status = review(kube_api, expired)
    assert not status.authenticated
    assert "expired" in status.error

    # A token bound to a pod dies with the pod.
    client.CoreV1Api(kube_api.admin).delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    wait_for(lambda: not review(kube_api, token).authenticated, what="the deleted pod's token to be refused")


# ---------------------------------------------------------------------------------------------
# RBAC


def test_service_account_with_narrow_cluster_role_gets_403(kube_api, kube_namespace):
    core = client.CoreV1Api(kube_api.admin)
    rbac = client.RbacAuthorizationV1Api(kube_api.admin)
    role = f"pod-reader-{kube_namespace}"
    rbac.create_cluster_role({
        "metadata": {"name": role},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    })
    core.create_namespaced_service_account(kube_namespace, {"metadata": {"name": "reader"}})
    rbac.create_cluster_role_binding({
        "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": kube_namespace}],
    })
    try:
        token = core.create_namespaced_service_account_token(
            "reader", kube_namespace, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[SERVICE_ACCOUNT_ISSUER]))
        ).status.token
        reader = client.CoreV1Api(kube_api.client_for_token(token))
        wait_for(lambda: _can_list(reader, kube_namespace), what="the ClusterRoleBinding to take effect")
        with pytest.raises(ApiException) as refused:
            reader.create_namespaced_pod(kube_namespace, pod_manifest("nope"))
        assert refused.value.status == 403
        assert 'cannot create resource "pods"' in json.loads(refused.value.body)["message"]

        who = f"--as=system:serviceaccount:{kube_namespace}:reader"
        assert kube_api.kubectl("auth", "can-i", "list", "pods", who).stdout.strip() == "yes"
        denied = kube_api.kubectl("auth", "can-i", "delete", "pods", who, check=False)
        assert denied.returncode == 1 and denied.stdout.strip() == "no"
    finally:
        rbac.delete_cluster_role_binding(role)
        rbac.delete_cluster_role(role)


def _can_list(api: client.CoreV1Api, namespace: str) -> bool:
    try:
        api.list_namespaced_pod(namespace)
        return True
    except ApiException as e:
        if e.status == 403:
            return False
        raise


# ---------------------------------------------------------------------------------------------
# CRDs and Leases


def test_crd_schema_rejects_invalid_object_with_apiserver_message(kube_api):
    group = f"t{uuid.uuid4().hex[:8]}.netagent.io"
    name = f"widgets.{group}"
    extensions = client.ApiextensionsV1Api(kube_api.admin)
    extensions.create_custom_resource_definition({
        "metadata": {"name": name},
        "spec": {
            "group": group,
            "scope": "Cluster",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [{
                "name": "v1alpha1", "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {"spec": {
                        "type": "object",
                        "required": ["weight"],
                        "properties": {"weight": {"type": "integer", "minimum": 1}},
                    }},
                }},
            }],
        },
    })
    try:
        def established():
            crd = extensions.read_custom_resource_definition(name)
            return any(c.type == "Established" and c.status == "True" for c in (crd.status.conditions or []))

        wait_for(established, what=f"CRD {name} to be Established")
        objects = client.CustomObjectsApi(kube_api.admin)
        create = lambda body: objects.create_cluster_custom_object(group, "v1alpha1", "widgets", body)  # noqa: E731
        create({"apiVersion": f"{group}/v1alpha1", "kind": "Widget", "metadata": {"name": "ok"}, "spec": {"weight": 3}})
        with pytest.raises(ApiException) as rejected:
            create({"apiVersion": f"{group}/v1alpha1", "kind": "Widget", "metadata": {"name": "bad"}, "spec": {"weight": 0}})
        assert rejected.value.status == 422
        message = json.loads(rejected.value.body)["message"]
        assert "spec.weight: Invalid value: 0: spec.weight in body should be greater than or equal to 1" in message
    finally:
        extensions.delete_custom_resource_definition(name)


def _micro_time(when: datetime.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_micro_time(value) -> datetime.datetime:
    if isinstance(value, datetime.datetime):
        return value
    return datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc)


def try_acquire_or_renew(leases: client.CoordinationV1Api, namespace: str, name: str, holder: str, duration: int) -> bool:
    """client-go's leader-election step: take the Lease if free or expired, renew it if ours."""
    now = datetime.datetime.now(datetime.timezone.utc)
    try:
        lease = leases.read_namespaced_lease(name, namespace)
    except ApiException as e:
        if e.status != 404:
            raise
        body = {"metadata": {"name": name}, "spec": {
            "holderIdentity": holder, "leaseDurationSeconds": duration,
            "acquireTime": _micro_time(now), "renewTime": _micro_time(now), "leaseTransitions": 0,
        }}
        try:
            leases.create_namespaced_lease(namespace, body)
            return True
        except ApiException as conflict:
            if conflict.status == 409:
                return False
            raise
    spec = lease.spec
    expires = _parse_micro_time(spec.renew_time) + datetime.timedelta(seconds=spec.lease_duration_seconds)
    ours = spec.holder_identity == holder
    if not ours and now < expires:
        return False
    body = {"metadata": {"name": name, "resourceVersion": lease.metadata.resource_version}, "spec": {
        "holderIdentity": holder, "leaseDurationSeconds": duration, "renewTime": _micro_time(now),
        "acquireTime": _micro_time(_parse_micro_time(spec.acquire_time) if ours else now),
        "leaseTransitions": (spec.lease_transitions or 0) + (0 if ours else 1),
    }}
    try:
        leases.replace_namespaced_lease(name, namespace, body)
        return True
    except ApiException as e:
        if e.status == 409:  # someone else wrote it first
            return False
        raise


def test_lease_acquired_renewed_and_taken_over_after_expiry(kube_api, kube_namespace):
    leases = client.CoordinationV1Api(kube_api.admin)
    duration = 2
    assert try_acquire_or_renew(leases, kube_namespace, "leader", "replica-a", duration)
    first = leases.read_namespaced_lease("leader", kube_namespace)
    assert not try_acquire_or_renew(leases, kube_namespace, "leader", "replica-b", duration)
    assert try_acquire_or_renew(leases, kube_namespace, "leader", "replica-a", duration)
    renewed = leases.read_namespaced_lease("leader", kube_namespace)
    assert renewed.spec.holder_identity == "replica-a"
    assert renewed.spec.renew_time > first.spec.renew_time
    assert renewed.spec.lease_transitions == 0

    # replica-a stops renewing; once the lease has expired replica-b takes it.
    wait_for(lambda: try_acquire_or_renew(leases, kube_namespace, "leader", "replica-b", duration),
             timeout=30, what="replica-b to take over the expired lease")
    taken = leases.read_namespaced_lease("leader", kube_namespace)
    assert taken.spec.holder_identity == "replica-b"
    assert taken.spec.lease_transitions == 1
    # A write based on the old version loses: optimistic concurrency through resourceVersion.
    stale = {"metadata": {"name": "leader", "resourceVersion": renewed.metadata.resource_version},
             "spec": {"holderIdentity": "replica-a", "leaseDurationSeconds": duration}}
    with pytest.raises(ApiException) as conflict:
        leases.replace_namespaced_lease("leader", kube_namespace, stale)
    assert conflict.value.status == 409


# ---------------------------------------------------------------------------------------------
# Cluster: kwok nodes, controllers, scheduler


def test_daemonset_runs_one_pod_per_kwok_node(kube_api, kube_cluster, kube_namespace):
    nodes = kube_cluster.add_nodes(20, prefix=f"ds-{kube_namespace}")
    kube_cluster.wait_ready(nodes)
    apps = client.AppsV1Api(kube_api.admin)
    labels = {"app": "probe"}
    apps.create_namespaced_daemon_set(kube_namespace, {
        "metadata": {"name": "probe"},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"type": "kwok"},
                    "containers": [{"name": "main", "image": "registry.invalid/pause:1"}],
                },
            },
        },
    })
    core = client.CoreV1Api(kube_api.admin)

    def running_pods():
        pods = core.list_namespaced_pod(kube_namespace, label_selector="app=probe").items
        running = [p for p in pods if p.status.phase == "Running" and p.status.pod_ip and p.spec.node_name in nodes]
        return running if len(running) == len(nodes) else None

    running = wait_for(running_pods, timeout=120, what="20 DaemonSet pods Running")
    assert sorted(p.spec.node_name for p in running) == sorted(nodes)
    assert len({p.status.pod_ip for p in running}) == len(nodes)
    # The DaemonSet controller writes its status after the pods run, so read it once it counts
    # them all, and then check that it schedules exactly one per node.
    def counted_status():
        status = apps.read_namespaced_daemon_set_status("probe", kube_namespace).status
        return status if status.number_ready == len(nodes) else None

    status = wait_for(counted_status, timeout=60, what="the DaemonSet status to count 20 ready pods")
    assert status.desired_number_scheduled == len(nodes)
    assert status.current_number_scheduled == len(nodes)


# ---------------------------------------------------------------------------------------------
# Bad input: the harness fails clearly, in bounded time, leaving nothing behind


def processes_mentioning(path: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(path).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def assert_start_fails_cleanly(control_plane: ControlPlane, *expected: str) -> str:
    with pytest.raises(KubeHarnessError) as failure:
        control_plane.start()
    message = str(failure.value)
    for text in expected:
        assert text in message
    log = Path(message.split("log: ", 1)[1].split()[0])
    try:
        assert log.is_file(), f"the error names a log that is not there: {log}"
        assert not control_plane.workdir.exists()
        assert processes_mentioning(control_plane.workdir) == []
    finally:
        shutil.rmtree(log.parent, ignore_errors=True)
    return message


def test_apiserver_port_taken_is_a_clear_error_with_cleanup():
    assets = require_assets(CONTROL_PLANE_BINARIES)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        control_plane = ControlPlane(assets, apiserver_port=port, ready_timeout=60)
        message = assert_start_fails_cleanly(control_plane, "kube-apiserver exited with code")
    assert "address already in use" in message


def test_apiserver_that_never_becomes_ready_times_out_with_cleanup():
    assets = require_assets(CONTROL_PLANE_BINARIES)
    nobody = f"http://127.0.0.1:{free_port()}"
    control_plane = ControlPlane(assets, etcd_servers=nobody, ready_timeout=5)
    assert_start_fails_cleanly(control_plane, "kube-apiserver did not become ready within 5 s", "connection refused")


def test_missing_assets_skip_with_build_hint_or_fail_when_required(tmp_path, monkeypatch):
    monkeypatch.setenv("NETAGENT_KUBE_ASSETS", str(tmp_path))
    monkeypatch.delenv("NETAGENT_REQUIRE_KUBE", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        require_assets(CONTROL_PLANE_BINARIES)
    assert "make kube-assets" in str(skipped.value) and str(tmp_path) in str(skipped.value)
    monkeypatch.setenv("NETAGENT_REQUIRE_KUBE", "1")
    with pytest.raises(pytest.fail.Exception) as failed:
        require_assets(CONTROL_PLANE_BINARIES)
    assert "make kube-assets" in str(failed.value)


# ---------------------------------------------------------------------------------------------
# Bad input: building the assets


def run_build(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {
        "HOME": str(tmp_path), "PATH": os.environ["PATH"],
        "NETAGENT_KUBE_ASSETS": str(tmp_path / "bin"), **env,
    }
    return subprocess.run(["bash", str(ASSETS_MODULE / "build.sh")], env=environment,
                          capture_output=True, text=True, timeout=120)


def test_build_without_go_says_so(tmp_path):
    go = shutil.which("go")
    path = ":".join(d for d in os.environ["PATH"].split(":") if not go or Path(d) != Path(go).parent)
    result = run_build(tmp_path, PATH=path)
    assert result.returncode == 1
    assert "Go is not installed" in result.stderr


def test_build_with_old_go_says_so(tmp_path):
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "go").write_text('#!/bin/sh\n[ "$1 $2" = "env GOVERSION" ] && echo go1.20.1\n')
    (fake / "go").chmod(0o755)
    result = run_build(tmp_path, PATH=f"{fake}:{os.environ['PATH']}")
    assert result.returncode == 1
    assert "Go 1.20.1 is too old" in result.stderr


def test_build_with_unreachable_module_proxy_says_so(tmp_path):
    if not shutil.which("go"):
        pytest.fail("this test needs Go on PATH, as `make kube-assets` does")
    closed = f"http://127.0.0.1:{free_port()}"
    result = run_build(tmp_path, GOPROXY=closed, GOMODCACHE=str(tmp_path / "mod"), GOCACHE=str(tmp_path / "cache"),
                       GOSUMDB="off")
    assert result.returncode == 1
    assert "module proxy" in result.stderr and closed in result.stderr
    assert "full log:" in result.stderr
    subprocess.run(["chmod", "-R", "u+w", str(tmp_path)], check=False)  # the module cache is read-only
