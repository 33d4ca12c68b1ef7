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
"""
from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, TextIO

from core.direction import DIRECTIONS, Direction, PerDirection
from core.engine import AllocationResult, EngineError, PodDemandIn, allocate
from core.files import load_objects
from core.objects import namespace_labels
from core.policy import Policy, load_policy, resolve_pod
from core.quantity import format_bps, parse_bps

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


def run(from_file: list[str], demand: str, output: str) -> int:
    """`netagent plan`: print the allocation the policy in `from_file` gives for the demand CSV."""
    try:
        policy, problems, namespaces = read_policy([Path(f) for f in from_file])
        rows = read_demand(demand)
        result, warnings = what_if(policy, rows, demand, namespaces)
    except (PlanInputError, EngineError) as exc:
        print(f"netagent plan: error: {exc}", file=sys.stderr)
        return 2
    for message in problems + warnings:
        print(f"netagent plan: warning: {message}", file=sys.stderr)
    text = json.dumps(as_json(rows, result), indent=1) + "\n" if output == "json" else \
        as_table(policy, rows, result, wide=output == "wide")
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
            namespaces: Mapping[str, Mapping[str, str]] | None = None) -> tuple[Plan, list[str]]:
    """Both directions planned by the controller's engine: uploads always, downloads when the
    rows carry download demand. `namespaces`: namespace -> labels (a team chosen by label)."""
    labels_of = (namespaces or {}).get
    warnings: list[str] = []
    pods: PerDirection[list[PodDemandIn]] = PerDirection([], [])
    for row in rows:
        resolved = resolve_pod(policy, row.namespace, row.egress_class, row.bandwidth.upload,
                               labels_of(row.namespace), row.bandwidth.download)
        warnings.extend(f"{name}:{row.line}: {reason}: {message}" for reason, message in resolved.problems)
        for d in DIRECTIONS:
            limits = resolved.limits[d]
            pods[d].append(PodDemandIn(f"{row.namespace}/{row.pod}", resolved.team, resolved.egress_class,
                                       limits.weight, limits.min_bps, limits.max_bps, row.demand_bps[d] or 0))

    def plan(d: Direction) -> AllocationResult | None:
        planned = d is Direction.UPLOAD or any(row.demand_bps[d] is not None for row in rows)
        return allocate(policy, pods[d], direction=d) if planned else None
    return Plan(PerDirection.build(plan), pods), warnings


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
