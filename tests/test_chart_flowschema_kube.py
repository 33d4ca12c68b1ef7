"""The chart's FlowSchemas (templates/flowschema.yaml, `controller.flowSchemas`) on a real kube-apiserver.

The API server accepts deploy/base/flowschema.yaml (rendered from the chart) and classifies requests as
it says: the controller's Lease requests in its namespace go to the leader-election priority level, its
other requests (a TokenReview, a Lease elsewhere) to workload-high; another service account's (an
agent's) stay in workload-low with every service account, as the controller's did without them. Read
from the X-Kubernetes-PF-FlowSchema-UID and -PriorityLevel-UID headers the API server sets on every
response it classified (also on a 403 or a 404: priority and fairness run before authorization).
"""
from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import yaml
from kubernetes import client

from lab.procs import wait_for
from tests.kube import REPO, sa_token

CONTROLLER_SA = "netagent-controller"  # the chart's controller ServiceAccount for release netagent


def flowschemas(namespace: str) -> list[dict]:
    """deploy/base/flowschema.yaml moved to a test's namespace (names suffixed with it: they are cluster-wide)."""
    docs = [d for d in yaml.safe_load_all((REPO / "deploy" / "base" / "flowschema.yaml").read_text()) if d]
    for d in docs:
        d["metadata"]["name"] += f"-{namespace}"
        for rule in d["spec"]["rules"]:
            for subject in rule["subjects"]:
                subject["serviceAccount"]["namespace"] = namespace
            for r in rule["resourceRules"]:
                if r.get("namespaces") != ["*"]:
                    r["namespaces"] = [namespace]
    return docs


def classified(kube_api, token: str, method: str, path: str, body: dict | None = None) -> tuple[str, str]:
    """(FlowSchema UID, PriorityLevelConfiguration UID) the API server classified a request under."""
    context = ssl.create_default_context(cafile=str(kube_api.ca_file))
    req = urllib.request.Request(kube_api.url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=15, context=context) as r:
            headers = r.headers
    except urllib.error.HTTPError as exc:
        headers = exc.headers
    return headers.get("X-Kubernetes-PF-FlowSchema-UID", ""), headers.get("X-Kubernetes-PF-PriorityLevel-UID", "")


def test_the_controllers_leases_go_to_leader_election_and_its_other_requests_to_workload_high(kube_api, kube_namespace):
    ns = kube_namespace
    core = client.CoreV1Api(kube_api.admin)
    apf = client.FlowcontrolApiserverV1Api(kube_api.admin)
    tokens = {name: sa_token(core, ns, name) for name in (CONTROLLER_SA, "netagent-agent")}
    level = {name: apf.read_priority_level_configuration(name).metadata.uid
             for name in ("leader-election", "workload-high", "workload-low")}
    lease = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/netagent-controller"
    review = ("/apis/authentication.k8s.io/v1/tokenreviews",
              {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": "x"}})
    ctl = tokens[CONTROLLER_SA]
    # without them: the controller's renewals queue in workload-low with every service account's requests
    assert classified(kube_api, ctl, "GET", lease)[1] == level["workload-low"]
    made = []
    try:
        for doc in flowschemas(ns):
            made.append(apf.create_flow_schema(doc).metadata)
        uid = {m.name.removesuffix(f"-{ns}"): m.uid for m in made}
        # the API server's priority and fairness config controller takes new schemas within a few seconds
        wait_for(lambda: classified(kube_api, ctl, "GET", lease)[0] == uid["netagent-controller-leader-election"],
                 30, 0.5, "the leader-election FlowSchema in force")
        for method in ("GET", "PUT"):
            assert classified(kube_api, ctl, method, lease) == (uid["netagent-controller-leader-election"],
                                                                level["leader-election"]), method
        workload = (uid["netagent-controller"], level["workload-high"])
        assert classified(kube_api, ctl, "POST", *review) == workload
        # a Lease outside its namespace is no renewal of its own: workload-high, not leader-election
        assert classified(kube_api, ctl, "GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases/x") == workload
        # an agent (any other service account) is left where it was
        agent = tokens["netagent-agent"]
        for method, path in (("GET", lease), ("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-0")):
            schema, pl = classified(kube_api, agent, method, path)
            assert schema not in uid.values() and pl == level["workload-low"], path
    finally:
        for m in made:
            apf.delete_flow_schema(m.name)
