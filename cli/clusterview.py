"""The cluster view of `netagent status --kubeconfig`: pure functions, no I/O.

`view(snapshot)` turns what cli/cluster.py read into the stable JSON of `-o json` (schema
netagent.io/status/v1, documented in docs/operations.md) with its verdict and exit code;
`render(view)` prints it in the style of `cilium status`. Exit codes: 0 healthy, 1 degraded
(controller unreachable or not ready, no leader, agents unready / fail-static / not reporting, the
API server failing), 2 netagent not installed, 3 RBAC denied something the view reads.
"""
from __future__ import annotations

import datetime as dt

from core.quantity import format_bps
from netagent.status import QUOTA_COLUMNS, quota_rows

SCHEMA = "netagent.io/status/v1"
EXIT_OK, EXIT_DEGRADED, EXIT_NOT_INSTALLED, EXIT_FORBIDDEN = 0, 1, 2, 3
EVENTS_SHOWN = 5
DIRECTIONS = ("uploads", "downloads")


def _ts(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def _budget(b: dict) -> dict:
    spec, st = b["spec"], b["status"]
    over = {c.get("type"): c.get("status") == "True" for c in st.get("conditions") or []}

    def direction(total, allocated, demand, used, condition):
        return {"total": None if total is None else str(total), "allocated": st.get(allocated),
                "demand": st.get(demand), "used": st.get(used), "oversubscribed": over.get(condition)}

    return {"name": b["name"],
            "uploads": direction(spec.get("total"), "allocated", "demand", "used", "Oversubscribed"),
            "downloads": (direction(spec.get("ingressTotal"), "ingressAllocated", "ingressDemand", "ingressUsed",
                                    "IngressOversubscribed") if spec.get("ingressTotal") is not None else None),
            "teams": [t.get("name") for t in spec.get("teams") or []],
            "pods": st.get("pods"), "nodes": st.get("nodes"),
            "teams_below_guarantee": st.get("teamsBelowGuarantee") or [], "last_computed": st.get("lastComputed")}


def _teams(direction: dict | None) -> list[dict]:
    if not direction:
        return []
    budget = direction.get("budget_bps") or 0.0
    return [{**t, "share": (t["allocated_bps"] / budget) if budget else None} for t in direction.get("teams") or []]


def _agents(pods: list[dict] | None, ctl_view: dict | None) -> dict | None:
    if pods is None:
        return None
    nodes = None if ctl_view is None else ctl_view.get("nodes") or {}
    lease = None if ctl_view is None else ctl_view.get("lease_seconds")
    unready, fail_static, not_reporting, reporting = [], [], [], 0
    for p in sorted(pods, key=lambda p: (p["node"] or "", p["name"])):
        if not p["ready"] or p["phase"] != "Running":
            unready.append({"pod": p["name"], "node": p["node"], "phase": p["phase"], "restarts": p["restarts"]})
            continue
        if nodes is None:
            continue
        age = nodes.get(p["node"])
        if age is None:
            not_reporting.append({"pod": p["name"], "node": p["node"]})
        elif lease is not None and age > lease:
            fail_static.append({"pod": p["name"], "node": p["node"], "last_report_seconds": age, "lease_seconds": lease})
        else:
            reporting += 1
    return {"pods": len(pods), "ready": len(pods) - len(unready), "reporting": None if nodes is None else reporting,
            "unready": unready, "fail_static": fail_static, "not_reporting": not_reporting}


def _controller(snap: dict, now: dt.datetime | None) -> dict:
    ctl = snap.get("controller") or {}
    lease = snap.get("lease")
    leader, expired_for = None, None
    if lease:
        leader = lease.get("holder")
        renewed = _ts(lease.get("renew_time"))
        if renewed and now and lease.get("duration_seconds"):
            late = (now - renewed).total_seconds() - lease["duration_seconds"]
            expired_for = round(late, 1) if late > 0 else None
    pods = snap.get("controllers")
    v = ctl.get("view") or {}
    return {"leader": leader if leader and expired_for is None else None, "lease": lease,
            "lease_expired_seconds": expired_for, "url": ctl.get("url"), "reachable": ctl.get("readyz") is not None,
            "ready": ctl.get("ready"), "readyz": ctl.get("readyz"), "error": ctl.get("error"),
            "ca_note": ctl.get("ca_note"), "generation": v.get("generation"),
            "pods": None if pods is None else {"total": len(pods), "ready": sum(p["ready"] for p in pods)}}


def view(snap: dict) -> dict:
    """The stable JSON view, with `verdict`, `exit_code` and `problems` (what is wrong, in words)."""
    now = _ts(snap.get("read_at"))
    problems = list(snap.get("problems") or [])
    forbidden = [p for p in problems if p["kind"] == "Forbidden"]
    out = {"schema": SCHEMA, "context": snap.get("context"), "server": snap.get("server"),
           "namespace": snap.get("namespace"), "read_at": snap.get("read_at"), "installed": True,
           "budgets": [], "classes": [], "controller": None, "teams": {d: [] for d in DIRECTIONS},
           "top_pods": [], "quotas": [], "costs": [], "agents": None, "events": [], "problems": problems}
    ns = snap.get("namespace")
    if not snap.get("crds_installed", True):
        out["installed"] = False
        problems.append({"kind": "NotInstalled", "message": "netagent is not installed in this cluster: the API server "
                         "serves no egressbudgets.netagent.io (its CRDs are missing; docs/install.md)"})
    elif not forbidden and snap.get("lease") is None and snap.get("agents") == [] and snap.get("controllers") == []:
        out["installed"] = False
        problems.append({"kind": "NotInstalled", "message": f"netagent is not installed in namespace {ns}: its CRDs "
                         "are there, but no controller Lease, no agent and no controller pods (another namespace? -n)"})
    if any(p["kind"] == "ApiServerUnreachable" for p in problems):
        out["installed"] = None  # unknown
    if out["installed"]:
        ctl_view = (snap.get("controller") or {}).get("view")
        out["budgets"] = [_budget(b) for b in snap.get("budgets") or []]
        out["classes"] = [{"name": c["name"], **{k: c["spec"].get(k) for k in ("weight", "min", "max")},
                           "downloads": c["spec"].get("ingress")} for c in snap.get("classes") or []]
        out["controller"] = ctl = _controller(snap, now)
        if ctl_view:
            out["teams"] = {d: _teams(ctl_view.get(d)) for d in DIRECTIONS}
            out["top_pods"] = ctl_view.get("top_pods") or []
            out["quotas"] = ctl_view.get("quota") or []  # volume quotas (docs/quotas.md)
            out["costs"] = ctl_view.get("cost") or []  # cost per team and scope (docs/scopes.md)
        out["agents"] = agents = _agents(snap.get("agents"), ctl_view)
        events = sorted(snap.get("events") or [], key=lambda e: e.get("last") or "", reverse=True)
        out["events"] = events[:EVENTS_SHOWN]
        if snap.get("lease") is not None and ctl["leader"] is None:
            why = (f"the Lease {ctl['lease']['name']} expired {ctl['lease_expired_seconds']:g} s ago"
                   if ctl["lease_expired_seconds"] is not None else f"the Lease {ctl['lease']['name']} names no holder")
            problems.append({"kind": "NoLeader", "message": f"no controller leads: {why}"})
        if ctl["error"] and not ctl["reachable"]:
            problems.append({"kind": "ControllerUnreachable", "message": ctl["error"] + (
                f"; {ctl['ca_note']}" if ctl["ca_note"] else "") + " (what the API server holds is shown)"})
        elif ctl["error"]:
            problems.append({"kind": "ControllerRefused" if (snap.get("controller") or {}).get("refused")
                             else "ControllerError", "message": ctl["error"]})
        if ctl["reachable"] and not ctl["ready"]:
            problems.append({"kind": "ControllerNotReady", "message": f"the controller at {ctl['url']} is not ready: "
                             f"{ctl['readyz']}"})
        for key, word in (("unready", "unready"), ("fail_static", "fail-static"), ("not_reporting", "not reporting")):
            if agents and agents[key]:
                problems.append({"kind": "Agents", "message": f"{len(agents[key])} agent(s) {word}: " + ", ".join(
                    f"{a['pod']} on {a['node']}" for a in agents[key][:5]) + (" ..." if len(agents[key]) > 5 else "")})
    kinds = {p["kind"] for p in problems}
    if forbidden:
        out["verdict"], out["exit_code"] = "forbidden", EXIT_FORBIDDEN
    elif "NotInstalled" in kinds:
        out["verdict"], out["exit_code"] = "not-installed", EXIT_NOT_INSTALLED
    elif problems:
        out["verdict"], out["exit_code"] = "degraded", EXIT_DEGRADED
    else:
        out["verdict"], out["exit_code"] = "ok", EXIT_OK
    return out


# -- text ------------------------------------------------------------------------------------

def _rate(bps) -> str:
    return "-" if bps is None else format_bps(bps)


def _table(rows: list[list[str]], indent: str) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(v: dict) -> str:
    """`v` (from `view`) as text; the verdict last, as `cilium status` ends on its errors."""
    lines = [f"netagent status   context {v['context'] or '-'}   namespace {v['namespace']}   server {v['server']}"]
    pad = " " * 16
    if v["installed"]:
        ctl = v["controller"]
        if ctl["leader"]:
            renewed = (ctl["lease"] or {}).get("renew_time")
            lines.append(f"{'Controller:':<16}leader {ctl['leader']} (Lease {ctl['lease']['name']}, renewed {renewed})")
        else:
            lines.append(f"{'Controller:':<16}no leader")
        if ctl["reachable"]:
            lines.append(f"{pad}{ctl['url']}: {'ready' if ctl['ready'] else 'NOT READY'} ({ctl['readyz']})")
        elif ctl["url"] or ctl["error"]:
            lines.append(f"{pad}UNREACHABLE: {ctl['error']}")
        if ctl["pods"] is not None:
            lines.append(f"{pad}pods: {ctl['pods']['ready']}/{ctl['pods']['total']} ready" if ctl["pods"]["total"] else
                         f"{pad}pods: none labelled app.kubernetes.io/component=controller in this namespace")
        a = v["agents"]
        if a is None:
            lines.append(f"{'Agents:':<16}unknown (their pods could not be listed)")
        else:
            reporting = "?" if a["reporting"] is None else a["reporting"]
            lines.append(f"{'Agents:':<16}{a['pods']} pods, {a['ready']} ready, {reporting} reporting to the controller")
            for key, word in (("fail_static", "fail-static"), ("unready", "unready"), ("not_reporting", "not reporting")):
                for x in a[key]:
                    detail = (f" (last report {x['last_report_seconds']:g} s ago, lease {x['lease_seconds']:g} s: "
                              "on the safe floor)" if key == "fail_static" else
                              f" (phase {x['phase']}, {x['restarts']} restarts)" if key == "unready" else "")
                    lines.append(f"{pad}{word}: {x['pod']} on node {x['node']}{detail}")
        for b in v["budgets"]:
            lines.append(f"{'Budget:':<16}{b['name']}   pods {b['pods'] if b['pods'] is not None else '-'}   "
                         f"nodes {b['nodes'] if b['nodes'] is not None else '-'}   computed {b['last_computed'] or '-'}")
            rows = [["", "TOTAL", "ALLOCATED", "DEMAND", "USED", "OVERSUBSCRIBED"]]
            for d in DIRECTIONS:
                x = b[d]
                rows.append([d, *(x[k] or "-" for k in ("total", "allocated", "demand", "used")),
                             {True: "yes", False: "no", None: "-"}[x["oversubscribed"]]] if x else
                            [d, "none", "-", "-", "-", "-"])
            lines.extend(_table(rows, pad))
            if b["teams_below_guarantee"]:
                lines.append(f"{pad}below their guarantee: {', '.join(b['teams_below_guarantee'])}")
        if not v["budgets"]:
            lines.append(f"{'Budget:':<16}none (no EgressBudget: every pod gets its class's share of nothing; docs/crds.md)")
        if v["classes"]:
            lines.append(f"{'Classes:':<16}" + ", ".join(
                f"{c['name']} (weight {c['weight'] if c['weight'] is not None else 1}"
                f"{', min ' + str(c['min']) if c['min'] is not None else ''}"
                f"{', max ' + str(c['max']) if c['max'] is not None else ''})" for c in v["classes"]))
        for d in DIRECTIONS:
            if v["teams"][d]:
                lines.append(f"Teams ({d}):")
                rows = [["TEAM", "SHARE", "ALLOCATED", "DEMAND", "USED", "GUARANTEE", "PODS"]]
                rows += [[t["team"], "-" if t["share"] is None else f"{100 * t['share']:.0f}%", _rate(t["allocated_bps"]),
                          _rate(t["demand_bps"]), _rate(t["used_bps"]),
                          _rate(t["guarantee_bps"]) + (" UNMET" if t["guarantee_unmet"] else ""), str(t["pods"])]
                         for t in v["teams"][d]]
                lines.extend(_table(rows, pad))
        if v["quotas"]:
            lines.append(f"{'Quotas:':<16}(volume per period: docs/quotas.md)")
            lines.extend(_table([[c.upper() for c in QUOTA_COLUMNS], *quota_rows(v["quotas"])], pad))
        if v.get("costs"):
            lines.append(f"{'Cost:':<16}(this period, by scope: docs/scopes.md)")
            rows = [["TEAM", "COST", "QUOTA", "INTERNET", "CROSS-ZONE", "CROSS-REGION"]]
            for c in v["costs"]:
                def money(x: float | None) -> str:
                    return "-" if x is None else f"{x:,.2f} {c['currency']}"
                scopes = c["by_scope"]
                rows.append([c["team"], money(c["period_cost"]),
                             money(c["quota_cost"]) + (" SPENT" if c["spent"] else ""),
                             *(money(scopes.get(s, 0.0)) for s in ("internet", "cross-zone", "cross-region"))])
            lines.extend(_table(rows, pad))
        if v["top_pods"]:
            lines.append(f"{'Top pods:':<16}(by measured internet traffic, both directions)")
            rows = [["POD", "NODE", "TEAM", "CLASS", "UP USED", "UP ALLOC", "UP LIMIT", "DOWN USED", "DOWN ALLOC"]]
            rows += [[f"{p['namespace']}/{p['name']}", p["node"], p["team"], p["class"], _rate(p["used_bps"]),
                      _rate(p["allocation_bps"]), _rate(p["limit_bps"]), _rate(p["download_used_bps"]),
                      _rate(p["download_allocation_bps"])] for p in v["top_pods"]]
            lines.extend(_table(rows, pad))
        if v["events"]:
            lines.append(f"{'Warnings:':<16}(Events, newest first)")
            for e in v["events"]:
                lines.append(f"{pad}{e['last'] or '-'}  {e['namespace']}/{e['object']}  {e['reason']} (x{e['count']}): "
                             f"{(e['message'] or '').strip()[:160]}")
    if v["problems"]:
        lines.append("Problems:")
        lines.extend(f"{pad}{p['kind']}: {p['message']}" for p in v["problems"])
    lines.append(f"{'Status:':<16}{v['verdict'].upper()} (exit {v['exit_code']})")
    return "\n".join(lines)
