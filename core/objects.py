"""Kubernetes objects as netagent reads them, from the API or from YAML files.

Both sources (Kubernetes watches and YAML files) feed a `Snapshot`; everything
downstream (policy, the desired kernel state, metrics) reads snapshots and never the sources.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

ANNOTATION_CLASS = "netagent.io/egress-class"
ANNOTATION_BANDWIDTH = "kubernetes.io/egress-bandwidth"  # the pod's internet upload cap
ANNOTATION_INGRESS_BANDWIDTH = "kubernetes.io/ingress-bandwidth"  # the pod's internet download cap
# A lower-case RFC 1123 DNS subdomain: the names of nodes, namespaces and our objects
DNS_NAME_PATTERN = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
DNS_NAME = re.compile(f"^{DNS_NAME_PATTERN}$")


@dataclass(frozen=True)
class PodRecord:
    """What netagent reads of a Pod: identity, node, addresses, phase and annotations."""
    namespace: str
    name: str
    uid: str
    node: str
    ips: tuple[str, ...]
    host_network: bool
    phase: str
    annotations: tuple[tuple[str, str], ...]  # sorted (key, value) pairs: hashable and comparable
    resource_version: str = ""
    deleting: bool = False  # deletionTimestamp set: its IP may already belong to a new pod

    @property
    def key(self) -> str:
        """"namespace/name": the pod's key everywhere in netagent."""
        return f"{self.namespace}/{self.name}"

    def annotation(self, key: str) -> str | None:
        """The annotation's value, or None."""
        return dict(self.annotations).get(key)

    @property
    def terminal(self) -> bool:
        """Succeeded or Failed: the pod holds no address any more."""
        return self.phase in ("Succeeded", "Failed")

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> "PodRecord":
        """A Pod in its Kubernetes dict form (API JSON or YAML)."""
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        if not meta.get("name"):
            raise ValueError("Pod without metadata.name")
        ips = [p.get("ip") for p in status.get("podIPs") or [] if p.get("ip")]
        if not ips and status.get("podIP"):
            ips = [status["podIP"]]
        annotations = meta.get("annotations") or {}
        return cls(
            namespace=meta.get("namespace") or "default",
            name=meta["name"],
            uid=meta.get("uid") or f"file:{meta.get('namespace') or 'default'}/{meta['name']}",
            node=spec.get("nodeName") or "",
            ips=tuple(ips),
            host_network=bool(spec.get("hostNetwork")),
            phase=status.get("phase") or "",
            annotations=tuple(sorted((str(k), str(v)) for k, v in annotations.items())),
            resource_version=str(meta.get("resourceVersion") or ""),
            deleting=bool(meta.get("deletionTimestamp")),
        )


@dataclass(frozen=True)
class Snapshot:
    """Everything the agent knows from its sources at one moment."""

    pods: tuple[PodRecord, ...] = ()
    classes: tuple[dict[str, Any], ...] = ()  # EgressClass objects, Kubernetes dict form
    budgets: tuple[dict[str, Any], ...] = ()  # EgressBudget objects
    generation: int = 0
    errors: tuple[str, ...] = field(default=())  # source problems (a file that failed to parse, ...)
    # the cluster's service CIDRs (its ServiceCIDR objects); None: not known from this source
    service_cidrs: tuple[str, ...] | None = None
    # namespace name -> its labels (teams chosen by namespaceSelector); None: not known from this source
    namespaces: Mapping[str, Mapping[str, str]] | None = None
    # the NetworkScopes object named `cluster` (issue 39, Kubernetes dict form); None: there is none
    network_scopes: Mapping[str, Any] | None = None
    # this node's topology.kubernetes.io/zone label; None: no label, or the Node is not known
    node_zone: str | None = None


SCOPES_NAME = "cluster"  # the one NetworkScopes object a cluster has (issue 39)
ZONE_LABEL = "topology.kubernetes.io/zone"


def node_zone_of(obj: Mapping[str, Any]) -> str | None:
    """A Node's zone: its topology.kubernetes.io/zone label, None without one (or an empty one)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    zone = labels.get(ZONE_LABEL) if isinstance(labels, dict) else None
    return zone if isinstance(zone, str) and zone else None


def policy_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """What netagent's policy reads of an EgressClass or EgressBudget (core.policy.load_policy): its
    name and spec, with the generation (bumped by a spec change only). Kept instead of the object, a
    status write (the controller's, every few seconds on a budget) is no change: every node's agent
    re-resolved and reconciled its pods on each one."""
    meta = obj.get("metadata") or {}
    return {"metadata": {"name": meta.get("name"), "generation": meta.get("generation")}, "spec": obj.get("spec")}


def namespace_labels(obj: dict[str, Any]) -> dict[str, str]:
    """What netagent keeps of a Namespace: its labels (all a namespaceSelector reads), as strings."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}


MAX_SERVICE_CIDRS = 64  # the cluster's service ranges that are taken: a handful in practice (2 per ServiceCIDR)


def service_cidrs_of(objects: list[dict[str, Any]]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The networks of ServiceCIDR objects (networking.k8s.io/v1, `spec.cidrs`), canonical, de-duplicated and
    sorted, and the problems found (an entry that is no network, or more than MAX_SERVICE_CIDRS): ->
    (cidrs, problems). A range whose object is being deleted still serves its ClusterIPs until they are
    freed, so it is kept."""
    found: set[ipaddress.IPv4Network | ipaddress.IPv6Network] = set()
    problems: list[str] = []
    for obj in objects:
        name = str((obj.get("metadata") or {}).get("name", "?"))[:253]
        cidrs = (obj.get("spec") or {}).get("cidrs") or []
        if not isinstance(cidrs, list):
            problems.append(f"ServiceCIDR {name}: spec.cidrs is not a list")
            continue
        for text in cidrs[:2]:  # the API allows one per family
            try:
                net = ipaddress.ip_network(str(text), strict=False)
            except ValueError:
                problems.append(f"ServiceCIDR {name}: {str(text)[:64]!r} is not a network")
                continue
            if net.prefixlen == 0:
                problems.append(f"ServiceCIDR {name}: {net} is every address, not a service range")
                continue
            found.add(net)
    ordered = sorted(found, key=lambda n: (n.version, n))
    if len(ordered) > MAX_SERVICE_CIDRS:
        problems.append(f"{len(ordered)} service CIDRs: only the first {MAX_SERVICE_CIDRS} are taken")
        ordered = ordered[:MAX_SERVICE_CIDRS]
    return tuple(map(str, ordered)), tuple(problems)
