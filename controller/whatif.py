"""`netagent plan`: the allocation a policy gives for given demands, without a cluster.

    netagent plan --from-file POLICY.yaml --demand DEMAND.csv [-o table|wide|json]

POLICY.yaml holds EgressClass and EgressBudget objects, and Namespace objects whose labels choose
teams by namespaceSelector (other kinds are ignored, so the
agent's --from-file files work as they are). DEMAND.csv has the header
`namespace,pod,class,demand` and optionally `bandwidth` (the pod's
kubernetes.io/egress-bandwidth), `ingress_demand` (the pod's download demand) and
`ingress_bandwidth` (its kubernetes.io/ingress-bandwidth); rates are bit/s, Kubernetes
quantities allowed; an empty class means the team's default, an empty ingress_demand 0.
With an `ingress_demand` column the downloads are planned too, against spec.ingressTotal
with the download values: one plan per `Direction`, the same code. The engine is the
controller's own; the CSV's and the output's words per direction are the edge (`COLUMN`, `HEAD`).

With `--used TEAM=BYTES[,uploads|downloads]` (repeatable; docs/quotas.md "netagent plan --used") the
period's use of a team with a volume quota: a team whose use has reached its quota is planned capped at
its exhaustedRate (core.quota.apply_exhaustion, as the controller caps it), and a QUOTAS table says which
teams exhaust first at the given demand: each team uses min(its demand, its allocation), the first to
run out is capped, the others are planned again, and so on.
"""
from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, TextIO

from core.direction import DIRECTIONS, Direction, PerDirection
from core.engine import AllocationResult, EngineError, PodDemandIn, allocate
from core.files import load_objects
from core.objects import namespace_labels
from core.policy import Policy, load_policy, resolve_pod
from core.quantity import TRICKLE_BPS, format_bps, human_bytes, parse_bps, parse_bytes
from core.quota import apply_exhaustion

REQUIRED_COLUMNS = ("namespace", "pod", "class", "demand")
OPTIONAL_COLUMNS = ("bandwidth", "ingress_demand", "ingress_bandwidth")
# what a direction's CSV columns and JSON keys start with (demand, bandwidth, allocation, limit), and its table headers
COLUMN = PerDirection("", "ingress_")
HEAD = PerDirection("", "INGRESS-")


class PlanInputError(ValueError):
    """A policy or demand file that cannot be used; the message names the file (and line)."""


@dataclass(frozen=True)
class DemandRow:
    line: int
    namespace: str
    pod: str
    egress_class: str | None
    demand_bps: PerDirection[int | None]  # None: the CSV has no demand column for the direction (not planned)
    bandwidth: PerDirection[str | None]


@dataclass(frozen=True)
class Plan:
    """Each direction's allocation for the demand rows (None: not planned, no demand column)."""
    results: PerDirection[AllocationResult | None]
    pods: PerDirection[list[PodDemandIn]]


def run(from_file: list[str], demand: str, output: str, used: list[str] | None = None) -> int:
    """`netagent plan`: print the allocation the policy in `from_file` gives for the demand CSV (and, with
    `used`, which teams exhaust their quota first)."""
    try:
        policy, problems, namespaces = read_policy([Path(f) for f in from_file])
        spent, quota_warnings = parse_used(policy, used or [])
        rows = read_demand(demand)
        result, warnings = what_if(policy, rows, demand, namespaces, spent)
        exhaustions = forecast(policy, result, spent) if spent else []
    except (PlanInputError, EngineError) as exc:
        print(f"netagent plan: error: {exc}", file=sys.stderr)
        return 2
    for message in problems + quota_warnings + warnings:
        print(f"netagent plan: warning: {message}", file=sys.stderr)
    if output == "json":
        out: object = as_json(rows, result)
        if spent:
            out = {"pods": out, "quotas": [e.as_dict() for e in exhaustions]}
        text = json.dumps(out, indent=1) + "\n"
    else:
        text = as_table(policy, rows, result, wide=output == "wide") + quota_table(exhaustions)
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        sys.stdout = open("/dev/null", "w")
    return 0


def read_policy(paths: list[Path]) -> tuple[Policy, list[str], dict[str, dict[str, str]]]:
    """EgressClass and EgressBudget objects from YAML files, or directories of them, and the labels of
    the Namespace objects among them (teams chosen by namespaceSelector, as the controller reads them)."""
    try:
        objects = load_objects(paths)
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None
    classes = [o for o in objects if o.get("kind") == "EgressClass"]
    budgets = [o for o in objects if o.get("kind") == "EgressBudget"]
    namespaces = {str(o["metadata"]["name"]): namespace_labels(o) for o in objects
                  if o.get("kind") == "Namespace" and (o.get("metadata") or {}).get("name")}
    policy, problems = load_policy(classes, budgets)  # no budget: the built-in default (no total, caps only)
    return policy, problems, namespaces


def read_demand(name: str) -> list[DemandRow]:
    if name == "-":
        return parse_demand(sys.stdin, "<stdin>")
    try:
        with open(name, newline="") as f:
            return parse_demand(f, name)
    except OSError as exc:
        raise PlanInputError(f"{name}: cannot read: {exc.strerror}") from exc


def parse_demand(f: TextIO, name: str) -> list[DemandRow]:
    lines = ((i, line) for i, line in enumerate(f, 1) if line.strip() and not line.lstrip().startswith("#"))
    numbered = list(lines)
    if not numbered:
        raise PlanInputError(f"{name}: empty; expected a header line {','.join(REQUIRED_COLUMNS)}")
    reader = csv.reader(line for _, line in numbered)
    header = [h.strip().lower() for h in next(reader)]
    unknown = [h for h in header if h not in REQUIRED_COLUMNS + OPTIONAL_COLUMNS]
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    header_line = numbered[0][0]
    if unknown or missing or len(set(header)) != len(header):
        raise PlanInputError(
            f"{name}:{header_line}: header must name the columns {','.join(REQUIRED_COLUMNS)} (optionally "
            f"{','.join(OPTIONAL_COLUMNS)}), each once; " +
            "; ".join(filter(None, [f"unknown: {', '.join(unknown)}" if unknown else "",
                                    f"missing: {', '.join(missing)}" if missing else ""])) or "a column is repeated")
    rows: list[DemandRow] = []
    seen: dict[tuple[str, str], int] = {}
    for (line, _), values in zip(numbered[1:], reader):
        where = f"{name}:{line}"
        if len(values) != len(header):
            raise PlanInputError(f"{where}: {len(values)} fields, the header has {len(header)}")
        row = dict(zip(header, (v.strip() for v in values)))
        if not row["namespace"] or not row["pod"]:
            raise PlanInputError(f"{where}: namespace and pod must not be empty")
        key = (row["namespace"], row["pod"])
        if key in seen:
            raise PlanInputError(f"{where}: pod {key[0]}/{key[1]} already given on line {seen[key]}")
        seen[key] = line
        try:
            demand = PerDirection.build(lambda d: _demand(row, COLUMN[d] + "demand", where))
        except ValueError as exc:
            raise PlanInputError(str(exc)) from exc
        rows.append(DemandRow(line, row["namespace"], row["pod"], row["class"] or None, demand,
                              PerDirection.build(lambda d: row.get(COLUMN[d] + "bandwidth") or None)))
    return rows


def _demand(row: dict[str, str], column: str, where: str) -> int | None:
    """A direction's demand cell (empty: 0); None when the CSV has no such column."""
    if column not in row:
        return None
    return parse_bps(row[column] or "0", f"{where}: {column}", allow_zero=True)


def what_if(policy: Policy, rows: list[DemandRow], name: str,
            namespaces: Mapping[str, Mapping[str, str]] | None = None,
            used: Mapping[tuple[str, Direction], int] | None = None) -> tuple[Plan, list[str]]:
    """Both directions planned by the controller's engine: uploads always, downloads when the
    rows carry download demand. `namespaces`: namespace -> labels (a team chosen by label). `used`: a
    team's use this period per direction; a team whose use reached its quota is capped at its exhaustedRate."""
    labels_of = (namespaces or {}).get
    warnings: list[str] = []
    pods: PerDirection[list[PodDemandIn]] = PerDirection([], [])
    for row in rows:
        resolved = resolve_pod(policy, row.namespace, row.egress_class, row.bandwidth, labels_of(row.namespace))
        warnings.extend(f"{name}:{row.line}: {reason}: {message}" for reason, message in resolved.problems)
        for d in DIRECTIONS:
            limits = resolved.limits[d]
            pods[d].append(PodDemandIn(f"{row.namespace}/{row.pod}", resolved.team, resolved.egress_class,
                                       limits.weight, limits.min_bps, limits.max_bps, row.demand_bps[d] or 0))

    def plan(d: Direction) -> AllocationResult | None:
        planned = d is Direction.UPLOAD or any(row.demand_bps[d] is not None for row in rows)
        spent = exhausted(policy, used or {}, d)
        return allocate(capped(policy, spent, d, pods[d]), pods[d], direction=d) if planned else None
    return Plan(PerDirection.build(plan), pods), warnings




def parse_used(policy: Policy, values: list[str]) -> tuple[dict[tuple[str, Direction], int], list[str]]:
    """`--used TEAM=BYTES[,uploads|downloads]` values (uploads when no direction is named) -> use per (team,
    direction), and warnings (a team without a quota in that direction). PlanInputError names the bad value."""
    used: dict[tuple[str, Direction], int] = {}
    warnings: list[str] = []
    teams = {t.name: t for t in policy.teams}
    for value in values:
        team, sep, rest = value.partition("=")
        amount, _, word = rest.partition(",")
        team, amount, word = team.strip(), amount.strip(), word.strip() or Direction.UPLOAD.view_word
        where = f"--used {value!r}"
        if not sep or not team or not amount:
            raise PlanInputError(f"{where}: expected TEAM=BYTES[,uploads|downloads], e.g. research=40Ti,downloads")
        d = next((x for x in DIRECTIONS if x.view_word == word), None)
        if d is None:
            raise PlanInputError(f"{where}: direction {word!r} is not uploads or downloads")
        if team not in teams:
            raise PlanInputError(f"{where}: {team!r} is not a team of the policy ({', '.join(sorted(teams))})")
        try:
            n = 0 if amount == "0" else parse_bytes(amount, where)
        except ValueError as exc:
            raise PlanInputError(str(exc)) from None
        if (team, d) in used:
            raise PlanInputError(f"{where}: {team}'s {word} already given")
        quota = teams[team].quota
        if quota is None or quota.limits[d] is None:
            warnings.append(f"{where}: team {team} has no quota on {word}; its use changes nothing")
        used[(team, d)] = n
    return used, warnings


def exhausted(policy: Policy, used: Mapping[tuple[str, Direction], int], d: Direction) -> frozenset[str]:
    """The teams whose use in direction d reached their quota's bytes."""
    return frozenset(t.name for t in policy.teams if t.quota is not None and (q := t.quota.limits[d]) is not None
                     and used.get((t.name, d), 0) >= q.bytes)


def capped(policy: Policy, gone: frozenset[str], d: Direction, pods: list[PodDemandIn]) -> Policy:
    """`policy` with each team of `gone` held at its exhaustedRate in direction d (without one: the safe floor,
    TRICKLE_BPS per pod, as the controller does), guarantee 0."""
    if not gone:
        return policy
    quotas = {t.name: t.quota for t in policy.teams if t.quota is not None}
    teams = []
    for t in policy.teams:
        if t.name in gone:
            floor = TRICKLE_BPS * max(1, sum(1 for p in pods if p.team == t.name))
            limit = apply_exhaustion({t.name: t.limits[d]}, quotas, frozenset((t.name,)), d, floor)[t.name]
            t = replace(t, limits=t.limits.replace(d, limit))
        teams.append(t)
    return replace(policy, teams=tuple(teams))


@dataclass(frozen=True)
class Exhaustion:
    """When a team's quota in a direction runs out at the given demand (seconds from now; 0: spent already,
    None: never at this demand)."""
    team: str
    direction: Direction
    used: int
    quota: int
    rate_bps: float  # what the team uses now: min(its demand, its allocation)
    seconds: float | None

    def as_dict(self) -> dict:
        return {"team": self.team, "direction": self.direction.view_word, "used": self.used, "bytes": self.quota,
                "rate_bps": _number(self.rate_bps), "exhausted_in_seconds": self.seconds}


def forecast(policy: Policy, plan: Plan, used: Mapping[tuple[str, Direction], int]) -> list[Exhaustion]:
    """Which teams exhaust first: at each step every team uses min(demand, allocation) until the next one runs
    out; that one is capped, the others planned again (they may take its share and run out sooner)."""
    limits = {(t.name, d): q.bytes for t in policy.teams if t.quota is not None for d in DIRECTIONS
              if (q := t.quota.limits[d]) is not None}
    planned = [d for d, result in plan.results.items() if result is not None]
    keys = [k for k in limits if k[1] in planned]
    spent = {k: float(used.get(k, 0)) for k in keys}
    when: dict[tuple[str, Direction], float] = {k: 0.0 for k in keys if spent[k] >= limits[k]}
    first_rate: dict[tuple[str, Direction], float] = {}
    now = 0.0
    for _ in range(len(keys) + 1):  # one team runs out per step
        rates = {}
        for d in planned:
            gone = frozenset(team for team, dd in when if dd is d)
            result = allocate(capped(policy, gone, d, plan.pods[d]), plan.pods[d], direction=d)
            for team, dd in keys:
                t = result.teams.get(team) if dd is d else None
                if t is not None:
                    rates[(team, d)] = min(t.allocated_bps, t.demand_bps)
        for k in keys:
            first_rate.setdefault(k, rates.get(k, 0.0))
        pending = [(k, (limits[k] - spent[k]) * 8 / rates[k]) for k in keys if k not in when and rates.get(k, 0) > 0]
        if not pending:
            break
        step = min(dt for _, dt in pending)
        for k, _ in pending:
            spent[k] += rates[k] * step / 8
        now += step
        for k, dt in pending:
            if dt <= step:
                when[k] = now
    order = sorted(keys, key=lambda k: (when.get(k, float("inf")), k[0], k[1].value))
    return [Exhaustion(team, d, used.get((team, d), 0), limits[(team, d)], first_rate.get((team, d), 0.0),
                       when.get((team, d))) for team, d in order]


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "never at this demand"
    if seconds == 0:
        return "EXHAUSTED now"
    for unit, div in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= div:
            return f"in {seconds / div:.1f} {unit}"
    return f"in {seconds:.0f} s"


def quota_table(exhaustions: list[Exhaustion]) -> str:
    """The QUOTAS table, the first to run out first."""
    if not exhaustions:
        return ""
    rows = [("QUOTAS: TEAM", "DIRECTION", "USED", "QUOTA", "RATE NOW", "EXHAUSTS")]
    rows += [(e.team, e.direction.view_word, human_bytes(e.used), human_bytes(e.quota), format_bps(e.rate_bps),
              _duration(e.seconds)) for e in exhaustions]
    return "\n" + _columns(rows) + "\n"


def as_json(rows: list[DemandRow], plan: Plan) -> list[dict]:
    out = []
    for i, row in enumerate(rows):
        p = plan.pods.upload[i]
        item: dict = {"namespace": row.namespace, "pod": row.pod, "team": p.team, "class": p.egress_class}
        for d, result in plan.results.items():
            if result is not None:
                got = result.pods[p.key]
                item.update({COLUMN[d] + "demand": row.demand_bps[d] or 0,
                             COLUMN[d] + "allocation": _number(got.allocation_bps),
                             COLUMN[d] + "limit": _number(got.limit_bps)})
        out.append(item)
    return out


def _number(bps: float) -> int | float:
    """Whole bit/s print as integers; the engine's shares are exact to far below 1 bit/s."""
    return int(round(bps)) if abs(bps - round(bps)) < 1e-6 else round(bps, 3)


def as_table(policy: Policy, rows: list[DemandRow], plan: Plan, wide: bool = False) -> str:
    planned = [(d, result) for d, result in plan.results.items() if result is not None]
    head = ("NAMESPACE", "POD", "TEAM", "CLASS")
    head += tuple(HEAD[d] + h for d, _ in planned for h in ("DEMAND", "ALLOCATION", "LIMIT"))
    if wide:
        head += tuple(HEAD[d] + h for d, _ in planned for h in ("WEIGHT", "GUARANTEE", "CAP"))
    body = []
    for i, row in enumerate(rows):
        p = plan.pods.upload[i]
        cells: tuple[str, ...] = (row.namespace, row.pod, p.team, p.egress_class)
        for d, result in planned:
            q = plan.pods[d][i]
            cells += (format_bps(q.demand_bps), format_bps(result.pods[q.key].allocation_bps),
                      format_bps(result.pods[q.key].limit_bps))
        if wide:
            cells += tuple(cell for d, _ in planned for q in (plan.pods[d][i],)
                           for cell in (f"{q.weight:g}", format_bps(q.min_bps), format_bps(q.max_bps)))
        body.append(cells)
    out = [_columns([head] + body)]
    budget = policy.budget_name or "none (built-in default: no total, caps only)"
    what = PerDirection(f"budget {budget}", "downloads (spec.ingressTotal)")
    for d, result in planned:
        out += [""] + _teams(policy, d, result, HEAD[d])
        out.append(_budget_line(what[d], result))
    return "\n".join(out) + "\n"


def _teams(policy: Policy, d: Direction, result: AllocationResult, prefix: str) -> list[str]:
    teams = [tuple(prefix + h if i else h for i, h in
                   enumerate(("TEAM", "WEIGHT", "PODS", "DEMAND", "GUARANTEE", "ALLOCATED", "LIMITS")))]
    for team in policy.teams:
        t = result.teams[team.name]
        if t.pods:
            teams.append((team.name, str(team.limits[d].weight), str(t.pods), format_bps(t.demand_bps), format_bps(t.min_bps),
                          format_bps(t.allocated_bps), format_bps(t.limit_bps) + (" (guarantees scaled)" if t.scaled
                                                                                  else "")))
    return [_columns(teams), ""]


def _budget_line(what: str, result: AllocationResult) -> str:
    return (f"{what}: total {format_bps(result.total_bps)}, allocated {format_bps(result.allocated_bps)}, "
            f"demand {format_bps(result.demand_bps)}, guarantees {format_bps(result.guaranteed_bps)}"
            + (" (Oversubscribed: guarantees exceed the total)" if result.oversubscribed else ""))


def _columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)
