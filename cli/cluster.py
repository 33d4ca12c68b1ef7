"""`netagent status --kubeconfig`: gather the cluster view (all the I/O; cli/clusterview.py renders it).

From the API server, with the user's kubeconfig: the EgressBudgets and EgressClasses (spec and
status), the agent and controller pods of the namespace, the controller's Lease, recent Warning
Events. From the controller: GET /readyz (open) and GET /v1/status (controller/view.py), asked of
the leader at the address its Lease names (or --controller, e.g. a `kubectl port-forward`), with the
kubeconfig's bearer token over verified TLS only (the CA from --controller-ca, else the ca.crt of
the controller's TLS Secret). Every call has a timeout; a failure is recorded in the snapshot as a
problem, never raised, so the view prints whatever it could read.
"""
from __future__ import annotations

import base64
import datetime as dt
import json
import ssl
import urllib.error
import urllib.request

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from core.kubeapi import GROUP, VERSION

API_TIMEOUT = (5.0, 10.0)  # (connect, read) seconds for each API server call
CONTROLLER_TIMEOUT = 5.0  # seconds for each controller call
DEFAULT_NAMESPACE = "netagent-system"
DEFAULT_LEASE = "netagent-controller"
DEFAULT_TLS_SECRET = "netagent-controller-tls"
AGENT_SELECTOR = "app.kubernetes.io/part-of=netagent,app.kubernetes.io/component=agent"
CONTROLLER_SELECTOR = "app.kubernetes.io/part-of=netagent,app.kubernetes.io/component=controller"
MAX_EVENTS = 500


class Snapshot:
    """The facts read, and the problems met while reading them (a plain dict at the end)."""

    def __init__(self, **head):
        self.data = {"schema": "netagent.io/status-snapshot/v1", **head, "problems": []}

    def problem(self, kind: str, message: str, **detail) -> None:
        self.data["problems"].append({"kind": kind, "message": message, **detail})

    def read(self, what: str, verb: str, resource: str, call, scope: str = "cluster scope"):
        """`call()`'s result, or None with the problem recorded: 403 names the verb and resource
        denied, 404 says it is missing, anything else that the API server could not be read."""
        try:
            return call()
        except ApiException as exc:
            message = _api_message(exc)
            if exc.status == 403:
                self.problem("Forbidden", message, verb=verb, resource=resource, scope=scope)
            elif exc.status == 404:
                self.problem("NotFound", message, verb=verb, resource=resource, scope=scope, what=what)
            else:
                self.problem("ApiError", f"{verb} {resource}: {exc.status} {message}", verb=verb, resource=resource)
        except Exception as exc:  # connection refused, timeout, TLS: the API server not reached
            self.problem("ApiServerUnreachable", f"{verb} {resource}: {exc}", verb=verb, resource=resource)
        return None


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body or "{}").get("message") or exc.reason or str(exc.status)
    except (ValueError, AttributeError):
        return str(exc.reason or exc.status)


def _time(t) -> str | None:
    if t is None:
        return None
    if isinstance(t, dt.datetime):
        return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(t)


def _pod(p) -> dict:
    ready = next((c.status == "True" for c in (p.status.conditions or []) if c.type == "Ready"), False)
    restarts = sum(s.restart_count or 0 for s in (p.status.container_statuses or []))
    return {"name": p.metadata.name, "node": p.spec.node_name, "phase": p.status.phase, "ready": ready,
            "restarts": restarts, "deleting": p.metadata.deletion_timestamp is not None}


def load(kubeconfig: str | None, context: str | None) -> tuple[client.ApiClient, str]:
    """The client and the context's name; KubeconfigError naming the file when it cannot load."""
    try:
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
        name = context or (active or {}).get("name") or ""
        cfg = client.Configuration()
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
        cfg.retries = 1  # urllib3's default (3 more tries per call) would make an unreachable API server slow to say so
        return client.ApiClient(cfg), name
    except Exception as exc:  # missing file, unknown context, bad YAML
        raise KubeconfigError(f"cannot load kubeconfig {kubeconfig or '(default: $KUBECONFIG or ~/.kube/config)'}"
                              f"{f' context {context!r}' if context else ''}: {exc}") from None


class KubeconfigError(Exception):
    pass


def gather(api: client.ApiClient, context: str, namespace: str, *, lease_name: str = DEFAULT_LEASE,
           controller_url: str | None = None, controller_ca: str | None = None,
           tls_secret: str = DEFAULT_TLS_SECRET, top: int = 10) -> dict:
    snap = Snapshot(context=context, server=api.configuration.host, namespace=namespace,
                    read_at=_time(dt.datetime.now(dt.timezone.utc)))
    d = snap.data
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    res = f"egressbudgets.{GROUP}"
    budgets = snap.read("the EgressBudget CRD", "list", res, lambda: custom.list_cluster_custom_object(
        GROUP, VERSION, "egressbudgets", _request_timeout=API_TIMEOUT))
    d["crds_installed"] = not any(p["kind"] == "NotFound" and p["resource"] == res for p in d["problems"])
    if any(p["kind"] == "ApiServerUnreachable" for p in d["problems"]):
        return d  # every other read would fail the same way, each after its timeout
    d["budgets"] = [{"name": b["metadata"]["name"], "spec": b.get("spec") or {}, "status": b.get("status") or {}}
                    for b in (budgets or {}).get("items", [])]
    if not d["crds_installed"]:
        return d  # nothing of netagent to read: the view says it is not installed
    classes = snap.read("the EgressClass CRD", "list", f"egressclasses.{GROUP}", lambda: custom.list_cluster_custom_object(
        GROUP, VERSION, "egressclasses", _request_timeout=API_TIMEOUT))
    d["classes"] = [{"name": c["metadata"]["name"], "spec": c.get("spec") or {}}
                    for c in (classes or {}).get("items", [])]
    scope = f"namespace {namespace}"
    for key, selector in (("agents", AGENT_SELECTOR), ("controllers", CONTROLLER_SELECTOR)):
        pods = snap.read(key, "list", "pods", lambda: core.list_namespaced_pod(
            namespace, label_selector=selector, _request_timeout=API_TIMEOUT), scope)
        d[key] = None if pods is None else [_pod(p) for p in pods.items]
    coordination = client.CoordinationV1Api(api)
    lease = snap.read("the controller's Lease", "get", "leases.coordination.k8s.io", lambda: coordination.read_namespaced_lease(
        lease_name, namespace, _request_timeout=API_TIMEOUT), scope)
    d["lease"] = None if lease is None else {
        "name": lease_name, "holder": lease.spec.holder_identity or None,
        "renew_time": _time(lease.spec.renew_time), "duration_seconds": lease.spec.lease_duration_seconds,
        "transitions": lease.spec.lease_transitions}
    events = snap.read("events", "list", "events", lambda: core.list_namespaced_event(
        namespace, field_selector="type=Warning", limit=MAX_EVENTS, _request_timeout=API_TIMEOUT), scope)
    ours = snap.read("events", "list", "events", lambda: core.list_event_for_all_namespaces(
        field_selector="reportingComponent=netagent-controller,type=Warning", limit=MAX_EVENTS,
        _request_timeout=API_TIMEOUT))
    seen, d["events"] = set(), []
    for e in [*(events.items if events else []), *(ours.items if ours else [])]:
        if e.metadata.uid in seen:
            continue
        seen.add(e.metadata.uid)
        obj = e.involved_object
        d["events"].append({"namespace": e.metadata.namespace, "object": f"{obj.kind}/{obj.name}", "reason": e.reason,
                            "message": e.message, "count": e.count or 1,
                            "last": _time(e.last_timestamp or e.event_time or e.metadata.creation_timestamp)})
    d["controller"] = _controller(snap, api, core, namespace, d["lease"], controller_url, controller_ca, tls_secret, top)
    return d


def _controller(snap: Snapshot, api, core, namespace: str, lease: dict | None, url: str | None, ca: str | None,
                tls_secret: str, top: int) -> dict:
    out = {"url": None, "source": None, "readyz": None, "ready": None, "view": None, "error": None, "ca_note": None}
    cadata = None
    if url is None:
        holder = (lease or {}).get("holder") or ""
        if "@" not in holder:
            out["error"] = "no leader to ask: the Lease names no holder" if lease else "no Lease to find the leader by"
            return out
        url, out["source"] = holder.split("@", 1)[1], "lease"
    else:
        out["source"] = "flag"
    # the kubeconfig's bearer token as the client would send it (refreshed by exec/auth-provider hooks)
    token = ((api.configuration.auth_settings() or {}).get("BearerToken") or {}).get("value")
    context = None
    if "://" not in url or url.startswith("https://"):
        if ca is None:
            try:  # a user who may not read Secrets passes --controller-ca: not a problem of the cluster
                secret = core.read_namespaced_secret(tls_secret, namespace, _request_timeout=API_TIMEOUT)
                pem = (secret.data or {}).get("ca.crt")
            except Exception as exc:
                pem, out["ca_note"] = None, f"no CA from Secret {namespace}/{tls_secret} ({_reason(exc)}): see --controller-ca"
            cadata = base64.b64decode(pem).decode() if pem else None
        else:
            cadata = open(ca).read()
        if cadata:
            context = ssl.create_default_context(cadata=cadata)
            context.check_hostname = False  # the certificate names the Service; the leader is reached by address
    if "://" not in url:  # from the Lease: https when a CA is at hand, else the lab's plain HTTP (no token sent)
        url = f"https://{url}" if context is not None else f"http://{url}"
    out["url"] = url = url.rstrip("/")
    try:
        code, text = _get(url + "/readyz", None, context)
    except Exception as exc:
        out["error"] = f"controller unreachable at {url}: {_reason(exc)}"
        return out
    out["readyz"], out["ready"] = text.strip(), code == 200
    if url.startswith("http://") and out["source"] == "lease":
        token = None  # never a credential in clear text
    try:
        code, text = _get(f"{url}/v1/status?top={int(top)}", token, context)
    except Exception as exc:
        out["error"] = f"GET {url}/v1/status: {_reason(exc)}"
        return out
    if code == 200:
        out["view"] = json.loads(text)
    elif code in (401, 403):
        out["error"] = (f"the controller refused GET /v1/status ({code}: {text.strip()}); it asks what /metrics asks: "
                        "a bearer token allowed to get the nonResourceURL /metrics (docs/operations.md)")
        out["refused"] = code
    else:
        out["error"] = f"GET {url}/v1/status: {code} {text.strip()[:200]}"
    return out


def _reason(exc: Exception) -> str:
    return str(getattr(exc, "reason", None) or exc)


def _get(url: str, token: str | None, context: ssl.SSLContext | None) -> tuple[int, str]:
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = token if token.lower().startswith("bearer ") else f"Bearer {token}"
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=CONTROLLER_TIMEOUT, context=context) as r:
            return r.status, r.read(1 << 22).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(1 << 16).decode(errors="replace")
