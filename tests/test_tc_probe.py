"""The capability probe touches only what netagent uses: every feature it tries loads a kernel
module, and netem, cake, sfq, fw or matchall have no business on every node of a cluster."""
from __future__ import annotations

from lab.netns import scratch_netns
from tc import probe as tc_probe

USED_QDISCS = {"htb", "clsact", "fq_codel", "tbf", "pfifo"}


def test_the_probe_tries_only_what_netagent_uses(monkeypatch):
    tried: list[tuple[str, str]] = []

    class Spy(tc_probe.Shaper):
        def __init__(self, netns=None):
            super().__init__(netns)
            real = self.ipr.tc

            def tc(command, kind=None, *args, **kwargs):
                tried.append((command, kind))
                return real(command, kind, *args, **kwargs)

            self.ipr.tc = tc

        def add_fifo_root(self, index, kind, limit):
            tried.append(("add", kind))
            return super().add_fifo_root(index, kind, limit)

        def add_tbf_root(self, index, rate_bytes, burst_bytes, limit_bytes):
            tried.append(("add", "tbf"))
            return super().add_tbf_root(index, rate_bytes, burst_bytes, limit_bytes)

    monkeypatch.setattr(tc_probe, "Shaper", Spy)
    with scratch_netns("probe") as ns:
        caps = tc_probe.probe(ns)
    kinds = {kind for command, kind in tried if command.startswith("add") and isinstance(kind, str)}
    assert kinds and kinds <= USED_QDISCS, kinds
    assert not any(command == "add-filter" for command, _ in tried)  # other classifiers are not tried
    assert caps.missing() == [] and {"htb", "clsact"} <= caps.qdiscs and caps.classifiers == {"bpf"}
    assert {"tbf", "pfifo"} <= kinds  # the leaves it can fall back to were tried through our own encoders
    preferred = [k for k in ("fq_codel", "tbf") if k in caps.qdiscs]
    assert caps.leaf_qdisc == (preferred[0] if preferred else "pfifo")
