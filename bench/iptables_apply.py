"""Apply netagent's classifier rules for 110 pods: iptables-restore against python-iptables.

Run as root:  python3 bench/iptables_apply.py [--pods 110] [--reps 5] [--throughput-seconds 2]

It builds a throwaway network namespace, runs the measurements inside it (legacy
backend: python-iptables drives only legacy), prints a table of median times and
the ratio python-iptables / iptables-restore, and removes the namespace.

Measured, for IPv4 and IPv6 together:
  from nothing   all our chains and rules of 110 pods, hooks included
  change         the default class for unknown sources is turned on (the node egress chain is
                 refilled, the catch-all chain created); a pod's change is no rule change since
                 issue 12 (its ipset members change), so this is the smallest rule change left
plus, for the agent's steady state, `Classifier.apply` when nothing changed (the
read-back diff) and `Classifier.counters` (with the tools: one iptables-save -c per family and an
ipset batch; in-process over netlink), and
the per-packet cost: a pod's TCP goodput to an internal peer in the lab with no
rules and with the rules of 110 pods (nft, legacy).
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from iptables import render as R  # noqa: E402
from iptables.apply import Classifier  # noqa: E402
from iptables.model import ClassifierState, PodClassification  # noqa: E402
from iptables.parse import normalise  # noqa: E402

PREFIX = "NABENCH"


def make_state(n: int, changed: bool = False, first4: str = "10.244.0.2", first6: str = "fd00:244::2") -> ClassifierState:
    a4, a6 = ipaddress.ip_address(first4), ipaddress.ip_address(first6)
    pods = tuple(PodClassification(f"bench/pod-{i}", (str(a4 + i), str(a6 + i)), (1, 0x10 + i)) for i in range(n))
    return ClassifierState(0x1000, ("10.0.0.0/8", "fd00::/8"), pods, ("eth0",), (1, 0xFFFE) if changed else None)


def restore(family: int, text: str) -> None:
    tool = "iptables-legacy-restore" if family == 4 else "ip6tables-legacy-restore"
    subprocess.run([tool, "--noflush", "-w", "5"], input=text, text=True, check=True, capture_output=True)


def teardown(clf: Classifier, state: ClassifierState) -> None:
    """Remove our chains but keep the ipsets (the python-iptables runs need them to exist)."""
    for family in (4, 6):
        rs = R.build(state, family, PREFIX)
        lines = ["*mangle", *(f"-D {h} {r}" for h, r in rs.jumps), *(f":{c} - [0:0]" for c in rs.chains),
                 *(f"-X {c}" for c in rs.chains), "COMMIT"]
        restore(family, "\n".join(lines) + "\n")


# -- python-iptables ------------------------------------------------------------------------

def iptc_rule(iptc, family: int, text: str):
    """Build a python-iptables rule from one rule of ours (every option we render)."""
    rule = iptc.Rule() if family == 4 else iptc.Rule6()
    tokens = shlex.split(text)
    i, current, negate = 0, None, False
    while i < len(tokens):
        tok = tokens[i]
        if tok == "!":
            negate, i = True, i + 1
            continue
        values = []
        while i + 1 + len(values) < len(tokens) and not tokens[i + 1 + len(values)].startswith("-") \
                and tokens[i + 1 + len(values)] != "!":
            values.append(tokens[i + 1 + len(values)])
        arg = values[0] if values else ""
        prefix = "!" if negate else ""
        if tok in ("-s", "-d", "-i", "-o"):
            setattr(rule, {"-s": "src", "-d": "dst", "-i": "in_interface", "-o": "out_interface"}[tok], prefix + arg)
        elif tok == "-m":
            current = rule.create_match(arg)
        elif tok in ("-j", "-g"):
            current = rule.create_target(arg, goto=tok == "-g")
        elif tok.startswith("--"):
            value = values if len(values) > 1 else prefix + arg
            setattr(current, tok[2:].replace("-", "_"), value)
        else:
            raise ValueError(f"bench converter does not know {tok!r} in {text!r}")
        negate = False
        i += 1 + len(values)
    if rule.target is None or not rule.target.name:
        rule.create_target("")  # a rule that only counts: the standard target, falling through
    return rule


def iptc_table(iptc, family: int):
    table = iptc.Table(iptc.Table.MANGLE) if family == 4 else iptc.Table6(iptc.Table6.MANGLE)
    table.autocommit = False
    table.refresh()
    return table


def iptc_from_nothing(iptc, state: ClassifierState) -> None:
    for family in (4, 6):
        rs = R.build(state, family, PREFIX)
        table = iptc_table(iptc, family)
        chains = {name: table.create_chain(name) for name in rs.chains}
        for name, rules in rs.chains.items():
            for text in rules:
                chains[name].append_rule(iptc_rule(iptc, family, text))
        for hook, text in rs.jumps:
            iptc.Chain(table, hook).insert_rule(iptc_rule(iptc, family, text))
        table.commit()


def iptc_change_one(iptc, state: ClassifierState) -> None:
    """The default class turned on: the catch-all chain created, the node egress chain refilled."""
    names = R.names(PREFIX)
    for family in (4, 6):
        rs = R.build(state, family, PREFIX)
        table = iptc_table(iptc, family)
        unknown = table.create_chain(names["UNKNOWN"])
        for text in rs.chains[names["UNKNOWN"]]:
            unknown.append_rule(iptc_rule(iptc, family, text))
        chain = iptc.Chain(table, names["NODE-OUT"])
        chain.flush()
        for text in rs.chains[names["NODE-OUT"]]:
            chain.append_rule(iptc_rule(iptc, family, text))
        table.commit()


# -- the measurements (inside the namespace) ------------------------------------------------

def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker(pods: int, reps: int) -> dict[str, list[float]]:
    import iptc

    base, changed = make_state(pods), make_state(pods, changed=True)
    clf = Classifier(backend="legacy", prefix=PREFIX)
    clf.apply(base)  # ipsets and a warm table
    teardown(clf, base)
    out: dict[str, list[float]] = {k: [] for k in (
        "restore_from_nothing", "restore_change_one", "classifier_change_one",
        "iptc_from_nothing", "iptc_change_one", "classifier_apply_unchanged", "classifier_counters",
        "classifier_counters_netlink")}
    texts = {f: R.render(base, f, PREFIX) for f in (4, 6)}
    for _ in range(reps):
        out["restore_from_nothing"].append(timed(lambda: [restore(f, texts[f]) for f in (4, 6)]))
        current = {f: R.build(base, f, PREFIX) for f in (4, 6)}
        updates = {f: R.render_update(R.build(changed, f, PREFIX),
                                      {c: tuple(normalise(r) for r in rules) for c, rules in current[f].chains.items()},
                                      [(h, normalise(r)) for h, r in current[f].jumps]).text for f in (4, 6)}
        out["restore_change_one"].append(timed(lambda: [restore(f, updates[f]) for f in (4, 6)]))
        out["classifier_change_one"].append(timed(lambda: clf.apply(base)))  # back, with read-back and diff
        out["classifier_apply_unchanged"].append(timed(lambda: clf.apply(base)))
        out["classifier_counters"].append(timed(lambda: clf.counters("exec")))
        out["classifier_counters_netlink"].append(timed(lambda: clf.counters("netlink")))
        teardown(clf, base)

        out["iptc_from_nothing"].append(timed(lambda: iptc_from_nothing(iptc, base)))
        out["iptc_change_one"].append(timed(lambda: iptc_change_one(iptc, changed)))
        teardown(clf, changed)
    clf.cleanup()
    # the agent's steady state on the default backend of most nodes today
    nft = Classifier(backend="nft", prefix=PREFIX)
    nft.apply(base)
    out["nft_apply_unchanged"] = [timed(lambda: nft.apply(base)) for _ in range(reps)]
    out["nft_counters"] = [timed(lambda: nft.counters("exec")) for _ in range(reps)]
    out["nft_counters_netlink"] = [timed(lambda: nft.counters("netlink")) for _ in range(reps)]
    nft.cleanup()
    return out


def throughput(pods: int, seconds: float, rounds: int = 3) -> dict[str, float]:
    """Pod -> internal peer TCP goodput (Gbit/s, median of interleaved rounds) in the lab:
    no rules, then our rules for `pods` pods on each backend."""
    from lab.topology import INTERNAL_CIDRS, PEER_V4, Lab

    runs: dict[str, list[float]] = {"no rules": [], "nft": [], "legacy": []}
    with Lab(nodes=1, pods_per_node=1) as lab:
        node, pod = lab.nodes[0], lab.nodes[0].pods[0]
        others = make_state(pods - 1, first4="10.244.0.11", first6="fd00:244::11").pods  # the lab's pod is .10
        st = ClassifierState(0x1000, INTERNAL_CIDRS,
                             (*others, PodClassification("bench/real", (pod.ip4, pod.ip6), (1, 0xF00))), (node.uplink,))
        lab.iperf_server(lab.peer, 5201)
        for _ in range(rounds):
            for label in runs:
                clf = Classifier(backend=label, netns=node.netns, prefix=PREFIX) if label != "no rules" else None
                if clf:
                    clf.apply(st)
                result = lab.iperf(pod.netns, PEER_V4, 5201, seconds=seconds)
                runs[label].append(result["end"]["sum_received"]["bits_per_second"] / 1e9)
                if clf:
                    clf.cleanup()
    return {label: statistics.median(v) for label, v in runs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=110)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--throughput-seconds", type=float, default=2,
                    help="iperf3 run per configuration for the per-packet cost (0: skip)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.pods, args.reps)))
        return 0
    if os.geteuid() != 0:
        print("bench/iptables_apply.py needs root: it creates a network namespace", file=sys.stderr)
        return 2
    ns = f"na-bench-ipt-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), "--worker",
                               "--pods", str(args.pods), "--reps", str(args.reps)],
                              capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return 1
        res = {k: statistics.median(v) * 1000 for k, v in json.loads(proc.stdout).items()}
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    rules = sum(len(r) for f in (4, 6) for r in R.build(make_state(args.pods), f, PREFIX).chains.values())
    print(f"iptables legacy backend, {args.pods} pods, IPv4+IPv6 ({rules} rules), median of {args.reps} runs, ms")
    print(f"{'':24}{'iptables-restore':>18}{'python-iptables':>18}{'ratio':>8}")
    for label, a, b in (("from nothing", "restore_from_nothing", "iptc_from_nothing"),
                        ("change (default class)", "restore_change_one", "iptc_change_one")):
        print(f"{label:24}{res[a]:>18.1f}{res[b]:>18.1f}{res[b] / res[a]:>7.1f}x")
    print(f"{'Classifier (ms)':40}{'legacy':>10}{'nft':>10}")
    print(f"{'apply, change back (read, diff, restore)':40}{res['classifier_change_one']:>10.1f}{'':>10}")
    print(f"{'apply, nothing to change (read-back)':40}{res['classifier_apply_unchanged']:>10.1f}"
          f"{res['nft_apply_unchanged']:>10.1f}")
    print(f"{'counters (iptables-save -c + ipset)':40}{res['classifier_counters']:>10.1f}{res['nft_counters']:>10.1f}")
    print(f"{'counters (in-process, netlink)':40}{res['classifier_counters_netlink']:>10.1f}"
          f"{res['nft_counters_netlink']:>10.1f}")
    if args.throughput_seconds > 0:
        gbit = throughput(args.pods, args.throughput_seconds)
        print(f"per-packet cost: pod -> internal peer TCP goodput, Gbit/s, median of 3 interleaved "
              f"{args.throughput_seconds:g} s iperf3 runs")
        for label, value in gbit.items():
            print(f"  {label:10}{value:8.2f}   {value / gbit['no rules']:6.1%} of no rules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
