"""Agent logic without a kernel: demand estimation, file source, backoff."""
import os
import random
import time

from netagent.demand import MIN_DEMAND_BPS, PROBE_GAIN, PodDemand, Sample
from netagent.sources.files import FileSource
from netagent.sources.kube import Backoff

POD = """
apiVersion: v1
kind: Pod
metadata: {name: %(name)s, namespace: team-a, annotations: {netagent.io/egress-class: %(cls)s}}
spec: {nodeName: %(node)s}
status: {phase: Running, podIP: %(ip)s, podIPs: [{ip: %(ip)s}]}
"""


def test_demand_probes_above_censored_usage_and_decays():
    d = PodDemand()
    d.update(Sample(0.0, 0, 0, 0, 0), limit_bps=10_000_000, cap_bps=10**9)
    # one second at the limit: throttled, the estimate probes above it
    d.update(Sample(1.0, 10_000_000 // 8, 0, 5, 0), limit_bps=10_000_000, cap_bps=10**9)
    assert d.throttled and d.demand_bps == 10_000_000 * PROBE_GAIN
    assert d.throttled_seconds == 1.0
    # idle afterwards: no longer throttled, the remembered peak fades
    d.update(Sample(2.0, 10_000_000 // 8, 5 * 0, 5, 0), limit_bps=10_000_000, cap_bps=10**9)
    first_idle = d.demand_bps
    d.update(Sample(3.0, 10_000_000 // 8, 0, 5, 0), limit_bps=10_000_000, cap_bps=10**9)
    assert not d.throttled and d.demand_bps < first_idle
    assert d.demand_bps >= MIN_DEMAND_BPS


def test_demand_is_capped_and_survives_counter_reset():
    d = PodDemand()
    d.update(Sample(0, 0, 0, 0, 0), 10**6, cap_bps=1_200_000)
    d.update(Sample(1, 10**6 // 8, 1, 1, 0), 10**6, cap_bps=1_200_000)
    assert d.demand_bps == 1_200_000
    d.update(Sample(2, 0, 0, 0, 0), 10**6, cap_bps=1_200_000)  # class recreated: counters restart
    assert d.demand_bps == 1_200_000


def test_file_source_reloads_and_keeps_last_good(tmp_path):
    f = tmp_path / "pods.yaml"
    f.write_text(POD % dict(name="a", cls="bulk", node="n1", ip="10.244.0.11")
                 + "---" + POD % dict(name="b", cls="bulk", node="n2", ip="10.244.1.11"))
    src = FileSource([str(tmp_path)], node="n1")
    snap, changed = src.load()
    assert changed and [p.key for p in snap.pods] == ["team-a/a"]
    assert snap.pods[0].annotation("netagent.io/egress-class") == "bulk"
    assert src.load()[1] is False
    f.write_text("kind: Pod\nmetadata: {name: [broken")
    os.utime(f, (time.time() + 5, time.time() + 5))
    snap, changed = src.load()
    assert [p.key for p in snap.pods] == ["team-a/a"]  # the typo did not drop the pod
    assert snap.errors and "keeping its last good content" in snap.errors[0]
    f.write_text(POD % dict(name="a", cls="interactive", node="n1", ip="10.244.0.11"))
    os.utime(f, (time.time() + 10, time.time() + 10))
    snap, changed = src.load()
    assert changed and not snap.errors
    assert snap.pods[0].annotation("netagent.io/egress-class") == "interactive"


def test_backoff_is_jittered_exponential_and_capped():
    b = Backoff(base=0.5, cap=4, rng=random.Random(1))
    delays = [b.next() for _ in range(10)]
    assert all(0 <= d <= 4 for d in delays)
    assert max(delays[5:]) > max(delays[:2])
    b.reset()
    assert b.next() <= 0.5
