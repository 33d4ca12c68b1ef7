"""What the agent sends the controller, bounded. Pure.

A pod's annotations are the tenant's input (Kubernetes allows 256 KiB of them): a value no
class name or bandwidth quantity can be that long is not copied into the report (the
controller would refuse the whole node's report for it). The field is left out, the pod keeps
its neighbours' fate (the team's default class, as for any unknown class) and its owner is
told: a problem on the pod (Event, log line, metric, like any bad annotation). A node with
more pods than one report may carry reports the first MAX_PODS_PER_REPORT in a stable order.
"""
from __future__ import annotations

import dataclasses

from core.direction import Direction
from core.policy import ResolvedPod
from core.wire import MAX_PODS_PER_REPORT

# An EgressClass is a Kubernetes object: its name is at most 253 characters. A bandwidth is a
# quantity ("10M", "1.5Gi"): 64 characters is generous.
MAX_CLASS_CHARS = 253
MAX_BANDWIDTH_CHARS = 64
REASON_TOO_LONG = "AnnotationTooLong"
CLASS_ANNOTATION = "netagent.io/egress-class"
BANDWIDTH_ANNOTATION = "kubernetes.io/egress-bandwidth"
INGRESS_BANDWIDTH_ANNOTATION = "kubernetes.io/ingress-bandwidth"
# (annotation, how to read it from the pod, its length limit)
LIMITS = ((CLASS_ANNOTATION, lambda p: p.class_annotation, MAX_CLASS_CHARS),
          (BANDWIDTH_ANNOTATION, lambda p: p.bandwidth[Direction.UPLOAD], MAX_BANDWIDTH_CHARS),
          (INGRESS_BANDWIDTH_ANNOTATION, lambda p: p.bandwidth[Direction.DOWNLOAD], MAX_BANDWIDTH_CHARS))


def too_long(p: ResolvedPod) -> tuple[tuple[str, str], ...]:
    """The pod's over-long annotations as problems (reason, message); () when none."""
    out = []
    for annotation, read, limit in LIMITS:
        value = read(p)
        if value is not None and len(value) > limit:
            out.append((REASON_TOO_LONG, f"annotation {annotation} is {len(value)} characters long (at most {limit}); "
                                         "it is ignored and not sent to the controller"))
    return tuple(out)


def with_outbound_problems(p: ResolvedPod) -> ResolvedPod:
    """`p` with its over-long annotations among its problems (so they get an Event and a metric)."""
    extra = too_long(p)
    return dataclasses.replace(p, problems=p.problems + extra) if extra else p


def bounded_annotations(p: ResolvedPod) -> tuple[str | None, str | None]:
    """(class annotation, bandwidth annotation) as they may be sent: None when over the limit."""
    return tuple(None if v is not None and len(v) > limit else v  # type: ignore[return-value]
                 for v, limit in ((p.class_annotation, MAX_CLASS_CHARS), (p.bandwidth[Direction.UPLOAD], MAX_BANDWIDTH_CHARS)))


def bounded_pods(pods: list, key=lambda item: item[0].key, limit: int = MAX_PODS_PER_REPORT) -> tuple[list, int]:
    """At most `limit` of `pods` in a stable order (by pod key); (kept, how many were left out)."""
    if len(pods) <= limit:
        return list(pods), 0
    ordered = sorted(pods, key=key)
    return ordered[:limit], len(ordered) - limit


def bounded_ingress_annotation(p: ResolvedPod) -> str | None:
    """kubernetes.io/ingress-bandwidth as it may be sent: None when over the limit."""
    v = p.bandwidth[Direction.DOWNLOAD]
    return None if v is not None and len(v) > MAX_BANDWIDTH_CHARS else v
