"""Volume quotas (issue 38): a team's internet bytes per calendar Day, Week or Month, per direction.

Pure: parsing a team's `quota` block, the calendar period in a time zone, the ledger that turns the
agents' cumulative per-pod counters into a team's used bytes, and which teams are exhausted.
No I/O; the leader feeds and persists the ledger (controller/quota.py, controller/quotastore.py) and caps
exhausted teams in the engine's team columns (docs/quotas.md).

The CRD's shape (top level = uploads, an `ingress` block for downloads):
    quota: {period: Month, bytes: 50Ti, exhaustedRate: 100M, ingress: {bytes: 200Ti, exhaustedRate: 500M}}
The period is shared by both directions (written once, at the top level).
A cost quota (issue 39, docs/scopes.md) is money per period over every priced scope of both directions:
    quota: {period: Month, cost: "5000", exhaustedRate: 100M}   # in the NetworkScopes currency
a quota may carry bytes, cost or both; once the cost is spent both directions' internet traffic is held
at their exhaustedRate (the safe floor if unset), as for bytes.
"""
from __future__ import annotations

import enum
import re
from decimal import Decimal
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Iterable, Mapping
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from core.direction import DIRECTIONS, Direction, PerDirection
from core.quantity import parse_bps, parse_bytes
from core.wire import QuotaFigures

if TYPE_CHECKING:  # core.policy imports this module (its quota hook)
    from core.policy import Limits


class Period(enum.Enum):
    DAY = "Day"
    WEEK = "Week"  # ISO weeks: Monday 00:00 to the next Monday 00:00
    MONTH = "Month"


PERIODS = tuple(p.value for p in Period)


@dataclass(frozen=True, slots=True)
class DirectionQuota:
    """One direction's quota: `bytes` per period; `exhausted_bps` None = only the safe floor once spent."""

    bytes: int
    exhausted_bps: int | None = None


@dataclass(frozen=True, slots=True)
class TeamQuota:
    period: Period
    # None: no quota in that direction (a quota on uploads only, or on downloads only)
    limits: PerDirection[DirectionQuota | None]
    # money per period over every priced scope (issue 39); None: no cost quota
    cost: Decimal | None = None
    # a direction's exhaustedRate written without its bytes (only with a cost quota)
    cost_exhausted_bps: PerDirection[int | None] = field(default_factory=lambda: PerDirection(None, None))

    def exhausted_bps(self, d: Direction) -> int | None:
        """The rate direction `d` is held at once a quota (bytes or cost) is spent; None: the safe floor."""
        limit = self.limits[d]
        return limit.exhausted_bps if limit is not None else self.cost_exhausted_bps[d]


_DECIMAL = re.compile(r"[0-9]+([.][0-9]+)?")
MAX_COST = Decimal(10) ** 15  # far above any bill; bounds the decimal arithmetic


def parse_cost(value: Any, where: str) -> Decimal:
    """`quota.cost` (a decimal string like the NetworkScopes prices, "5000") -> Decimal; ValueError naming `where`."""
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    # the CRD's pattern: plain digits (no exponent, sign, NaN), at most 32 characters
    amount = Decimal(text) if len(text) <= 32 and _DECIMAL.fullmatch(text) else None
    if amount is None:
        raise ValueError(f"{where}: {value!r} is not a decimal amount such as \"5000\" or \"12.50\"")
    if amount <= 0:
        raise ValueError(f"{where}: {value!r} must be above zero (leave it out for no cost quota)")
    if amount >= MAX_COST:
        raise ValueError(f"{where}: {value!r} must be below 10^15")
    return amount


def parse_time_zone(value: Any, what: str) -> tuple[ZoneInfo, list[str]]:
    """`spec.quotaTimeZone` (an IANA name) -> (zone, problems); absent -> UTC. A bad name is a problem, UTC used."""
    if value is None:
        return ZoneInfo("UTC"), []
    if not isinstance(value, str) or not value or value.startswith("/") or ".." in value:
        return ZoneInfo("UTC"), [f"{what}: {value!r} is not an IANA time zone name (e.g. \"Europe/Berlin\", \"UTC\")"]
    try:
        return ZoneInfo(value), []
    except (ZoneInfoNotFoundError, ValueError):
        return ZoneInfo("UTC"), [f"{what}: unknown time zone {value!r}; use an IANA name "
                                 f"(e.g. \"Europe/Berlin\", \"America/New_York\", \"UTC\")"]


def forecast_seconds(left: int, rate: float) -> float | None:
    """Seconds until `left` bytes of a quota are spent at `rate` bytes a second: 0 when already spent,
    None with no use (never, at this rate)."""
    if left <= 0:
        return 0.0
    return left / rate if rate > 0 else None


def quota_figures(limit: DirectionQuota | None, used: int, byte_rate: float) -> QuotaFigures | None:
    """One direction of a team's quota as answers, /state and /v1/status show it; None without a byte quota
    in that direction. `byte_rate`: the team's bytes a second over the last minute (the forecast's)."""
    if limit is None:
        return None
    return QuotaFigures(limit.bytes, used, used >= limit.bytes, limit.exhausted_bps,
                        forecast_seconds(limit.bytes - used, byte_rate))


def period_bounds(period: Period, at: datetime, zone: ZoneInfo) -> tuple[datetime, datetime]:
    """The calendar period holding the aware instant `at`, in `zone`: [start, end) as aware datetimes.

    Boundaries are local midnights; a day across a DST change is 23 or 25 hours long, as a bill's is.
    """
    if at.tzinfo is None:
        raise ValueError("period_bounds needs an aware datetime")
    local = at.astimezone(zone)
    day = local.date()
    if period is Period.DAY:
        first, nxt = day, day + timedelta(days=1)
    elif period is Period.WEEK:
        first = day - timedelta(days=day.weekday())
        nxt = first + timedelta(days=7)
    else:
        first = day.replace(day=1)
        nxt = (first.replace(year=first.year + 1, month=1) if first.month == 12
               else first.replace(month=first.month + 1))
    # midnight of a calendar date in the zone (wall clock, so a DST change moves it in UTC, not in local time)
    start = datetime(first.year, first.month, first.day, tzinfo=zone)
    end = datetime(nxt.year, nxt.month, nxt.day, tzinfo=zone)
    return start, end


def parse_team_quota(spec: Mapping[str, Any] | None, what: str,
                     team_max_bps: PerDirection[int] | None = None) -> tuple[TeamQuota | None, list[str]]:
    """A team's `quota` block -> (TeamQuota or None, problems naming the field).

    `what` names the team, e.g. "EgressBudget main: teams[research].quota". `team_max_bps`: the team's cap
    per direction; an exhaustedRate above it is a problem. Any problem -> (None, problems): the caller keeps
    the previous valid policy (core/policy.py's rule).
    """
    if spec is None:
        return None, []
    if not isinstance(spec, Mapping):
        return None, [f"{what}: expected a mapping with period, bytes, cost, exhaustedRate, ingress"]
    problems: list[str] = []
    unknown = sorted(set(spec) - {"period", "bytes", "cost", "exhaustedRate", "ingress"})
    if unknown:
        problems.append(f"{what}: unknown field(s) {', '.join(unknown)}; "
                        f"expected period, bytes, cost, exhaustedRate, ingress")
    cost: Decimal | None = None
    if spec.get("cost") is not None:
        try:
            cost = parse_cost(spec["cost"], f"{what}.cost")
        except ValueError as exc:
            problems.append(str(exc))
    cost_rates: dict[Direction, int] = {}
    raw_period = spec.get("period")
    period: Period | None = None
    if raw_period is None:
        problems.append(f"{what}.period: required, one of {', '.join(PERIODS)}")
    elif raw_period not in PERIODS:
        problems.append(f"{what}.period: {raw_period!r} is not one of {', '.join(PERIODS)}")
    else:
        period = Period(raw_period)

    def rate_of(block: Mapping[str, Any], d: Direction, where: str) -> int | None:
        try:
            rate = parse_bps(block["exhaustedRate"], f"{where}.exhaustedRate")
        except ValueError as exc:
            problems.append(str(exc))
            return None
        cap = team_max_bps[d] if team_max_bps is not None else None
        if cap is not None and rate > cap:
            problems.append(f"{where}.exhaustedRate: {block['exhaustedRate']!r} ({rate} bit/s) is above the "
                            f"team's cap ({cap} bit/s); an exhausted team cannot get more than its cap")
            return None
        return rate

    def one(block: Any, d: Direction) -> DirectionQuota | None:
        where = what if d.crd_block is None else f"{what}.{d.crd_block}"
        if block is None:
            return None
        if not isinstance(block, Mapping):
            problems.append(f"{where}: expected a mapping with bytes, exhaustedRate")
            return None
        if d is Direction.DOWNLOAD:
            extra = sorted(set(block) - {"bytes", "exhaustedRate"})
            if extra:
                problems.append(f"{where}: unknown field(s) {', '.join(extra)}; expected bytes, exhaustedRate")
        has_rate = block.get("exhaustedRate") is not None
        if block.get("bytes") is None:
            if has_rate and spec.get("cost") is None:
                problems.append(f"{where}.bytes: required with exhaustedRate (or a cost quota)")
            elif has_rate:  # the rate a spent cost quota holds this direction at
                held = rate_of(block, d, where)
                if held is not None:
                    cost_rates[d] = held
            return None
        try:
            count = parse_bytes(block["bytes"], f"{where}.bytes")
        except ValueError as exc:
            problems.append(str(exc))
            return None
        rate: int | None = None
        if has_rate:
            rate = rate_of(block, d, where)
            if rate is None:
                return None
        return DirectionQuota(count, rate)

    limits = PerDirection(one(spec, Direction.UPLOAD), one(spec.get("ingress"), Direction.DOWNLOAD))
    if period is not None and limits.upload is None and limits.download is None and cost is None and not problems:
        problems.append(f"{what}: a quota needs bytes (uploads), ingress.bytes (downloads) or cost")
    if problems or period is None:
        return None, problems
    return TeamQuota(period, limits, cost, PerDirection(cost_rates.get(Direction.UPLOAD),
                                                        cost_rates.get(Direction.DOWNLOAD))), []


def team_quota(raw: Any, what: str, limits: PerDirection[Any], problems: list[str]) -> tuple[TeamQuota | None, bool]:
    """The policy's hook (core/policy.py): a team's `quota` block, beside its `limits` (core.policy.Limits per
    direction) -> (quota or None, refused). A refused block adds its problems, each naming the field; the caller
    keeps the team's previous valid quota in force."""
    quota, bad = parse_team_quota(raw, what, limits.map(lambda lim: int(lim.max_bps)))
    problems.extend(f"{p}; the team's previous valid quota stays in force" for p in bad)
    return quota, bool(bad)


def budget_zone(value: Any, what: str, problems: list[str]) -> str | None:
    """The policy's hook: `spec.quotaTimeZone` -> its IANA name ("UTC" if unset), None if refused (a problem
    naming the field; the previous valid zone stays in force)."""
    _, bad = parse_time_zone(value, what)
    problems.extend(f"{p}; the previous valid time zone stays in force" for p in bad)
    return None if bad else (value if value is not None else "UTC")


@dataclass(slots=True)
class _PodCounter:
    epoch: str
    last: int  # the pod's cumulative counter at its last accepted report in this epoch


@dataclass(slots=True)
class Ledger:
    """Per team and direction, the bytes used in one period, from the agents' cumulative per-pod counters.

    Each report carries, per pod and direction, a cumulative byte counter and the agent's `epoch` (new at
    every agent boot or restart; the counter restarts from 0 with it). The ledger keeps each pod's last
    counter and adds only the increase, so:
    - a retried or duplicated report adds nothing (same counter: increase 0);
    - a reordered (older) report adds nothing (a smaller counter in the same epoch is ignored, and the later
      report already counted those bytes);
    - a lost report drops nothing the agent still holds: the next report's counter includes its bytes;
    - a new epoch starts the pod's counter afresh: its first counter counts in full.
    Bound of what is lost: at an agent restart, each pod's bytes since its last delivered report (at most
    one report period of its traffic, plus the reports that failed in a row before the restart); at a pod
    deletion, its bytes since its last report (at most one report period). A report of an old epoch after a
    new one has been seen is ignored (`stale` counts it): it may drop that old report's last increase, never
    count a byte twice. Period rollover: `roll()` starts a new period's ledger keeping the pods' last counters,
    so bytes before the boundary count in the old period, bytes after it in the new one (to report precision).
    """

    used: dict[tuple[str, Direction], int] = field(default_factory=dict)
    pods: dict[tuple[str, Direction], _PodCounter] = field(default_factory=dict)
    epochs_seen: dict[str, set[str]] = field(default_factory=dict)  # pod key -> epochs already superseded
    stale: int = 0
    # True after a controller resumes from persisted use: a pod first seen then is a baseline, not counted
    # (its bytes so far are in the persisted figure or within the lost interval), so nothing counts twice
    resumed: bool = False
    fresh: set[tuple[str, Direction]] = field(default_factory=set)

    def add(self, team: str, pod: str, d: Direction, epoch: str, counter: int) -> int:
        """Account one pod's cumulative `counter` (bytes, direction d) reported in `epoch`; returns bytes added."""
        if counter < 0:
            raise ValueError(f"pod {pod}: a cumulative counter cannot be negative ({counter})")
        key = (pod, d)
        old = self.pods.get(key)
        if old is not None and epoch != old.epoch:
            if epoch in self.epochs_seen.get(pod, set()):
                self.stale += 1  # a late report of a superseded epoch
                return 0
            self.epochs_seen.setdefault(pod, set()).add(old.epoch)
            self.fresh.add(key)  # a new epoch seen live: its counter started at 0, count it in full
            old = None
        if old is None and self.resumed and key not in self.fresh:
            self.pods[key] = _PodCounter(epoch, counter)
            return 0
        added = counter if old is None else max(0, counter - old.last)
        if old is None or counter > old.last:
            self.pods[key] = _PodCounter(epoch, counter)
        if added:
            self.used[(team, d)] = self.used.get((team, d), 0) + added
        return added

    def add_report(self, epoch: str, pods: Iterable[tuple[str, str, int | None, int | None]]) -> bool:
        """One report's pods, (team, pod, upload counter, download counter) each (None: not counted), as `add`
        does each; the common case (a known pod, the same epoch) without a call per pod. True if any counted."""
        known, used, changed = self.pods, self.used, False
        for team, pod, *counters in pods:
            for d, counter in zip(DIRECTIONS, counters):
                if counter is None:
                    continue
                old = known.get((pod, d))
                if old is not None and old.epoch == epoch and counter >= 0:
                    if counter > old.last:
                        used[(team, d)] = used.get((team, d), 0) + counter - old.last
                        old.last = counter
                        changed = True
                elif self.add(team, pod, d, epoch, counter):
                    changed = True
        return changed

    def seed(self, pod: str, d: Direction, epoch: str, counter: int) -> None:
        """Know a pod's counter without counting it (a controller resuming from persisted use: the bytes up
        to `counter` are already in the persisted figure, or were lost within the persistence bound)."""
        self.pods[(pod, d)] = _PodCounter(epoch, counter)

    def team_used(self, team: str, d: Direction) -> int:
        return self.used.get((team, d), 0)

    def roll_team(self, team: str) -> None:
        """The team's new period (each team has its own): its use starts at 0; the pods' counters stay, so bytes
        before the boundary count in the old period, bytes after it in the new one."""
        for d in DIRECTIONS:
            self.used.pop((team, d), None)

    def forget_pod(self, pod: str) -> None:
        """A deleted pod: its counted bytes stay in the team's use; its counter state goes."""
        for d in DIRECTIONS:
            self.pods.pop((pod, d), None)
        self.epochs_seen.pop(pod, None)

    def roll(self) -> Ledger:
        """A new period: use starts at 0; the pods' last counters carry over so nothing is counted twice."""
        return Ledger(used={}, pods=dict(self.pods), epochs_seen={k: set(v) for k, v in self.epochs_seen.items()},
                      resumed=self.resumed, fresh=set(self.fresh))

    @classmethod
    def resume(cls, used: Mapping[tuple[str, Direction], int]) -> Ledger:
        """A ledger resumed from the persisted use (controller restart or failover). Each pod's first report
        after it is a baseline; the bytes between the last persisted write and that report are lost (at most
        one persistence interval plus one report period), and the figure is never above the true bytes."""
        return cls(used=dict(used), resumed=True)


def exhausted_teams(quotas: Mapping[str, TeamQuota], ledger: Ledger, d: Direction,
                    cost_spent: frozenset[str] = frozenset()) -> frozenset[str]:
    """The teams whose period use in direction d has reached their bytes, and those whose cost quota is spent
    (`cost_spent`, from controller/cost.py: a spent cost quota holds both directions)."""
    out = {team for team in cost_spent if team in quotas}
    for team, quota in quotas.items():
        limit = quota.limits[d]
        if limit is not None and ledger.team_used(team, d) >= limit.bytes:
            out.add(team)
    return frozenset(out)


def apply_exhaustion(limits: Mapping[str, Limits], quotas: Mapping[str, TeamQuota], exhausted: frozenset[str],
                     d: Direction, safe_floor_bps: int) -> dict[str, Limits]:
    """Each exhausted team capped at its exhaustedRate (or the safe floor), guarantee 0; others unchanged.

    A guarantee never overrides an exhausted quota; the freed share goes to the others by the engine's rules.
    The cap never rises above the team's own cap.
    """
    out = dict(limits)
    for team in exhausted:
        if team not in limits or team not in quotas:
            continue
        rate = quotas[team].exhausted_bps(d)  # bytes' or (a cost quota alone) the cost's exhaustedRate
        cap = safe_floor_bps if rate is None else rate
        cur = limits[team]
        out[team] = replace(cur, min_bps=0, max_bps=min(cur.max_bps, cap))
    return out
