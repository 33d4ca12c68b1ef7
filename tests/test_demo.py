"""The README's first command, run as a user would: it finishes, shapes, moves, and leaves nothing behind."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from lab.demo import mean_rate, settled_windows
from lab.netns import require_root

# The change lands at half the run, 23 s; the second half shows allocations moving. The window "settled
# before the change" is its last 6 s (17-23 s): a cold start (one node's first report beating its flows)
# settles in 8-10 s (docs/datapath.md), and one CI run took 10.5 s for downloads (etl-0 +5.6 % in a
# window that began at 9.2 s, within 0.6 % from 11 s on); quiet runs settle in 2-6 s (bench/demo_runs.py).
# Team web's byte quota runs out at about 60 % (28 s), team research's cost quota at about 65 % (30 s) plus
# the run's start-up lag; the end window is the last 5 s (41-46 s).
DURATION = 46


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _timeline(s: dict, window: list[int]) -> str:
    """When the change, the byte quota and the cost quota took effect, and the window, in run seconds."""
    def at(t: float | None) -> str:
        return "never" if t is None else f"{t:.1f} s"

    return (f"window {s['t'][window[0]]:.1f}-{s['t'][window[-1]]:.1f} s, change at {s['events'][0][0]:.1f} s, "
            f"web's quota spent at {at(s['quota']['exhausted_at'])}, research's cost quota at {at(s['cost']['spent_at'])}")


def test_demo_runs_shapes_to_the_budget_moves_allocations_and_cleans_up(tmp_path):
    require_root()
    before = _netns()  # other suites may create namespaces meanwhile: only the demo's own prefix is checked
    png, summary = tmp_path / "demo.png", tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "netagent", "demo", "--duration", str(DURATION), "--plain",
         "--png", str(png), "--summary-json", str(summary)],
        capture_output=True, text=True, timeout=DURATION + 120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "chart of rates over time" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    prefix = re.search(r"ip netns exec (\S+)-fab ", proc.stdout).group(1)
    assert prefix not in {n.split("-")[0] for n in before}
    left = {n for n in _netns() if n.startswith(prefix + "-")}
    assert not left, f"the demo left network namespaces behind: {sorted(left)}"
    leftovers = subprocess.run(["pgrep", "-f", "netagent (run|controller) .*netagent-demo-"],
                               capture_output=True, text=True).stdout
    assert not leftovers.strip(), f"demo processes survived: {leftovers}"

    s = json.loads(summary.read_text())
    rates = s["rate_mbps"]
    budget = s["budget_bps"] / 1e6
    assert len(rates) == 6, f"expected six pods in the table, saw {sorted(rates)}"
    late_first, late_second = settled_windows(s)  # settled before the change, and the end
    for window, fair in ((late_first, s["fair_before_bps"]), (late_second, s["fair_after_bps"])):
        means = {k: mean_rate([rates[k][i] for i in window if i < len(rates[k])]) for k in rates}
        total = sum(means.values())
        # the six pods together offer Gbit/s: without shaping the total would be far above the budget;
        # held within ±5 % while the same pods download (20 runs of bench/demo_runs.py: -0.3 to -2.3 %)
        assert 0.95 * budget <= total <= 1.05 * budget, f"total {total:.1f} Mbit/s against a {budget:.0f} Mbit/s budget"
        # every pod within 5 % of its fair share (`netagent plan`'s answer) in both windows: the
        # 6 s before the change (12 s after the start) and the end. Woken and held pods ask their caps,
        # so a node whose first report beat its flows and a class change settle within two answers
        # (bench/demo_runs.py: worst pod -2.8 % in either window over 25+ plain runs; before that
        # estimator, 3 of 35 runs read +340 % / -33 % in the first window: docs/datapath.md)
        off = {k: round(means[k] * 1e6 / fair[k] - 1, 3) for k in rates}
        # the events' times beside a miss: a late quota trip leaves its settling inside the end window
        assert all(abs(e) <= 0.05 for e in off.values()), \
            f"uploads against their fair shares {'before the change' if window is late_first else 'at the end'}: " \
            f"{off}; {_timeline(s, window)}"
    # team web's small daily upload quota ran out between the change and the end window (sized for about 60 %
    # of the run); the end's fair shares (`fair_after_bps`, held above within 5 %) are with web held at its
    # 10M exhaustedRate: its pod dropped to it and the others took the share, the total still at the budget
    quota, (change_t, _) = s["quota"], s["events"][0]
    assert quota["team"] == "web" and quota["exhausted_at"] is not None, quota
    assert change_t < quota["exhausted_at"] < s["t"][late_second[0]] - 2, (quota["exhausted_at"], change_t)
    assert s["fair_after_bps"]["web/frontend"] == 10e6
    web = rates["web/frontend"]
    assert mean_rate([web[i] for i in late_first]) > 3 * mean_rate([web[i] for i in late_second])
    assert max(used for _, used in quota["used"]) >= quota["bytes"]
    # team research's daily cost quota (its internet bytes at the policy file's NetworkScopes prices, both
    # directions: issue 39) ran out after the change and before the end window; the end's fair shares hold
    # both its directions at the cost quota's exhaustedRates (15M up, 20M down, split by its pods' classes)
    cost = s["cost"]
    assert cost["team"] == "research" and cost["spent_at"] is not None, cost
    assert change_t < cost["spent_at"] < s["t"][late_second[0]] - 2, (cost["spent_at"], change_t)
    assert max(c for _, c in cost["used"]) >= float(cost["quota"])
    for fair, held in ((s["fair_after_bps"], 15e6), (s["download"]["fair_after_bps"], 20e6)):
        assert sum(v for k, v in fair.items() if k.startswith("research/")) == held
    # every pod's flow moved (iperf3's own 0.2 s intervals, read as they were flushed)
    assert all(v is not None for v in s["first_moved_s"].values()), s["first_moved_s"]
    assert set(s["steady_total"]) == {"before_change", "end"}  # the ±1 % figure: docs/datapath.md (40 s runs)
    crawl = rates["data/crawl"]
    before_change = mean_rate([crawl[i] for i in late_first])
    after_change = mean_rate([crawl[i] for i in late_second])
    # data/crawl moved from bronze to gold and its team's weight tripled: its share must grow a lot
    assert s["fair_after_bps"]["data/crawl"] > 2 * s["fair_before_bps"]["data/crawl"]
    assert after_change > 1.5 * before_change, f"data/crawl {before_change:.1f} -> {after_change:.1f} Mbit/s"

    # downloads: the same pods share the download budget by the same classes and teams
    down = s["download"]
    drates, dbudget = down["rate_mbps"], down["budget_bps"] / 1e6
    assert len(drates) == 6, f"expected six pods' downloads, saw {sorted(drates)}"
    for window, fair in ((late_first, down["fair_before_bps"]), (late_second, down["fair_after_bps"])):
        means = {k: mean_rate([drates[k][i] for i in window if i < len(drates[k])]) for k in drates}
        total = sum(means.values())
        # six pods download at Gbit/s from the internet host: unshaped, far above the download budget.
        # Each pod's ACKs go ahead of its data in its control leaf (one FIFO held them behind its GSO
        # uploads: 25-62 % under), and no ceil goes below 4.19 Mbit/s (a one-period 27 kbit/s answer
        # left an HTB debt that stalled a pod for 19 s); 20 runs of bench/demo_runs.py here: totals
        # +0.0 to -2.4 %, no stall (docs/datapath.md)
        assert 0.95 * dbudget <= total <= 1.05 * dbudget, \
            f"download total {total:.1f} Mbit/s against a {dbudget:.0f} Mbit/s download budget"
        off = {k: round(means[k] * 1e6 / fair[k] - 1, 3) for k in drates}  # both windows, as for uploads
        assert all(abs(e) <= 0.05 for e in off.values()), \
            f"downloads against their fair shares {'before the change' if window is late_first else 'at the end'}: " \
            f"{off}; {_timeline(s, window)}"
    assert all(v is not None for v in down["first_moved_s"].values()), down["first_moved_s"]
    assert set(down["steady_total"]) == {"before_change", "end"}
    assert down["fair_after_bps"]["data/crawl"] > 2 * down["fair_before_bps"]["data/crawl"]
    dcrawl = drates["data/crawl"]
    before_dl, after_dl = mean_rate([dcrawl[i] for i in late_first]), mean_rate([dcrawl[i] for i in late_second])
    assert after_dl > 1.5 * before_dl, f"data/crawl downloads {before_dl:.1f} -> {after_dl:.1f} Mbit/s"
    # the internal download beside them is never shaped: it runs at what it offers, above the budget
    internal = down["internal"]
    offered = float(internal["offered"].rstrip("M"))
    measured = sorted(v for v in internal["rate_mbps"][len(internal["rate_mbps"]) // 3:] if v == v)
    assert measured and measured[len(measured) // 2] >= 0.95 * offered, \
        f"{internal['pod']}'s internal download at {measured[len(measured) // 2] if measured else None} Mbit/s " \
        f"of {offered:.0f} offered"
