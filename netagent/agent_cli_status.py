"""`netagent status`: this node's pods as the running agent sees them (reads its /state)."""
from __future__ import annotations

import argparse
import json
import sys
import urllib.request

from rich.console import Console
from rich.table import Table

from .units import human_bps, human_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agent", default="127.0.0.1:9560", help="the agent's --listen address")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")


def run(args: argparse.Namespace) -> int:
    try:
        with urllib.request.urlopen(f"http://{args.agent}/state", timeout=5) as resp:
            state = json.loads(resp.read())
    except OSError as exc:
        print(f"cannot reach the agent at {args.agent}: {exc} (is `netagent run` running? see --agent)")
        return 1
    if args.output == "json":
        print(json.dumps(state, indent=2))
        return 0
    # piped into grep or a file: don't fold the table to 80 columns
    console = Console() if sys.stdout.isatty() else Console(width=250)
    ready = "[green]ready[/]" if state["ready"] else f"[red]not ready[/]: {state['ready_reason']}"
    mode = f"controller {state['controller']}" if state["controller"] else "single-node (local allocation)"
    reach = "" if not state["controller"] else (" [green]reachable[/]" if state["controller_reachable"] else " [red]unreachable[/]")
    console.print(f"node [bold]{state['node']}[/]  {ready}  {mode}{reach}"
                  f"{'  [yellow]FAIL-STATIC (safe floor)[/]' if state['fail_static'] else ''}")
    console.print(f"node allocation {human_bps(state['allocation_bps'])}   internet out "
                  f"{human_bytes(state['egress_bytes']['internet'])}, internal out {human_bytes(state['egress_bytes']['internal'])}"
                  f"   leaf qdisc {state['leaf_qdisc']}, iptables {state['iptables_backend']}")
    t = Table(show_lines=False)
    for col in ("namespace", "pod", "team", "class", "alloc", "limit", "rate", "demand", "inet out", "int out",
                "inet in", "drops", "notes"):
        t.add_column(col, justify="right" if col in ("alloc", "limit", "rate", "demand", "inet out", "int out",
                                                     "inet in", "drops") else "left")
    for p in sorted(state["pods"], key=lambda p: (p["namespace"], p["name"])):
        notes = p["waiting"] or "; ".join(f"{r}" for r, _ in p["problems"]) or ("throttled" if p["throttled"] else "")
        t.add_row(p["namespace"], p["name"], p["team"], p["egress_class"], human_bps(p["allocation_bps"]),
                  human_bps(p["limit_bps"]), human_bps(p["usage_bps"]), human_bps(p["demand_bps"]),
                  human_bytes(p["egress_bytes"]["internet"]), human_bytes(p["egress_bytes"]["internal"]),
                  human_bytes(p["ingress_bytes"]["internet"]), str(p["dropped_packets"]), notes)
    console.print(t)
    for err in state.get("source_errors") or []:
        console.print(f"[red]source:[/] {err}")
    return 0
