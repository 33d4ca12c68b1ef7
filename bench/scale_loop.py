"""bench/scale.py's control loop in one process, without HTTP, the API server or CPU contention:
to tell the product's behaviour from the bench's (docs/scale.md, "Fairness and the budget error").

    python3 bench/scale_loop.py [--nodes 30] [--round 5] [--answer-wait] [--nominal-dt] [--why] [--true-demand]

The same pods, policy, appetites and demand shift as bench/scale.py, the agent's own demand
estimator (netagent.demand.PodDemand) and the engine (core.engine.allocate): agents report every
5 s with +-20 % jitter, a round every --round seconds over the latest reports, an answer from the
latest round (the controller's default) or, with --answer-wait, from the first round after the
report. --nominal-dt reproduces the bench's old bug (bytes of the nominal period over the time
that really passed). Printed every period: time, share of pods within 5 % of fair, sent vs
budget, the feedback gain. --why: each period after the shift, the pods off their fair share by
cause (see `causes`): the measurement behind docs/allocation.md, "Where a shift's periods go".
--true-demand: the reports carry each pod's true appetite instead of its estimator's demand (no
agent can know it: the bound of any estimator under the same timing).
"""
import argparse
import collections
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.scale import pod_object, appetite, CLASSES, budget_object, BUDGET_PER_POD_BPS, FLOOR_BPS
from core.objects import PodRecord
from core.policy import load_policy, resolve_pods
from core.engine import PodDemandIn, allocate
from netagent.demand import PodDemand, Sample

def causes(pod_team: str, rate: float, fair: float, asked: float) -> str:
    """Why a pod off its fair share is off: its demand rose (the shift's even teams, 3x) or fell
    (odd teams, 0.3x); it gets less or more than fair; its estimator asks less than fair (still
    probing up: the kernel says throttled, not by how much) or at least fair (the ask is made, the
    answer to it not yet given: the answer lag, or others' stale asks set the water level)."""
    rose = int(pod_team[4:]) % 2 == 0
    return (f"{'rose' if rose else 'fell'}/{'low' if rate < fair else 'high'}/"
            f"{'asks<fair' if asked < 0.95 * fair else 'asks>=fair'}")


def run(nodes, ppn, nominal_dt, period=5.0, round_s=5.0, steps=880, shift_at=640, seed=1, wait=False,
        why=None, true_demand=False):
    """Rows (t, share within 5 %, sent/budget - 1, gain) every period from t=15 s; with `why` (a
    list) also one Counter a period after the shift, from the shift on: pods off fair by `causes`
    ("ok": within 5 %)."""
    policy = load_policy(CLASSES, [budget_object(nodes, ppn)])[0]
    budget = nodes * ppn * BUDGET_PER_POD_BPS
    rng = random.Random(seed)
    agents = []
    for i in range(nodes):
        recs = [PodRecord.from_object(pod_object(i, j)) for j in range(ppn)]
        res = resolve_pods(policy, recs)
        r2 = random.Random(i)
        a = dict(i=i, pods=res, app={rp.key: appetite(r2) for rp in res}, lim={}, answers=0, est={rp.key: PodDemand() for rp in res},
                 by={rp.key: 0 for rp in res}, ol={rp.key: 0 for rp in res}, next=rng.uniform(0, period), last=None, report=None)
        agents.append(a)
    shifted = [False]
    fac = lambda team: 1.0 if not shifted[0] else (3.0 if int(team[4:]) % 2 == 0 else 0.3)
    result = None; prev = None; next_round = round_s
    t = 0.0; dt_step = 0.25
    out = []
    def fair():
        rows = [PodDemandIn(f"{a['i']}|{rp.key}", rp.team, rp.egress_class, rp.limits.upload.weight, rp.limits.upload.min_bps, rp.limits.upload.max_bps, a['app'][rp.key] * fac(rp.team)) for a in agents for rp in a['pods']]
        return {k: r.allocation_bps for k, r in allocate(policy, rows).pods.items()}
    def within(f):
        floor = 0.05 * budget / len(f); ok = 0
        for a in agents:
            for rp in a['pods']:
                fv = f[f"{a['i']}|{rp.key}"]; rate = min(a['app'][rp.key] * fac(rp.team), a['lim'].get(rp.key, FLOOR_BPS))
                ok += abs(rate - fv) <= 0.05 * max(fv, floor)
        return ok / len(f)
    def sent():
        return sum(min(a['app'][rp.key] * fac(rp.team), a['lim'].get(rp.key, FLOOR_BPS)) for a in agents for rp in a['pods'])
    f = None
    for step in range(steps):
        t += dt_step
        if step == shift_at:
            shifted[0] = True; f = fair()
        for a in agents:
            if t < a['next']:
                continue
            dt = period if (nominal_dt or a['last'] is None) else t - a['last']
            a['last'] = t
            tot = 0.0
            for rp in a['pods']:
                k = rp.key; want = a['app'][k] * fac(rp.team); lim = a['lim'].get(k, FLOOR_BPS)
                s = min(want, lim); tot += s
                a['by'][k] += int(s * dt / 8); a['ol'][k] += want > lim * 1.001
                a['est'][k].update(Sample(t, a['by'][k], 0, a['ol'][k], 0), int(lim), rp.limits.upload.max_bps, a['answers'])
            # the true appetites as of this report (--true-demand), not as of the round
            a['report'] = (tot, [(rp, a['est'][rp.key]) for rp in a['pods']],
                           {rp.key: min(a['app'][rp.key] * fac(rp.team), rp.limits.upload.max_bps) for rp in a['pods']})
            a['waiting'] = True
            if result is not None and not wait:
                a['answers'] += 1
                for rp in a['pods']:
                    a['lim'][rp.key] = result.pods[f"{a['i']}|{rp.key}"].limit_bps
            a['next'] = t + period * rng.uniform(0.8, 1.2)
        if t >= next_round and all(a['report'] for a in agents):
            next_round += round_s
            rows = [PodDemandIn(f"{a['i']}|{rp.key}", rp.team, rp.egress_class, rp.limits.upload.weight, rp.limits.upload.min_bps, rp.limits.upload.max_bps,
                                 a['report'][2][rp.key] if true_demand else e.demand_bps)
                    for a in agents for rp, e in a['report'][1]]
            meas = sum(a['report'][0] for a in agents); usage = sum(e.usage_bps for a in agents for _, e in a['report'][1])
            result = allocate(policy, rows, measured_total_bps=meas, shaped_usage_bps=usage, previous=result,
                              same_window=True)  # the egress is its pods' usage of the same seconds
            for a in agents:  # --answer-wait: the held answers go out from this round
                if wait and a.get('waiting'):
                    a['answers'] += 1
                    for rp in a['pods']:
                        a['lim'][rp.key] = result.pods[f"{a['i']}|{rp.key}"].limit_bps
                a['waiting'] = False
        if why is not None and step >= shift_at and (step - shift_at) % int(period / dt_step) == 0:
            floor = 0.05 * budget / len(f); c = collections.Counter()
            for a in agents:
                for rp in a['pods']:
                    fv = f[f"{a['i']}|{rp.key}"]; rate = min(a['app'][rp.key] * fac(rp.team), a['lim'].get(rp.key, FLOOR_BPS))
                    c['ok' if abs(rate - fv) <= 0.05 * max(fv, floor) else causes(rp.team, rate, fv, a['est'][rp.key].demand_bps)] += 1
            why.append(c)
        if step % int(period / dt_step) == 0 and step >= 60:
            ff = f if f is not None else None
            if ff is None and step % 40 == 0:
                ff = fair()
            if ff is not None:
                out.append((round(t), round(within(ff), 3), round(sent() / budget - 1, 3), round(result.gain, 3)))
    return out

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=30)
    ap.add_argument("--pods-per-node", type=int, default=110)
    ap.add_argument("--round", type=float, default=5.0, help="seconds between rounds (the controller's --period)")
    ap.add_argument("--answer-wait", action="store_true", help="answers from the first round after the report")
    ap.add_argument("--nominal-dt", action="store_true", help="the bench's old bug")
    ap.add_argument("--why", action="store_true", help="after the shift: the pods off fair by cause, a period a row")
    ap.add_argument("--true-demand", action="store_true", help="reports carry the pods' true appetite (an oracle)")
    args = ap.parse_args()
    print(f"# bench/scale_loop.py --nodes {args.nodes} --round {args.round:g}"
          + (" --answer-wait" if args.answer_wait else "") + (" --nominal-dt" if args.nominal_dt else "")
          + (" --true-demand" if args.true_demand else ""))
    print("# t (s), pods within 5 % of fair, sent/budget - 1, gain; demand shift at t=160")
    why: list[collections.Counter] | None = [] if args.why else None
    for row in run(args.nodes, args.pods_per_node, args.nominal_dt, round_s=args.round, wait=args.answer_wait, why=why,
                   true_demand=args.true_demand):
        print(*row)
    if why:
        print("# periods after the shift: % of pods within 5 % of fair, then off fair by cause (bench/scale_loop.causes)")
        for k, c in enumerate(why):
            n = sum(c.values())
            print(k, f"{c['ok'] / n:.1%}", " ".join(f"{w} {v / n:.1%}" for w, v in sorted(c.items()) if w != "ok"))
