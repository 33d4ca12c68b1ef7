"""The agent <-> controller wire format, v1: schemas as msgspec Structs.

msgspec decodes and validates in one pass in C (about 10x the stdlib json plus
hand-written checks), which is what lets one controller core take thousands of
110-pod reports per second. Every field has bounds: nothing an agent sends can
make the controller allocate unbounded memory or compute with NaN, and nothing a
controller answers can make an agent enforce NaN, 1e30 or a lease that never ends.
Both ends use these same types: the agent encodes a NodeReport and decodes the
NodeAnswer; the controller the other way round.
"""
from __future__ import annotations

import re
from itertools import chain
from operator import attrgetter
from types import MappingProxyType
from datetime import datetime
from typing import Annotated, Any, Literal, Mapping

import msgspec

from .direction import DIRECTIONS, PerDirection
from .objects import DNS_NAME_PATTERN
from .quantity import MAX_BYTES

MAX_PODS_PER_REPORT = 1024  # pods allocated per report: kubelet's max-pods tops out far below this
# pods a report may *carry*: those beyond MAX_PODS_PER_REPORT are refused by name (reason TooManyPods),
# not the whole report; the byte limit (MAX_REPORT_BYTES) bounds the decode whatever this says
MAX_PODS_DECODED = 8 * MAX_PODS_PER_REPORT
MAX_REPORT_BYTES = 4 << 20  # a 1,024-pod report with long names and annotations fits; larger is refused whole (413)
MAX_ANNOTATION_VALUE = 1024  # longer values of the annotations we read: that pod is refused (AnnotationTooLong)
MAX_REFUSED = 256  # refused pods listed by name in one answer; the count of the rest goes to `problems`
MAX_RATE = 2.0**64  # bit/s
Rate = Annotated[float, msgspec.Meta(ge=0, le=MAX_RATE)]
ByteCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]  # a cumulative counter: a signed 64-bit one's range
# Bytes per priced non-internet scope (issue 39, docs/scopes.md): the keys are core.scopes.Scope values
# (tests/test_repo_direction_names.py checks they agree)
ScopeBytes = Annotated[dict[Literal["cross-zone", "cross-region"], ByteCount], msgspec.Meta(max_length=2)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=253, pattern=f"^{DNS_NAME_PATTERN}$")]
# Pod and namespace names are checked all at once by `invalid_name` (one regex over the joined
# names instead of 220 regex calls per report: a third of the decode time otherwise)
PodName = Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
Text = Annotated[str, msgspec.Meta(max_length=253)]
# decoded whatever their length (the body size bounds them): one pod's oversize annotation is that
# pod's problem, refused alone by the controller (state.refuse), never the whole report's
AnnotationValue = str


# gc=False: these hold only strings, numbers and lists of each other, never a cycle; keeping
# hundreds of thousands of them out of the cyclic GC's reach keeps its full passes cheap
class PodReport(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """One pod in a node report."""
    namespace: PodName
    name: PodName
    usage_bps: Rate  # measured internet egress over the last period
    demand_bps: Rate  # the agent's estimate (probes above censored usage)
    throttled: bool = False
    egress_class: AnnotationValue | None = None  # netagent.io/egress-class as the pod carries it
    egress_bandwidth: AnnotationValue | None = None  # kubernetes.io/egress-bandwidth as the pod carries it
    # downloads (internet -> pod), beside the upload fields above; absent in reports of agents that
    # do not shape ingress (they decode as 0 / None: the controller gives such pods no download share)
    ingress_usage_bps: Rate = 0.0  # measured internet ingress over the last period
    ingress_demand_bps: Rate = 0.0  # the agent's estimate (probes above censored usage, as for egress)
    ingress_throttled: bool = False
    ingress_bandwidth: AnnotationValue | None = None  # kubernetes.io/ingress-bandwidth as the pod carries it
    # volume quotas (docs/quotas.md): the pod's cumulative internet IP bytes, the accounting metrics' values
    # (uploads as they left its shaper, downloads as they arrived), within NodeReport.epoch; None: not counted
    # (an older agent, or a pod its agent has no counter for yet): the pod spends no quota in that report
    bytes_total: ByteCount | None = None
    ingress_bytes_total: ByteCount | None = None
    # where the bytes go (issue 39): the pod's cumulative bytes per non-internet, non-internal scope, as
    # bytes_total (same epoch, never stepping down); None/absent (an older agent, no NetworkScopes): {}
    scope_bytes_total: ScopeBytes | None = None
    ingress_scope_bytes_total: ScopeBytes | None = None
    # the pod's metadata.uid: whose counters these are (a pod made again under the same name starts from 0)
    uid: Annotated[str, msgspec.Meta(max_length=128)] | None = None


class NodeReport(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """An agent's report: its node's pods and the node's measured internet egress."""
    node: Name
    pods: Annotated[list[PodReport], msgspec.Meta(max_length=MAX_PODS_DECODED)]
    seq: Annotated[int, msgspec.Meta(ge=0)] = 0
    period_seconds: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 5.0
    node_internet_egress_bps: Rate = 0.0  # everything leaving to the internet, host traffic included
    node_internet_ingress_bps: Rate = 0.0  # everything arriving from the internet, host traffic included
    shapes_ingress: bool = False  # the agent shapes downloads (an older agent does not: no download share)
    # the node's pods' classes' IP bytes (what their usage counts) over the same seconds as the node's
    # internet bytes above, read together (issue 37): their ratio needs no steady plant to mean the
    # plant's; None (an older agent): the controller sums the pods' last samples and waits for one
    node_shaped_egress_bps: Rate | None = None
    node_shaped_ingress_bps: Rate | None = None
    # what the pods' byte counters count from (docs/quotas.md): a new epoch means they may have restarted
    # from 0; None (an older agent): its pods' counters are not counted
    epoch: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None


AGENT_ANSWER_TIMEOUT = 3.0  # seconds an agent waits for the controller's answer (the controller answers sooner)
MAX_LEASE_SECONDS = 3600.0  # an answer's lease is bounded: a controller bug cannot pin allocations forever
MAX_ADVISED_PERIOD = 300.0  # the longest report period a controller may ask for (controller/pacing.py)
MAX_PROBLEMS = 2 * MAX_PODS_PER_REPORT

# why a pod was refused (the only values `Refused.reason` takes; docs/controller.md explains each)
REFUSAL_REASONS = ("PodNotOnNode", "UnknownPod", "AnnotationTooLong", "TooManyPods", "Duplicate", "InvalidName")


class PodAllocation(msgspec.Struct, gc=False):
    """One pod in an answer: its fair share and its limit."""
    namespace: PodName
    name: PodName
    team: Text
    egress_class: Text
    allocation_bps: Rate  # the fair share (HTB rate)
    limit_bps: Rate  # what to enforce: share + headroom, never above the pod's cap (HTB ceil)
    # downloads: None = this controller allocates no downloads (an older one, or the agent did not
    # say it shapes them); the agent then enforces its own ingress cap for the pod
    ingress_allocation_bps: Rate | None = None
    ingress_limit_bps: Rate | None = None


class Refused(msgspec.Struct, gc=False):
    """A pod of the report that the controller did not allocate, and why: the others are
    answered as usual (one bad pod never costs its neighbours anything)."""
    namespace: Text
    name: Text
    reason: Text  # one of REFUSAL_REASONS


MAX_FORECAST_SECONDS = 1e12  # ~31,700 years: a longer forecast is sent as this (no exhaustion in sight)
MAX_UNIX_SECONDS = 2.0**36  # the year 4147: no calendar period starts or ends later
UnixTime = Annotated[float, msgspec.Meta(ge=0, le=MAX_UNIX_SECONDS)]


class QuotaFigures(msgspec.Struct, gc=False):
    """One direction of a team's volume quota in an answer: the figures the leader's netagent_team_quota_*
    metrics export (docs/quotas.md), as of the round the answer's allocations come from."""
    bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_BYTES)]  # the period's quota
    used: ByteCount  # the team's use this period, cluster-wide (above `bytes` by the overshoot once spent)
    exhausted: bool  # the team is held at exhausted_bps in this direction until the period ends
    exhausted_bps: Rate | None = None  # None: the pods' safe floor once spent
    # seconds until spent at the team's rate over the last minute: 0 when spent, None with no use
    forecast_seconds: Annotated[float, msgspec.Meta(ge=0, le=MAX_FORECAST_SECONDS)] | None = None


class TeamQuotaState(msgspec.Struct, gc=False):
    """A team's volume quota state in an answer; `egress`/`ingress`: its uploads/downloads quota (None: no quota
    in that direction), read through TEAM_QUOTA[d]."""
    team: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    period: Literal["Day", "Week", "Month"]  # core.quota.PERIODS
    period_start: UnixTime
    period_end: UnixTime
    egress: QuotaFigures | None = None
    ingress: QuotaFigures | None = None

    def __post_init__(self) -> None:
        if self.period_end <= self.period_start:
            raise ValueError(f"team {self.team[:80]!r}: period_end must be after period_start")


def quota_entry(team: str, period: str, start: datetime, end: datetime,
                figures: PerDirection[QuotaFigures | None]) -> dict[str, Any]:
    """A team's volume quota as the agent's /state (both modes) and the leader's /v1/status show it, so
    `netagent status` and `netagent cluster` render one shape: per direction (its view word) the QuotaFigures'
    fields as keys, None without a quota in that direction."""
    entry: dict[str, Any] = {"team": team, "period": period, "period_start": start.isoformat(),
                             "period_end": end.isoformat()}
    for d in DIRECTIONS:
        f = figures[d]
        entry[d.view_word] = None if f is None else msgspec.structs.asdict(f)
    return entry


class NodeAnswer(msgspec.Struct):
    """The controller's answer to a node report."""
    node: Name
    # allocation round these numbers come from; 0 = no round with this node yet (a controller
    # that just became leader): the agent keeps the allocations and lease it already has
    generation: Annotated[int, msgspec.Meta(ge=0)]
    lease_seconds: Annotated[float, msgspec.Meta(gt=0, le=MAX_LEASE_SECONDS)]  # keep these allocations this long
    safe_floor_bps: Rate  # per pod, after the lease ran out (fail-static)
    node_rate_bps: Rate  # the node class rate
    pods: Annotated[list[PodAllocation], msgspec.Meta(max_length=MAX_PODS_PER_REPORT)]
    # pods refused (not on this node, unknown...), for the agent's log
    problems: Annotated[list[Annotated[str, msgspec.Meta(max_length=1024)]], msgspec.Meta(max_length=MAX_PROBLEMS)] = []
    # pods refused by name with their reason (absent in answers of older controllers: decodes as [])
    refused: Annotated[list[Refused], msgspec.Meta(max_length=MAX_REFUSED)] = []
    # downloads (None: no download allocation in this answer, see PodAllocation.ingress_limit_bps)
    node_ingress_rate_bps: Rate | None = None  # the node's download class rate
    safe_ingress_floor_bps: Rate | None = None  # per pod download floor after the lease ran out
    # seconds between this node's reports that the leader asks for (0: the agent's own period;
    # absent in older controllers' answers). Agents never report faster than their own period.
    report_period_seconds: Annotated[float, msgspec.Meta(ge=0, le=MAX_ADVISED_PERIOD)] = 0.0
    # volume quotas (docs/quotas.md): the quota state of the teams with pods in this answer (each once, at most
    # one per pod), from the round its allocations come from; None: not known (an older controller, or one that
    # does not count: not the leader, or not resumed yet); []: none of these teams has a byte quota
    quota: Annotated[list[TeamQuotaState], msgspec.Meta(max_length=MAX_PODS_PER_REPORT)] | None = None
    # the newest report fields this controller decodes (REPORT_VERSION); 0: an older controller, whose
    # NodeReport refuses a field it does not know (422): the agent then sends none newer than that
    report_version: Annotated[int, msgspec.Meta(ge=0)] = 0


# What a report may carry beyond the fields every controller decodes, by version (NodeAnswer.report_version):
# 1: NodeReport.node_shaped_egress_bps / node_shaped_ingress_bps (issue 37)
REPORT_VERSION = 1


class ErrorBody(msgspec.Struct, omit_defaults=True):
    """The JSON body of every refusal."""
    error: Annotated[str, msgspec.Meta(max_length=4096)]
    reason: Text
    leader: Text | None = None  # with reason NotLeader: the leader's host:port, when known


_ONE_NAME = re.compile(DNS_NAME_PATTERN)
_NAMES_OF = attrgetter("namespace", "name")
_NAME_CHARS = re.compile("[-a-z0-9.\n]*")


def invalid_name(report: NodeReport) -> str | None:
    """None when every pod and namespace name is a lower-case DNS name, else which is not.
    Fast path: the allowed characters in one regex pass over all names joined by newlines,
    and no name starting or ending with '-' or '.' (string searches around the newlines)."""
    if not report.pods:
        return None
    names = list(chain.from_iterable(map(_NAMES_OF, report.pods)))
    joined = "\n".join(names) + "\n"
    if (joined.count("\n") == len(names) and _NAME_CHARS.fullmatch(joined) and joined[0] not in "-.\n"
            # no name starts or ends with '-' or '.', none is empty (plain substring searches: fast)
            and "\n-" not in joined and "\n." not in joined and "-\n" not in joined and ".\n" not in joined
            and "\n\n" not in joined):
        return None
    for i, p in enumerate(report.pods):
        for field_name in ("namespace", "name"):
            if not _ONE_NAME.fullmatch(getattr(p, field_name)):
                return (f"`$.pods[{i}].{field_name}` {getattr(p, field_name)[:80]!r} is not a lower-case DNS name "
                        f"(a-z, 0-9, '-', '.')")
    return "a pod name is not a lower-case DNS name"


def invalid_name_indexes(report: NodeReport) -> list[int]:
    """The indexes of the pods whose namespace or name is not a lower-case DNS name (the fast
    path of `invalid_name` first: almost every report has none)."""
    if invalid_name(report) is None:
        return []
    return [i for i, p in enumerate(report.pods)
            if not (_ONE_NAME.fullmatch(p.namespace) and _ONE_NAME.fullmatch(p.name))]


def long_annotation_indexes(report: NodeReport) -> list[int]:
    """The indexes of the pods carrying an annotation value longer than MAX_ANNOTATION_VALUE."""
    m = MAX_ANNOTATION_VALUE
    return [i for i, p in enumerate(report.pods)
            if (p.egress_class is not None and len(p.egress_class) > m)
            or (p.egress_bandwidth is not None and len(p.egress_bandwidth) > m)
            or (p.ingress_bandwidth is not None and len(p.ingress_bandwidth) > m)]


report_decoder = msgspec.json.Decoder(NodeReport)  # the controller's side
answer_decoder = msgspec.json.Decoder(NodeAnswer)  # the agent's side: answers are checked as reports are
error_decoder = msgspec.json.Decoder(ErrorBody)


def quota_problem(answer: NodeAnswer) -> str | None:
    """None when the answer's quota state names each team at most once and only teams of its pods, else why."""
    if not answer.quota:
        return None
    teams = [q.team for q in answer.quota]
    if len(set(teams)) != len(teams):
        return "`$.quota` names a team twice"
    strangers = set(teams).difference(p.team for p in answer.pods)
    if strangers:
        return f"`$.quota` names team(s) {sorted(strangers)[:3]} with no pod in the answer"
    return None


def decode_answer(raw: bytes) -> NodeAnswer:
    """The agent's decode: answer_decoder's checks, then the quota state's bounds (quota_problem); raises
    msgspec.ValidationError as either refuses a bad value (the whole answer is refused)."""
    answer = answer_decoder.decode(raw)
    problem = quota_problem(answer)
    if problem is not None:
        raise msgspec.ValidationError(problem)
    return answer
encoder = msgspec.json.Encoder()


# The wire's field names per Direction, read through these only (the edge translates; the JSON
# names stay): POD_USAGE[d](pod_report), NODE_MEASURED[d](node_report), POD_ALLOCATION[d](answer_pod).
POD_DEMAND = PerDirection(attrgetter("demand_bps"), attrgetter("ingress_demand_bps"))
POD_USAGE = PerDirection(attrgetter("usage_bps"), attrgetter("ingress_usage_bps"))
NODE_MEASURED = PerDirection(attrgetter("node_internet_egress_bps"), attrgetter("node_internet_ingress_bps"))
NODE_SHAPED = PerDirection(attrgetter("node_shaped_egress_bps"), attrgetter("node_shaped_ingress_bps"))
POD_ALLOCATION = PerDirection(attrgetter("allocation_bps"), attrgetter("ingress_allocation_bps"))
POD_BYTES = PerDirection(attrgetter("bytes_total"), attrgetter("ingress_bytes_total"))
TEAM_QUOTA = PerDirection(attrgetter("egress"), attrgetter("ingress"))  # TEAM_QUOTA[d](team_quota_state)
_NO_SCOPE_BYTES: Mapping[str, int] = MappingProxyType({})
# POD_SCOPE_BYTES[d](pod_report) -> {"cross-zone": n, "cross-region": m}, {} when absent
POD_SCOPE_BYTES = PerDirection(attrgetter("scope_bytes_total"), attrgetter("ingress_scope_bytes_total")).map(
    lambda get: lambda pod: get(pod) or _NO_SCOPE_BYTES)
