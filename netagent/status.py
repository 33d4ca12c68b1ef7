"""`netagent status`: this node's pods as the running agent sees them (reads its /state).

Plain text columns, no terminal library: the agent's image stays small and the output
pipes into grep as it is.
"""
from __future__ import annotations

import json
import urllib.request

from core.direction import DIRECTIONS
from core.quantity import human_bps, human_bytes

COLUMNS = ("namespace", "pod", "team", "class", "alloc", "limit", "rate", "demand", "inet out", "int out",
           "inet in", "drops", "dl alloc", "dl limit", "dl rate", "dl demand", "dl drops", "notes")
NUMERIC = {"alloc", "limit", "rate", "demand", "inet out", "int out", "inet in", "drops",
           "dl alloc", "dl limit", "dl rate", "dl demand", "dl drops"}
MAX_STATE_BYTES = 16 << 20


def fetch_state(agent: str, timeout: float = 5.0) -> dict:
    """The agent's /state at HOST:PORT (raises OSError when it cannot be reached)."""
    with urllib.request.urlopen(f"http://{agent}/state", timeout=timeout) as resp:
        return json.loads(resp.read(MAX_STATE_BYTES))


def table(rows: list[tuple[str, ...]], header: tuple[str, ...], right: set[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [str(c).rjust(w) if h in right else str(c).ljust(w) for c, w, h in zip(r, widths, header)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def render(state: dict) -> str:
    """The status page: a header line per node fact, then one row per pod."""
    ready = "ready" if state["ready"] else f"NOT READY: {state['ready_reason']}"
    mode = f"controller {state['controller']}" if state["controller"] else "single-node (local allocation)"
    reach = "" if not state["controller"] else (" reachable" if state["controller_reachable"] else " UNREACHABLE")
    out = [f"node {state['node']}  {ready}  {mode}{reach}"
           f"{'  FAIL-STATIC (safe floor)' if state['fail_static'] else ''}",
           f"node allocation {human_bps(state['allocation_bps'])}   internet out "
           f"{human_bytes(state['egress_bytes']['internet'])}, internal out {human_bytes(state['egress_bytes']['internal'])}"
           f"   leaf qdisc {state['leaf_qdisc']}, iptables {state['iptables_backend']}",
           "downloads (internet -> pod): " + (
               f"node allocation {human_bps(state['ingress_allocation_bps'])}   internet in "
               f"{human_bytes(state['ingress_bytes']['internet'])}, internal in {human_bytes(state['ingress_bytes']['internal'])}"
               if state.get("ingress_allocation_bps") is not None else "not shaped"), ""]
    rows = []
    for p in sorted(state["pods"], key=lambda p: (p["namespace"], p["name"])):
        notes = p["waiting"] or "; ".join(f"{r}" for r, _ in p["problems"]) or ", ".join(
            what for what, on in (("throttled", p["throttled"]), ("download throttled", p.get("ingress_throttled")))
            if on)
        rows.append((p["namespace"], p["name"], p["team"], p["egress_class"], human_bps(p["allocation_bps"]),
                     human_bps(p["limit_bps"]), human_bps(p["usage_bps"]), human_bps(p["demand_bps"]),
                     human_bytes(p["egress_bytes"]["internet"]), human_bytes(p["egress_bytes"]["internal"]),
                     human_bytes(p["ingress_bytes"]["internet"]), str(p["dropped_packets"]),
                     human_bps(p.get("ingress_allocation_bps", 0)), human_bps(p.get("ingress_limit_bps", 0)),
                     human_bps(p.get("ingress_usage_bps", 0)), human_bps(p.get("ingress_demand_bps", 0)),
                     str(p.get("ingress_dropped_packets", 0)), notes))
    out.append(table(rows, COLUMNS, NUMERIC))
    out += quota_lines(state)
    out += [f"source: {err}" for err in state.get("source_errors") or []]
    return "\n".join(out)


QUOTA_COLUMNS = ("team", "period", "direction", "used", "quota", "spent", "forecast")
NOT_KNOWN = ("quotas: not known (no answer carrying them yet: an older controller, or a new leader not yet "
             "resumed; `netagent status --kubeconfig` shows the leader's)")


def quota_lines(state: dict) -> list[str]:
    """The quotas table of /state `quota`: the agent's own count (single-machine mode) or, with a controller,
    the leader's figures from its last answer that carried them, with that answer's age (they are as old)."""
    quotas, age = state.get("quota"), state.get("quota_age_seconds")
    if quotas is None and state.get("controller"):
        return ["", NOT_KNOWN]
    if not quotas:
        return []
    source = "" if age is None else f"; the controller's figures as of its answer {age:.0f} s ago"
    return ["", f"quotas (volume per period, docs/quotas.md{source}):", quota_table(quotas)]


def quota_table(quotas: list[dict]) -> str:
    """The node's teams' quotas (/state `quota`, the leader's /v1/status shape, in both modes): per team and
    direction its use, quota, share spent and the forecast time to exhaustion at the last minute's rate."""
    return table(quota_rows(quotas), QUOTA_COLUMNS, {"used", "quota", "spent", "forecast"})


def quota_rows(quotas: list[dict]) -> list[list[str]]:
    """One row (QUOTA_COLUMNS) per team and direction with a quota, from entries in core.wire.quota_entry's
    shape: what `netagent status` and `netagent cluster` print."""
    rows = []
    for q in quotas:
        for d in DIRECTIONS:
            x = q.get(d.view_word)
            if not x:
                continue
            left = x.get("forecast_seconds")
            rows.append([q["team"], f"{q['period']} from {q['period_start'][:16]}", d.view_word, human_bytes(x["used"]),
                         human_bytes(x["bytes"]),
                         f"{100 * x['used'] / x['bytes']:.0f}%" + (" EXHAUSTED" if x["exhausted"] else ""),
                         "-" if left is None else f"{left / 3600:.1f} h"])
    return rows
