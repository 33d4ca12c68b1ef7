import time
from tests.test_datapath_traffic import lab, node, before, PORTS, M, INTERNET_V4  # noqa
from tc.sizing import LEAST_CEIL_BPS
from tc.model import fold_leaves
def st(node,pod):
    return fold_leaves(node.shaper.stats(node.state.shaper.ifb, node.state.shaper.major))[node.minor(pod)]


def test_exp(lab, node):
    a, b = node.pods
    for label, ceil, node_rate in (("own-ceil", 2*M, 4*M), ("least-ceil", LEAST_CEIL_BPS, 4*M), ("own-ceil-20", 20*M, 40*M), ("node-held-20", 40*M, 40*M)):
        lim = ceil if label.startswith("own") else node_rate//2
        node.program({a.name: (lim, ceil), b.name: (lim, ceil)}, node_rate)
        cl = [lab.iperf_async(p.netns, INTERNET_V4, port, seconds=12) for p, port in zip((a, b), PORTS)]
        time.sleep(1.5)
        prev = st(node,a)
        rows = []
        for i in range(10):
            time.sleep(1.0)
            s = st(node,a)
            rows.append((round((s.bytes-prev.bytes)*8/1e6, 2), s.drops-prev.drops, s.overlimits-prev.overlimits, s.backlog_bytes))
            prev = s
        for c in cl: c.communicate(timeout=30)
        print(label, rows)
