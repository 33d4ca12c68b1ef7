"""Single-machine mode's volume quotas (issue 38, docs/quotas.md "Single-machine mode").

With `--from-file` and no controller this node is the whole cluster, so the agent counts its teams' use itself
with the controller's rules (`core.quota.Ledger`: cumulative per-pod counters with the counters' epoch, only an
increase counts), caps an exhausted team through its local allocator (`core.quota.apply_exhaustion`, as the
leader does on the engine's team columns), and keeps the period's use in a state file under `--state-dir`:

- written atomically (a temporary file, fsync, rename, fsync of the directory), at most every WRITE_EVERY
  seconds and only when changed, and once more when the agent stops;
- read at start: each team's use where its `periodStart` is the team's current period start; the pods'
  counters too when the file's epoch is the kernel's (an agent restart: the counters live in the kernel, so the
  bytes sent between the last write and the restart are counted at the next look, nothing is lost or counted
  twice). A new epoch (a reboot) or a pod first seen after the start is a baseline, as after a controller's
  resume: lost at most WRITE_EVERY of the team's traffic plus one look, never counted above the true bytes.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping
from zoneinfo import ZoneInfo

from core.direction import DIRECTIONS, Direction, PerDirection
from core.policy import Policy, ResolvedPod
from core.quota import Ledger, TeamQuota, apply_exhaustion, exhausted_teams, period_bounds, quota_figures
from core.wire import quota_entry

from .view import BYTES_BY_SCOPE

log = logging.getLogger(__name__)

STATE_FILE = "quota.json"
WRITE_EVERY = 10.0  # s: the state file's write interval (the most counting a kill -9 with a reboot can lose)
RATE_WINDOW = 60.0  # s: the forecast's rate is the team's use over about this long (as the leader's)
LOOK_EVERY = 1.0  # s: how often the pods' counters are read (the overshoot past a quota: this plus a round)
FORMAT = 1

# (pod key, team, upload counter, download counter) for each pod of the node
Counters = Callable[[], list[tuple[str, str, int, int]]]


def _rfc3339(at: datetime) -> str:
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_atomically(path: Path, text: str) -> None:
    """`text` at `path` or the file as it was, never half: tmp + fsync + rename + fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class LocalQuota:
    """The node's teams' use per period, kept in `state_dir`/quota.json; `limit` caps the exhausted teams."""

    def __init__(self, state_dir: str | Path, policy: Callable[[], Policy], epoch: str | None,
                 counters: Counters | None = None, clock: Callable[[], float] = time.time,
                 write_every: float = WRITE_EVERY):
        self.path = Path(state_dir) / STATE_FILE
        self.policy = policy
        self.epoch = epoch or "unknown"
        self.counters = counters  # set by the daemon once the agent exists
        self.clock = clock
        self.write_every = write_every
        self._lock = threading.Lock()
        self.quotas: dict[str, TeamQuota] = {}
        self.zone = "UTC"
        self.starts: dict[str, datetime] = {}
        self.ledger = Ledger.resume({})
        self.write_failures = 0
        self._written = 0.0
        self._dirty = False
        self._loaded: dict[str, Any] = {}
        self._window: tuple[float, dict[tuple[str, Direction], int]] = (0.0, {})
        self._rates: dict[tuple[str, Direction], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="quota", daemon=True)

    # -- the state file -------------------------------------------------------------------------------------
    def load(self) -> None:
        """The persisted use (a missing or unreadable file: every team from 0, the pods' counters as baselines)."""
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"not a format {FORMAT} quota state")
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("quota state %s unreadable (%s): every team's use starts at 0", self.path, exc)
            return
        self._loaded = data
        log.info("quota state %s: %d team(s) kept", self.path, len(data.get("teams") or []))
        if data.get("epoch") == self.epoch:  # an agent restart: the kernel kept the counters the file saw
            for key, pair in (data.get("pods") or {}).items():
                if isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, int) and v >= 0 for v in pair):
                    for d, v in zip(DIRECTIONS, pair):
                        self.ledger.seed(key, d, self.epoch, v)

    def _resumed(self, team: str, start: datetime) -> None:
        """The file's figure of `team` when it counts the team's current period (taken once: the team's first
        period seen after the start, which may come with the first policy read from the files)."""
        for entry in self._loaded.get("teams") or []:
            if not isinstance(entry, dict) or entry.get("name") != team or entry.get("periodStart") != _rfc3339(start):
                continue
            for d, name in zip(DIRECTIONS, ("used", "ingressUsed")):
                try:
                    value = int(entry.get(name) or 0)
                except (TypeError, ValueError):
                    continue  # a hand-edited figure: that direction counts from 0
                if 0 < value < 2**63:
                    self.ledger.used[(team, d)] = value

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {"format": FORMAT, "epoch": self.epoch,
                    "teams": [{"name": t, "periodStart": _rfc3339(self.starts[t]),
                               "used": str(self.ledger.team_used(t, Direction.UPLOAD)),
                               "ingressUsed": str(self.ledger.team_used(t, Direction.DOWNLOAD))}
                              for t in sorted(self.quotas) if t in self.starts]
                    # figures read at start of teams the policy has not named yet (the files not read yet)
                    + [e for e in self._loaded.get("teams") or [] if isinstance(e, dict) and e.get("name")
                       not in self.starts],
                    "pods": {pod: [c.last for c in (self.ledger.pods.get((pod, d)) for d in DIRECTIONS)
                                   if c is not None and c.epoch == self.epoch]
                             for pod in {k for k, _ in self.ledger.pods}}}

    def write(self) -> bool:
        state = self.state()
        state["pods"] = {k: v for k, v in state["pods"].items() if len(v) == 2}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, json.dumps(state, sort_keys=True))
        except OSError as exc:  # counting goes on in memory; the next interval tries again
            self.write_failures += 1
            log.warning("quota state %s not written (%s): the use is kept in memory", self.path, exc)
            return False
        self._dirty = False
        return True

    # -- policy, periods, counting -------------------------------------------------------------------------
    def _set_policy(self, policy: Policy) -> None:
        with self._lock:
            quotas = {}
            for t in policy.teams:
                if t.quota_refused and t.name in self.quotas:
                    quotas[t.name] = self.quotas[t.name]  # the previous valid quota stays in force
                elif t.quota is not None:
                    quotas[t.name] = t.quota
            self.quotas = quotas
            self.zone = policy.quota_zone or self.zone
            self._roll(self.clock())

    def _roll(self, now: float) -> None:
        """Each team's own period: at a new one its use starts at 0, the pods' counters stay."""
        zone, at = ZoneInfo(self.zone), datetime.fromtimestamp(now, timezone.utc)
        for team, quota in self.quotas.items():
            start, _ = period_bounds(quota.period, at, zone)
            if self.starts.get(team) != start:
                if team in self.starts:
                    self.ledger.roll_team(team)
                    self._dirty = True
                else:
                    self._resumed(team, start)
                self.starts[team] = start

    def look(self) -> None:
        """Read the pods' counters, count the increases, roll periods; write the file when due."""
        self._set_policy(self.policy())
        rows = self.counters() if self.counters is not None else []
        now = self.clock()
        with self._lock:
            counted = [(team, key, up, down) for key, team, up, down in rows if team in self.quotas]
            if counted and self.ledger.add_report(self.epoch, counted):
                self._dirty = True
            then, before = self._window
            if now - then >= RATE_WINDOW:
                used = dict(self.ledger.used)
                if then > 0:
                    self._rates = {k: max(0, v - before.get(k, 0)) / (now - then) for k, v in used.items()}
                self._window = (now, used)
        if self._dirty and now - self._written >= self.write_every:
            self._written = now
            self.write()

    def exhausted(self, d: Direction) -> frozenset[str]:
        with self._lock:
            return exhausted_teams(self.quotas, self.ledger, d)

    def limit(self, policy: Policy, pods: list[ResolvedPod], d: Direction, floor_per_pod: int) -> Policy:
        """`policy` with each exhausted team of direction d capped at its exhaustedRate (or its pods' safe
        floor), guarantee 0; the same policy when none is."""
        gone = self.exhausted(d)
        if not gone:
            return policy
        with self._lock:
            quotas = dict(self.quotas)
        teams = []
        for t in policy.teams:
            if t.name in gone:
                floor = floor_per_pod * max(1, sum(1 for p in pods if p.team == t.name and p.ips))
                capped = apply_exhaustion({t.name: t.limits[d]}, quotas, frozenset((t.name,)), d, floor)[t.name]
                t = replace(t, limits=t.limits.replace(d, capped))
            teams.append(t)
        return replace(policy, teams=tuple(teams))

    def teams(self) -> list[dict[str, Any]]:
        """Each team's quota, use, exhaustion and forecast per direction (the agent's /state `quota`, in the shape
        of the leader's /v1/status `quota`: controller/view.py)."""
        now = datetime.fromtimestamp(self.clock(), timezone.utc)
        out = []
        with self._lock:
            for team, quota in sorted(self.quotas.items()):
                start, end = period_bounds(quota.period, now, ZoneInfo(self.zone))
                out.append(quota_entry(team, quota.period.value, start, end, PerDirection.build(
                    lambda d: quota_figures(quota.limits[d], self.ledger.team_used(team, d),
                                            self._rates.get((team, d), 0.0)))))
        return out

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.load()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(LOOK_EVERY):
            try:
                self.look()
            except Exception:
                log.exception("quota look failed; the use so far is kept")

    def stop(self) -> None:
        """Count what the counters hold now and write the file (a graceful stop loses nothing)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self.look()
        except Exception:
            log.exception("quota: the last look failed")
        if self._dirty:
            self.write()


def counters_of(view: Callable[[], Any], pods: Callable[[], tuple[ResolvedPod, ...]]) -> Counters:
    """The agent's pods' internet bytes per direction as the accounting metrics show them (its view), by pod key
    and team."""
    def read() -> list[tuple[str, str, int, int]]:
        team = {p.key: p.team for p in pods()}
        return [(f"{p.namespace}/{p.name}", team.get(f"{p.namespace}/{p.name}", p.team),
                 *(int(BYTES_BY_SCOPE[d](p).get("internet", 0)) for d in DIRECTIONS))
                for p in view().pods]
    return read


def persisted_use(data: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """A state file's figures per team (tests, tools)."""
    return {e["name"]: (int(e["used"]), int(e["ingressUsed"])) for e in data.get("teams") or []}
