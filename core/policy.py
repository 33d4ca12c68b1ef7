"""EgressClass and EgressBudget objects -> one validated `Policy`; a pod's annotations -> its `PodPolicy`.

Pure: dicts in (as YAML or the API server gives them), frozen values out. A bad
object never stops the others: it is skipped and described in the problems list,
so one typo in one class cannot unshape a cluster. See docs/crds.md.

Two directions, one policy: a class's, team's and pod's values are a `Limits` per
`Direction` (`spec.limits[d]`), the budget's totals a `PerDirection[int]` (`policy.totals[d]`);
the engine takes the direction. The CRD's words are translated here only: uploads at the top
level, downloads in an `ingress` block (`Direction.crd_block`), `spec.total`/`spec.ingressTotal`.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

from .direction import Direction, PerDirection
from .objects import ANNOTATION_BANDWIDTH, ANNOTATION_CLASS, ANNOTATION_INGRESS_BANDWIDTH, DNS_NAME, PodRecord
from .quantity import MAX_BPS, parse_bps
from .quota import TeamQuota, budget_zone, team_quota

log = logging.getLogger(__name__)

DEFAULT_CLASS = "default"  # always exists; an EgressClass of this name overrides the built-in one
DEFAULT_TEAM = "default"  # the team of unclaimed namespaces unless spec.defaultTeam says otherwise
MAX_WEIGHT = 1_000_000
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace

REASON_UNKNOWN_CLASS = "UnknownEgressClass"
REASON_CLASS_NOT_ALLOWED = "EgressClassNotAllowed"
REASON_INVALID_BANDWIDTH = "InvalidEgressBandwidth"
REASON_INVALID_INGRESS_BANDWIDTH = "InvalidIngressBandwidth"
NO_BANDWIDTH: PerDirection[str | None] = PerDirection(None, None)  # a pod without bandwidth annotations


class PolicyError(ValueError):
    """One EgressClass, EgressBudget or team that cannot be used; the message names it and says why."""


@dataclass(frozen=True, slots=True)
class Limits:
    """One direction's sharing values: weight, guarantee (up to demand) and cap, bit/s."""
    weight: float
    min_bps: int = 0
    max_bps: int = MAX_BPS  # MAX_BPS = no cap


def default_download(upload: Limits) -> Limits:
    """A class's or team's download values without an `ingress` block: the upload weight, no
    guarantee, no cap (nothing new guaranteed or capped silently)."""
    return Limits(upload.weight)


@dataclass(frozen=True)
class EgressClassSpec:
    """One validated EgressClass: per pod, per direction, its weight, guarantee and cap."""
    name: str
    limits: PerDirection[Limits]


BUILTIN_DEFAULT_CLASS = EgressClassSpec(DEFAULT_CLASS, PerDirection(Limits(1), Limits(1)))


@dataclass(frozen=True)
class LabelRequirement:
    """One matchLabels entry or matchExpressions requirement."""
    key: str
    operator: str  # In, NotIn, Exists, DoesNotExist
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether `labels` satisfy this requirement."""
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        return self.key not in labels or labels[self.key] not in self.values  # NotIn


@dataclass(frozen=True)
class NamespaceSelector:
    """A Kubernetes label selector (matchLabels AND matchExpressions); empty matches every namespace."""

    requirements: tuple[LabelRequirement, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether `labels` satisfy every requirement."""
        return all(r.matches(labels) for r in self.requirements)


@dataclass(frozen=True)
class TeamSpec:
    """One validated team of the EgressBudget; its limits hold for the team as a whole."""
    name: str
    namespaces: tuple[str, ...]
    limits: PerDirection[Limits]
    default_class: str  # always a class that exists in the policy
    allowed_classes: tuple[str, ...]  # empty = all classes allowed
    namespace_selector: NamespaceSelector | None = None
    quota: TeamQuota | None = None  # volume quota (docs/quotas.md)
    quota_refused: bool = False  # a quota block given but refused: the previous valid quota stays in force

    def allows(self, egress_class: str) -> bool:
        """Whether the team's pods may use `egress_class` (an empty list allows all)."""
        return not self.allowed_classes or egress_class in self.allowed_classes


@dataclass(frozen=True)
class Policy:
    """The validated policy: the budget's totals, its classes and teams, the default team."""
    totals: PerDirection[int]  # spec.total, spec.ingressTotal; MAX_BPS = no budget
    classes: Mapping[str, EgressClassSpec]
    teams: tuple[TeamSpec, ...]  # the default team is always among them
    default_team: str
    budget_name: str  # "" for the built-in default policy
    quota_zone: str | None = "UTC"  # spec.quotaTimeZone (IANA); None: refused, the previous zone stays in force
    _team_by_namespace: Mapping[str, TeamSpec] = field(init=False, repr=False, compare=False)
    _team_by_name: Mapping[str, TeamSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_ns: dict[str, TeamSpec] = {}
        for team in self.teams:
            for ns in team.namespaces:
                by_ns.setdefault(ns, team)  # first team listing a namespace wins (load_policy reports the clash)
        object.__setattr__(self, "_team_by_namespace", MappingProxyType(by_ns))
        object.__setattr__(self, "_team_by_name", MappingProxyType({t.name: t for t in self.teams}))
        if self.default_team not in self._team_by_name:
            raise PolicyError(f"default team {self.default_team!r} is not among the policy's teams")

    def team_for(self, namespace: str, labels: Mapping[str, str] | None = None) -> TeamSpec:
        """The team owning `namespace`: a team listing it by name, else the first team whose
        namespaceSelector matches its labels (without labels: only kubernetes.io/metadata.name),
        else the default team."""
        team = self._team_by_namespace.get(namespace)
        if team is not None:
            return team
        selectors = [(t, t.namespace_selector) for t in self.teams if t.namespace_selector is not None]
        if selectors:
            merged = {NAMESPACE_NAME_LABEL: namespace, **(labels or {})}
            for t, selector in selectors:
                if selector.matches(merged):
                    return t
        return self._team_by_name[self.default_team]

    def team(self, name: str) -> TeamSpec:
        """The team called `name` (KeyError when there is none)."""
        return self._team_by_name[name]

    def team_index(self) -> dict[str, int]:
        """Team name -> its position in `teams` (the engine's columnar team ids)."""
        return {t.name: i for i, t in enumerate(self.teams)}


def builtin_default_policy(classes: Mapping[str, EgressClassSpec] | None = None) -> Policy:
    """Without an EgressBudget: no cluster-wide total (pods are held only to their class max and
    bandwidth annotation), one team "default" owning every namespace, every class allowed."""
    classes = dict(classes or {})
    classes.setdefault(DEFAULT_CLASS, BUILTIN_DEFAULT_CLASS)
    team = TeamSpec(DEFAULT_TEAM, (), PerDirection.same(Limits(1)), DEFAULT_CLASS, ())
    return Policy(PerDirection.same(MAX_BPS), MappingProxyType(classes), (team,), DEFAULT_TEAM, "")


@dataclass(frozen=True)
class PodPolicy:
    """A pod's resolved policy: team, class, per direction its weight, guarantee and cap (the class's cap
    lowered by the direction's bandwidth annotation), and what was wrong with its annotations."""
    team: str
    egress_class: str
    limits: PerDirection[Limits]
    problems: tuple[tuple[str, str], ...]  # (Kubernetes Event reason, human message)
    bandwidth: PerDirection[str | None] = NO_BANDWIDTH  # the annotations resolved from


# A direction's bandwidth annotation and the Event reason when it is malformed.
BANDWIDTH_ANNOTATION = PerDirection(ANNOTATION_BANDWIDTH, ANNOTATION_INGRESS_BANDWIDTH)
INVALID_BANDWIDTH_REASON = PerDirection(REASON_INVALID_BANDWIDTH, REASON_INVALID_INGRESS_BANDWIDTH)


def pod_limits(spec: EgressClassSpec, d: Direction, annotation: str | None,
               problems: list[tuple[str, str]]) -> Limits:
    """A pod's values in direction `d`: its class's, the cap lowered by the annotation (never
    raised), the guarantee never above the cap; a malformed annotation adds a problem."""
    c = spec.limits[d]
    cap = _capped(c.max_bps, annotation, BANDWIDTH_ANNOTATION[d], INVALID_BANDWIDTH_REASON[d], problems)
    return Limits(float(c.weight), min(c.min_bps, cap), cap)


def resolve_pod(policy: Policy, namespace: str, class_annotation: str | None,
                bandwidth: PerDirection[str | None] = NO_BANDWIDTH,
                namespace_labels: Mapping[str, str] | None = None) -> PodPolicy:
    """The pod's team, class, weight, guarantee and cap (both directions) from its namespace and
    three annotations (`bandwidth`: the bandwidth annotation of each direction, None where absent).

    netagent.io/egress-class picks the class (unset: the team's default class); an unknown class
    or one the team may not use falls back to the team's default, with a problem. The
    kubernetes.io/egress-bandwidth annotation tightens the upload cap and
    kubernetes.io/ingress-bandwidth the download cap (never loosening them); a guarantee never
    exceeds its cap; a malformed annotation is ignored, with a problem (the pod keeps its
    class's values for that direction)."""
    team = policy.team_for(namespace, namespace_labels)
    problems: list[tuple[str, str]] = []
    chosen = team.default_class
    requested = (class_annotation or "").strip()
    if requested:
        if requested not in policy.classes:
            known = ", ".join(sorted(policy.classes))
            problems.append((REASON_UNKNOWN_CLASS,
                             f'egress class "{requested}" does not exist (known: {known}); '
                             f'using team {team.name}\'s default class "{chosen}"'))
        elif not team.allows(requested):
            problems.append((REASON_CLASS_NOT_ALLOWED,
                             f'egress class "{requested}" is not allowed for team {team.name} '
                             f'(allowed: {", ".join(team.allowed_classes)}); using its default class "{chosen}"'))
        else:
            chosen = requested
    spec = policy.classes[chosen]
    limits = PerDirection.build(lambda d: pod_limits(spec, d, bandwidth[d], problems))
    return PodPolicy(team.name, chosen, limits, tuple(problems), bandwidth)


def _capped(cap: int, annotation: str | None, name: str, reason: str, problems: list[tuple[str, str]]) -> int:
    """`cap` lowered by a bandwidth annotation's value (never raised); a malformed one adds a problem."""
    if annotation is None or not annotation.strip():
        return cap
    try:
        return min(cap, parse_bps(annotation, f"annotation {name}"))
    except ValueError as exc:
        problems.append((reason, f"{exc}; the annotation is ignored"))
        return cap


@dataclass(frozen=True)
class ResolvedPod:
    """A pod on a node with its policy applied: what the agent shapes and reports."""

    key: str
    namespace: str
    name: str
    uid: str
    ips: tuple[str, ...]
    team: str
    egress_class: str
    # per direction its weight, guarantee and cap: the class's, the cap lowered by the direction's
    # bandwidth annotation (kubernetes.io/egress-bandwidth, kubernetes.io/ingress-bandwidth)
    limits: PerDirection[Limits]
    problems: tuple[tuple[str, str], ...] = ()
    class_annotation: str | None = None
    bandwidth: PerDirection[str | None] = NO_BANDWIDTH  # its bandwidth annotation per direction


def shaped_pods(pods: Iterable[PodRecord]) -> list[PodRecord]:
    """The pods that get a class of their own, with IPs given up by pods being deleted.

    hostNetwork pods are node traffic (they share the node's addresses); finished pods
    (Succeeded/Failed) hold no IP any more; a pod without an IP yet is kept (it shows as
    waiting); an IP held by two pods (a deleted pod's IP handed to a new one before the
    old object is gone) stays with the pod that is not being deleted."""
    live = [p for p in pods if not p.host_network and not p.terminal]
    holders: dict[str, list[PodRecord]] = {}
    for p in live:
        for ip in p.ips:
            holders.setdefault(ip, []).append(p)
    losers: dict[str, set[str]] = {}  # pod uid -> IPs it must give up
    for ip, held in holders.items():
        if len(held) > 1 and any(not p.deleting for p in held):
            for p in held:
                if p.deleting:
                    losers.setdefault(p.uid, set()).add(ip)
    out = []
    for p in live:
        gone = losers.get(p.uid)
        if gone:
            p = PodRecord(**{**p.__dict__, "ips": tuple(ip for ip in p.ips if ip not in gone)})
        out.append(p)
    return out


def resolve_pods(policy: Policy, pods: Iterable[PodRecord],
                 namespaces: Mapping[str, Mapping[str, str]] | None = None) -> list[ResolvedPod]:
    """Each shaped pod (see `shaped_pods`) with its team, class, weight, guarantee and cap (both
    directions). `namespaces`: namespace -> labels, the same the controller resolves with (a
    namespace missing from it resolves by its name alone, as on the controller)."""
    labels_of = (namespaces or {}).get
    out = []
    for p in shaped_pods(pods):
        cls_ann, bw_ann = p.annotation(ANNOTATION_CLASS), p.annotation(ANNOTATION_BANDWIDTH)
        bandwidth = PerDirection(bw_ann, p.annotation(ANNOTATION_INGRESS_BANDWIDTH))
        pp = resolve_pod(policy, p.namespace, cls_ann, bandwidth, labels_of(p.namespace))
        limits = pp.limits.map(lambda lim: Limits(float(lim.weight), int(lim.min_bps), int(lim.max_bps)))
        out.append(ResolvedPod(p.key, p.namespace, p.name, p.uid, p.ips, pp.team, pp.egress_class, limits,
                               tuple(pp.problems), cls_ann, bandwidth))
    return out


def namespaces_missing(pods: Iterable[ResolvedPod], namespaces: Mapping[str, Mapping[str, str]] | None) -> dict[str, int]:
    """Namespace -> how many of `pods` run in it while `namespaces` (when known) has no such
    namespace: deleted under running pods (or not seen yet); they resolve by the name alone."""
    if namespaces is None:
        return {}
    out: dict[str, int] = {}
    for p in pods:
        if p.namespace not in namespaces:
            out[p.namespace] = out.get(p.namespace, 0) + 1
    return out


class PolicyCache:
    """`load_policy` over the current policy objects, recomputed only after `invalidate()`;
    its problems are logged once per change, not on every call. Thread-safe."""

    def __init__(self, objects: Callable[[], tuple[Iterable[dict[str, Any]], Iterable[dict[str, Any]]]]):
        self.objects = objects  # -> (EgressClass objects, EgressBudget objects)
        self._dirty = True
        self._value: tuple[Policy, list[str]] | None = None
        self._lock = threading.Lock()

    def invalidate(self) -> None:
        """The objects changed: the next call reloads the policy."""
        self._dirty = True

    def __call__(self) -> tuple[Policy, list[str]]:
        with self._lock:
            if self._dirty or self._value is None:
                self._dirty = False
                classes, budgets = self.objects()
                policy, problems = load_policy(classes, budgets)
                if self._value is None or problems != self._value[1]:
                    for problem in problems:
                        log.warning("policy: %s", problem)
                self._value = (policy, problems)
            return self._value


# -- loading -------------------------------------------------------------------------------

def load_policy(classes: Iterable[dict[str, Any]], budgets: Iterable[dict[str, Any]]) -> tuple[Policy, list[str]]:
    """EgressClass and EgressBudget objects (Kubernetes dict form) -> (Policy, problems).

    Objects that cannot be used are skipped and described in `problems`. With several
    budgets the one named "default" is used, else the first by name. Without a usable
    budget: `builtin_default_policy` (see its docstring)."""
    problems: list[str] = []
    class_specs: dict[str, EgressClassSpec] = {}
    for obj in classes:
        try:
            spec = parse_class(obj)
        except PolicyError as exc:
            problems.append(f"{exc}; the EgressClass is ignored")
            continue
        if spec.name in class_specs:
            problems.append(f"EgressClass {spec.name}: defined twice; the first definition is used")
            continue
        class_specs[spec.name] = spec
    class_specs.setdefault(DEFAULT_CLASS, BUILTIN_DEFAULT_CLASS)
    frozen_classes = MappingProxyType(dict(sorted(class_specs.items())))
    budgets = list(budgets)
    problems.extend(f"EgressBudget: expected an object, got {type(b).__name__}; ignored"
                    for b in budgets if not isinstance(b, dict))
    candidates = sorted((b for b in budgets if isinstance(b, dict)), key=lambda b: (_name_of(b) != "default", _name_of(b)))
    for budget in candidates:
        try:
            policy, budget_problems = parse_budget(budget, frozen_classes)
        except PolicyError as exc:
            problems.append(f"{exc}; the EgressBudget is ignored")
            continue
        problems.extend(budget_problems)
        for other in candidates:
            if other is not budget:
                problems.append(f"EgressBudget {_name_of(other) or '?'}: only one budget is used "
                                f"(EgressBudget {policy.budget_name}); this one is ignored")
        return policy, problems
    return builtin_default_policy(frozen_classes), problems


def _name_of(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata")
    return str(meta.get("name") or "") if isinstance(meta, dict) else ""


def _spec_of(obj: Any, kind: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(obj, dict):
        raise PolicyError(f"{kind}: expected an object, got {type(obj).__name__}")
    name = _name_of(obj)
    if not DNS_NAME.match(name):
        raise PolicyError(f"{kind} {name!r}: metadata.name must be a lower-case DNS name (a-z, 0-9, '-', '.')")
    spec = {} if obj.get("spec") is None else obj["spec"]
    if not isinstance(spec, dict):
        raise PolicyError(f"{kind} {name}: spec must be an object")
    return name, spec


def _weight(value: Any, what: str) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WEIGHT:
        raise PolicyError(f"{what}: {value!r} is not an integer from 1 to {MAX_WEIGHT}")
    return value


def _rate(value: Any, what: str, default: int, allow_zero: bool) -> int:
    if value is None:
        return default
    try:
        return parse_bps(value, what, allow_zero=allow_zero)
    except ValueError as exc:
        raise PolicyError(str(exc)) from exc


def _limits_block(block: dict[str, Any], what: str, default_weight: int = 1) -> Limits:
    """One direction's {weight, min, max} block -> Limits; PolicyError naming the field."""
    min_bps, max_bps = _min_max(block, what)
    weight = default_weight if block.get("weight") is None else _weight(block["weight"], f"{what}.weight")
    return Limits(weight, min_bps, max_bps)


def _limits(spec: dict[str, Any], what: str) -> PerDirection[Limits]:
    """A class's or team's values per direction: each direction's block (`Direction.crd_block`:
    the top level for uploads, `ingress` for downloads) read by the same function; an absent
    download block = `default_download` of the upload values."""
    upload = _limits_block(spec, what)
    block = spec.get(Direction.DOWNLOAD.crd_block or "")
    if block is None:
        return PerDirection(upload, default_download(upload))
    where = f"{what}.{Direction.DOWNLOAD.crd_block}"
    if not isinstance(block, dict):
        raise PolicyError(f"{where}: must be an object {{weight, min, max}} (the download values)")
    return PerDirection(upload, _limits_block(block, where, int(upload.weight)))


def _min_max(spec: dict[str, Any], what: str) -> tuple[int, int]:
    min_bps = _rate(spec.get("min"), f"{what}: min", 0, allow_zero=True)
    max_bps = _rate(spec.get("max"), f"{what}: max", MAX_BPS, allow_zero=False)
    if min_bps > max_bps:
        raise PolicyError(f"{what}: min ({spec.get('min')}) is above max ({spec.get('max')})")
    return min_bps, max_bps


def parse_class(obj: Any) -> EgressClassSpec:
    """One EgressClass object -> EgressClassSpec; PolicyError naming the field."""
    name, spec = _spec_of(obj, "EgressClass")
    return EgressClassSpec(name, _limits(spec, f"EgressClass {name}: spec"))


def _selector(value: Any, what: str) -> NamespaceSelector:
    if not isinstance(value, dict):
        raise PolicyError(f"{what}: must be a label selector object (matchLabels, matchExpressions)")
    labels = value.get("matchLabels") or {}
    if not isinstance(labels, dict):
        raise PolicyError(f"{what}.matchLabels: must be a map of label to value")
    requirements = [LabelRequirement(str(k), "In", (str(v),)) for k, v in sorted(labels.items())]
    expressions = value.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise PolicyError(f"{what}.matchExpressions: must be a list")
    for i, e in enumerate(expressions):
        where = f"{what}.matchExpressions[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("key"), str):
            raise PolicyError(f"{where}: needs a key")
        op, values = e.get("operator"), tuple(str(v) for v in e.get("values") or ())
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise PolicyError(f"{where}: operator {op!r} is not one of In, NotIn, Exists, DoesNotExist")
        if (op in ("In", "NotIn")) != bool(values):
            raise PolicyError(f"{where}: operator {op} {'needs' if op in ('In', 'NotIn') else 'takes no'} values")
        requirements.append(LabelRequirement(e["key"], op, values))
    return NamespaceSelector(tuple(requirements))


def _class_list(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PolicyError(f"{what}: must be a list of EgressClass names")
    return tuple(dict.fromkeys(value))


def parse_budget(obj: Any, classes: Mapping[str, EgressClassSpec]) -> tuple[Policy, list[str]]:
    """One EgressBudget against the known classes -> (Policy, problems). Raises PolicyError when
    the budget as a whole is unusable (no valid total); a bad team is skipped with a problem."""
    name, spec = _spec_of(obj, "EgressBudget")
    if spec.get("total") is None:
        raise PolicyError(f"EgressBudget {name}: spec.total is required (the cluster's internet egress, e.g. \"10G\")")
    total = _rate(spec["total"], f"EgressBudget {name}: spec.total", 0, allow_zero=False)
    problems: list[str] = []
    try:
        download_total = _rate(spec.get("ingressTotal"), f"EgressBudget {name}: spec.ingressTotal", MAX_BPS,
                              allow_zero=False)
    except PolicyError as exc:  # uploads keep their budget; downloads are held by their caps until it is fixed
        problems.append(f"{exc}; no cluster download budget until it is fixed")
        download_total = MAX_BPS
    default_team = spec.get("defaultTeam") or DEFAULT_TEAM
    if not isinstance(default_team, str):
        raise PolicyError(f"EgressBudget {name}: spec.defaultTeam must be a team name")
    raw_teams = spec.get("teams") or []
    if not isinstance(raw_teams, list):
        raise PolicyError(f"EgressBudget {name}: spec.teams must be a list")
    teams: list[TeamSpec] = []
    claimed: dict[str, str] = {}
    for i, raw in enumerate(raw_teams):
        try:
            team = _parse_team(raw, f"EgressBudget {name}: spec.teams[{i}]", classes, problems)
        except PolicyError as exc:
            problems.append(f"{exc}; the team is ignored")
            continue
        if any(t.name == team.name for t in teams):
            problems.append(f"EgressBudget {name}: team {team.name} is defined twice; the first definition is used")
            continue
        if team.limits.download.min_bps > download_total:
            problems.append(f"EgressBudget {name}: spec.teams[{i}] ({team.name}).ingress.min "
                            f"({team.limits.download.min_bps} "
                            f"bit/s) is above spec.ingressTotal ({download_total} bit/s); it is scaled down to fit")
        for ns in team.namespaces:
            if ns in claimed:
                problems.append(f"EgressBudget {name}: namespace {ns} is listed by teams {claimed[ns]} and "
                                f"{team.name}; it belongs to {claimed[ns]}")
            else:
                claimed[ns] = team.name
        teams.append(team)
    if not any(t.name == default_team for t in teams):
        teams.append(TeamSpec(default_team, (), PerDirection.same(Limits(1)), DEFAULT_CLASS, ()))
    if sum(t.limits.upload.min_bps for t in teams) > total:
        problems.append(f"EgressBudget {name}: the teams' guarantees add up to more than spec.total; "
                        f"they are scaled down proportionally when all are in use (Oversubscribed)")
    problems.extend(_download_guarantee_problems(name, teams, classes, download_total))
    zone = budget_zone(spec.get("quotaTimeZone"), f"EgressBudget {name}: spec.quotaTimeZone", problems)
    return Policy(PerDirection(total, download_total), classes, tuple(teams), default_team, name, zone), problems


def _download_guarantee_problems(name: str, teams: list[TeamSpec], classes: Mapping[str, EgressClassSpec],
                                download_total: int) -> list[str]:
    """Download guarantees above spec.ingressTotal (a class's per pod, or the teams' together), each naming its field;
    scaled down when all are in use, as upload guarantees are. A single team's is reported where it is parsed."""
    if download_total >= MAX_BPS:
        return []
    out = [f"EgressClass {c.name}: spec.ingress.min ({c.limits.download.min_bps} bit/s per pod) is above "
            f"EgressBudget {name} spec.ingressTotal ({download_total} bit/s); it is scaled down to fit"
            for c in classes.values() if c.limits.download.min_bps > download_total]
    if sum(t.limits.download.min_bps for t in teams) > download_total:
        out.append(f"EgressBudget {name}: the teams' download guarantees (spec.teams[].ingress.min) add up to more "
                   f"than spec.ingressTotal; they are scaled down proportionally when all are in use (Oversubscribed)")
    return out


def _parse_team(raw: Any, what: str, classes: Mapping[str, EgressClassSpec], problems: list[str]) -> TeamSpec:
    if not isinstance(raw, dict):
        raise PolicyError(f"{what}: must be an object")
    team_name = raw.get("name")
    if not isinstance(team_name, str) or not DNS_NAME.match(team_name):
        raise PolicyError(f"{what}.name: {team_name!r} must be a lower-case DNS name")
    what = f"{what} ({team_name})"
    namespaces = raw.get("namespaces") or []
    if not isinstance(namespaces, list) or not all(isinstance(n, str) and DNS_NAME.match(n) for n in namespaces):
        raise PolicyError(f"{what}.namespaces: must be a list of namespace names")
    selector = None
    if raw.get("namespaceSelector") is not None:
        selector = _selector(raw["namespaceSelector"], f"{what}.namespaceSelector")
    limits = _limits(raw, what)
    allowed = _class_list(raw.get("allowedClasses"), f"{what}.allowedClasses")
    for c in allowed:
        if c not in classes:
            problems.append(f"{what}.allowedClasses: EgressClass {c} does not exist; pods cannot use it until it does")
    default_class = raw.get("defaultClass")
    usable = [c for c in allowed if c in classes]
    fallback = DEFAULT_CLASS if not allowed or DEFAULT_CLASS in allowed else (usable[0] if usable else DEFAULT_CLASS)
    if default_class is None:
        default_class = fallback
    elif not isinstance(default_class, str) or default_class not in classes:
        problems.append(f"{what}.defaultClass: EgressClass {default_class} does not exist; using {fallback!r}")
        default_class = fallback
    elif allowed and default_class not in allowed:
        problems.append(f"{what}.defaultClass: {default_class} is not in allowedClasses; using {fallback!r}")
        default_class = fallback
    return TeamSpec(team_name, tuple(dict.fromkeys(namespaces)), limits, default_class, allowed, selector,
                    *team_quota(raw.get("quota"), f"{what}.quota", limits, problems))  # quota, quota_refused
