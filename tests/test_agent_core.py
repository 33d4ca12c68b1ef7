"""The agent's decisions without a kernel: which pods get a class, adoption after a restart,
the fail-static lease, drift accounting. The data path here is the in-memory fake that
lives beside the DataPath protocol (the real one is exercised in tests/test_agent_lab.py)."""
from __future__ import annotations

import dataclasses
import time

from core.direction import PerDirection
from core.objects import MAX_SERVICE_CIDRS, PodRecord, Snapshot, service_cidrs_of
from core.policy import shaped_pods
from netagent.allocations import Allocation, AllocationSet
from netagent.datapath_fake import FakeDataPath
import pytest

from netagent.desired import DataPathOptions, PodShape, assign_minors, from_wire, to_wire
from tc.model import ack_minor, bulk_minor
from tc.sizing import LEAST_CEIL_BPS
from tests.agents import make_agent

M = 1_000_000
CLASSES = ({"kind": "EgressClass", "metadata": {"name": "bronze"}, "spec": {"max": "20M"}},)
BUDGETS = ({"kind": "EgressBudget", "metadata": {"name": "default"},
            "spec": {"total": "1G", "teams": [{"name": "a", "namespaces": ["ns"], "defaultClass": "bronze"}]}},)


def wire(*ip_bps: int):
    """The HTB rates that carry these IP rates (the desired state holds frame rates)."""
    out = tuple(to_wire(b, DataPathOptions()) for b in ip_bps)
    return out[0] if len(out) == 1 else out


def pod(name: str, ip: str | None, host_network=False, phase="Running", deleting=False, **ann) -> PodRecord:
    return PodRecord("ns", name, f"uid-{name}", "n1", (ip,) if ip else (), host_network, phase,
                     tuple(sorted(ann.items())), deleting=deleting)


def sample(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0


def test_which_pods_get_a_class():
    pods = shaped_pods([
        pod("host", "10.0.0.5", host_network=True),  # node traffic
        pod("done", "10.244.0.9", phase="Succeeded"),  # its IP is free again
        pod("waiting", None),
        pod("old", "10.244.0.10", deleting=True),  # being deleted; its IP went to "new"
        pod("new", "10.244.0.10"),
    ])
    got = {p.name: p.ips for p in pods}
    assert got == {"waiting": (), "old": (), "new": ("10.244.0.10",)}


def test_local_mode_shapes_a_new_pod_in_the_same_sync_and_tells_about_bad_annotations():
    dp = FakeDataPath()
    agent, metrics = make_agent(dp)
    agent.on_snapshot(Snapshot((pod("p", "10.244.0.10", **{"netagent.io/egress-class": "gold"}),), CLASSES, BUDGETS))
    assert agent.sync()
    classes = {c.key: c for c in dp.applied[-1].shaper.pods}
    assert classes["ns/p"].ceil == wire(20 * M)  # the team's default class, bronze
    assert dp.applied[-1].shaper.node_rate == wire(1000 * M)  # the budget's total caps the node
    assert agent.pods[0].problems[0][0] == "UnknownEgressClass"


def test_restart_adopts_what_the_kernel_holds():
    minor = assign_minors([PodShape("ns/p", ("10.244.0.10",), 1, 1)])["ns/p"]
    dp = FakeDataPath(adopted={1: (700 * M, 700 * M), minor: (3 * M, 17 * M), 0xFFFE: (M, M)})
    agent, metrics = make_agent(dp)
    agent.start()
    try:
        agent.on_snapshot(Snapshot((pod("p", "10.244.0.10"),), CLASSES, BUDGETS))
        deadline = time.monotonic() + 10
        while not dp.applied and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        agent.stop()
    desired = dp.applied[0]
    assert desired.shaper.node_rate == wire(700 * M)
    assert [(c.rate, c.ceil) for c in desired.shaper.pods] == [wire(3 * M, 17 * M)]


def test_controller_lease_then_floor_and_drift_accounting():
    dp = FakeDataPath()
    agent, metrics = make_agent(dp, controller="http://controller")
    agent.on_snapshot(Snapshot((pod("p", "10.244.0.10"),), CLASSES, BUDGETS))
    agent.set_allocations(PerDirection(AllocationSet(pods={"ns/p": Allocation(5 * M, 9 * M)}, node_rate_bps=50 * M,
                                                     safe_floor_bps=2 * M, lease_expires=time.monotonic() + 60,
                                                     source="controller"), None))
    assert agent.sync()
    assert [(c.rate, c.ceil) for c in dp.applied[-1].shaper.pods] == [wire(5 * M, 9 * M)]
    # the same plan again, yet the kernel needed changes: someone else changed it
    dp.next_changes = {"tc": 2, "iptables": 1}
    assert agent.sync()
    assert sample(metrics, "netagent_drift_repairs_total", kind="tc") == 2
    assert sample(metrics, "netagent_drift_repairs_total", kind="iptables") == 1
    # the lease runs out: the floor, never nothing
    dp.next_changes = {"tc": 1}
    agent.allocations.current.lease_expires = time.monotonic() - 1
    assert agent.sync()
    assert [(c.rate, c.ceil) for c in dp.applied[-1].shaper.pods] == [wire(2 * M, 2 * M)]
    assert agent.fail_static and agent.view().allocation_source == "floor"
    assert sample(metrics, "netagent_drift_repairs_total", kind="tc") == 2  # a planned change is not drift


def test_an_answer_near_zero_still_leaves_the_least_ceil_within_the_node():
    """A pod answered with 27 kbit/s (idle when it was reported) gets a ceil of LEAST_CEIL_BPS: HTB
    would keep a GSO packet's debt at 27k for 19 s. A pod capped lower keeps its cap, and the
    node's rate bounds every ceil (the budget holds: the floor is only borrowed inside the node)."""
    small = ({"kind": "EgressClass", "metadata": {"name": "tiny"}, "spec": {"max": "1M"}},)
    for node_rate, classes, ann, want in ((50 * M, CLASSES, {}, LEAST_CEIL_BPS),
                                         (50 * M, CLASSES + small, {"netagent.io/egress-class": "tiny"}, 1 * M),
                                         (2 * M, CLASSES, {}, 2 * M)):
        dp = FakeDataPath()
        agent, _ = make_agent(dp, controller="http://controller")
        agent.on_snapshot(Snapshot((pod("p", "10.244.0.10", **ann),), classes, BUDGETS))
        agent.set_allocations(PerDirection(AllocationSet(pods={"ns/p": Allocation(27_000, 27_000)},
                                                         node_rate_bps=node_rate, safe_floor_bps=10_000,
                                                         lease_expires=time.monotonic() + 60, source="controller"), None))
        assert agent.sync()
        assert [(c.rate, c.ceil) for c in dp.applied[-1].shaper.pods] == [wire(27_000, want)], (node_rate, ann)


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_failed_apply_is_retried_with_a_full_read_and_the_old_state_stays():
    dp = FakeDataPath()
    agent, metrics = make_agent(dp)
    agent.start()
    try:
        agent.on_snapshot(Snapshot((pod("p", "10.244.0.10"),), CLASSES, BUDGETS))
        wait_until(lambda: dp.applied)
        dp.fail_with = RuntimeError("netlink: device busy")
        agent.on_snapshot(Snapshot((pod("p", "10.244.0.10"), pod("q", "10.244.0.11")), CLASSES, BUDGETS))
        wait_until(lambda: len(dp.applied) >= 2)  # the retry after the failure
        assert dp.full[-1] is True  # a retry re-reads the whole kernel state
        assert {c.key for c in dp.applied[-1].shaper.pods} == {"ns/p", "ns/q"}
        assert sample(metrics, "netagent_reconcile_errors_total", stage="apply") == 1
        assert agent.readiness()[0]
    finally:
        agent.stop()


def test_the_sampler_turns_class_counters_into_usage_and_demand():
    from tc.model import ClassStats

    dp = FakeDataPath()
    agent, _ = make_agent(dp)
    agent.on_snapshot(Snapshot((pod("p", "10.244.0.10"),), CLASSES, BUDGETS))
    assert agent.sync()
    minor = agent.node.state.minors["ns/p"]
    ceil = next(c.ceil for c in dp.applied[-1].shaper.pods if c.minor == minor)
    for sent in (0, 1_000_000):  # 1 MB in the interval between two samples
        dp.stats = {minor: ClassStats(minor, sent, sent // 1000, 0, 0, 0, 0, ceil // 8, ceil // 8)}
        agent.sampler.sample()
        time.sleep(0.2)
    view = {p.name: p for p in agent.view().pods}["p"]
    assert view.usage_bps > 0 and view.demand_bps >= view.usage_bps * 0.5
    assert not view.throttled


def test_a_class_that_carries_acks_beside_its_data_gets_its_measured_wire_ratio():
    """A pod whose upload class carries its download's ACKs (one 66-byte frame for every two
    full-size ones) is given its limit in frames of its own mix at the next sync, so its limit is
    IP bytes for what it really sends; the view still shows the IP limit; a pod sending full-size
    segments only keeps the exact full-size conversion (netagent/frames.py)."""
    from tc.model import NODE_MINOR, ClassStats

    dp = FakeDataPath()
    agent, _ = make_agent(dp)
    agent.on_snapshot(Snapshot((pod("p", "10.244.0.10"), pod("q", "10.244.0.11")), CLASSES, BUDGETS))
    assert agent.sync()
    minors = agent.node.state.minors
    before = {c.key: c for c in dp.applied[-1].shaper.pods}
    opts = DataPathOptions()
    for n in (0, 1, 2):  # cumulative counters: p 2,000 segments and 1,000 ACKs a reading, q segments only
        p_frames, p_packets = n * (2000 * 1514 + 1000 * 66), n * 3000
        dp.stats = {minors["ns/p"]: ClassStats(minors["ns/p"], p_frames, p_packets, 0, 0, 0, 0, 0, 0),
                    minors["ns/q"]: ClassStats(minors["ns/q"], n * 2000 * 1514, n * 2000, 0, 0, 0, 0, 0, 0),
                    NODE_MINOR: ClassStats(NODE_MINOR, p_frames + n * 2000 * 1514, p_packets + n * 2000,
                                           0, 0, 0, 0, 0, 0)}
        agent.sampler.sample()
    ratio = (2000 * 1514 + 1000 * 66) / (2000 * 1500 + 1000 * 52)
    frames = agent.lanes.upload.frames
    assert frames.get("ns/p") == pytest.approx(ratio) and frames.get("ns/q") is None
    assert agent.sync()
    after = {c.key: c for c in dp.applied[-1].shaper.pods}
    limit_p = from_wire(before["ns/p"].ceil, opts)  # the IP limit, unchanged
    assert after["ns/p"].ceil == to_wire(limit_p, opts, ratio) > before["ns/p"].ceil
    assert after["ns/q"] == before["ns/q"]
    view = {v.name: v for v in agent.view().pods}
    assert abs(view["p"].limit_bps - limit_p) <= 8 and view["q"].limit_bps == from_wire(before["ns/q"].ceil, opts)


def test_a_woken_pod_asks_at_most_the_budget():
    """A pod that starts throttled after idling asks its cap (the engine answers with its fair
    share); with no cap of its own that ask is the budget, not 2**53 bit/s on every dashboard."""
    from tc.model import ClassStats

    budgets = ({"kind": "EgressBudget", "metadata": {"name": "default"},
                "spec": {"total": "300M", "teams": [{"name": "a", "namespaces": ["ns"]}]}},)
    dp = FakeDataPath()
    agent, _ = make_agent(dp)
    agent.on_snapshot(Snapshot((pod("p", "10.244.0.10"),), (), budgets))
    assert agent.sync()
    minor = agent.node.state.minors["ns/p"]
    ceil = next(c.ceil for c in dp.applied[-1].shaper.pods if c.minor == minor)
    for sent, backlog in ((0, 0), (0, 0), (1_000_000, 60_000)):  # idle, idle, then 8 Mbit/s and held
        dp.stats = {minor: ClassStats(minor, sent, sent // 1000, 0, 0, backlog, backlog // 1500, ceil // 8, ceil // 8)}
        agent.sampler.sample()
        time.sleep(0.2)
    view = {p.name: p for p in agent.view().pods}["p"]
    assert view.throttled and view.demand_bps == 300 * M


# -- downloads (issue 13) -------------------------------------------------------------------------

DL_CLASSES = ({"kind": "EgressClass", "metadata": {"name": "bronze"},
               "spec": {"max": "20M", "ingress": {"weight": 1, "max": "300M"}}},)
DL_BUDGETS = ({"kind": "EgressBudget", "metadata": {"name": "default"},
               "spec": {"total": "1G", "ingressTotal": "400M",
                        "teams": [{"name": "a", "namespaces": ["ns"], "defaultClass": "bronze"}]}},)


def download_classes(desired) -> dict:
    return {c.key: (c.rate, c.ceil) for c in desired.shapers.download.pods}


def test_local_mode_shares_the_download_total_and_honours_the_ingress_annotation():
    """Single-node mode runs the engine on the download direction: the node's download class is the
    budget's ingressTotal, a pod's download cap is its class's ingress max lowered by
    kubernetes.io/ingress-bandwidth; the download shaper sits on the pod devices."""
    dp = FakeDataPath()
    dp.devices = ("eth0", "vp0", "vp1")
    agent, metrics = make_agent(dp)
    agent.on_snapshot(Snapshot((pod("a", "10.244.0.10"), pod("b", "10.244.0.11", **{"kubernetes.io/ingress-bandwidth": "50M"})),
                               DL_CLASSES, DL_BUDGETS))
    assert agent.sync()
    desired = dp.applied[-1]
    assert desired.shapers.download.node_rate == wire(400 * M)
    assert desired.shapers.download.devices == ("vp0", "vp1")  # the pod devices, never the uplink
    got = download_classes(desired)
    assert got["ns/a"][1] <= wire(300 * M) and got["ns/b"][1] <= wire(50 * M)
    # uploads are unchanged by it: bronze's 20M
    assert {c.key: c.ceil for c in desired.shaper.pods}["ns/a"] == wire(20 * M)
    # each pod's downloads go to its bulk leaf in the download tree, its small TCP segments to its control leaf
    assert [p.ingress_class for p in desired.classifier.pods] == [(2, bulk_minor(m)) for m in sorted(desired.minors.values())]
    assert [p.ingress_ack_class for p in desired.classifier.pods] == [(2, ack_minor(m)) for m in sorted(desired.minors.values())]
    # metrics and /state show both directions
    assert sample(metrics, "netagent_pod_ingress_limit_bytes_per_second", namespace="ns", pod="b") == pytest.approx(
        from_wire(got["ns/b"][1], DataPathOptions()) / 8)
    assert sample(metrics, "netagent_node_ingress_allocation_bytes_per_second") == 400 * M / 8
    assert sample(metrics, "netagent_pod_egress_limit_bytes_per_second", namespace="ns", pod="a") == 20 * M / 8
    state = agent.view().as_dict()
    assert state["ingress_allocation_bps"] == 400 * M and state["pods"][1]["ingress_limit_bps"] <= 50 * M
    from netagent.status import render
    text = render(state)
    assert "downloads (internet -> pod): node allocation 400.0 Mbit/s" in text and "dl limit" in text
    # a new pod device gets the download filter: a planned tc change, not drift
    dp.devices, dp.next_changes = ("eth0", "vp0", "vp1", "vp2"), {"tc": 2}
    assert agent.sync() and dp.applied[-1].shapers.download.devices == ("vp0", "vp1", "vp2")
    assert sample(metrics, "netagent_drift_repairs_total", kind="tc") == 0


def test_a_woken_pod_asks_its_download_cap_downloads_and_its_upload_cap_uploads():
    """The sampler's two directions each read the pod's own cap: kubernetes.io/ingress-bandwidth
    (50M, under the class's ingress max of 300M) for downloads, the class's 20M for uploads."""
    from tc.model import ClassStats

    dp = FakeDataPath()
    dp.devices = ("eth0", "vp0")
    agent, _ = make_agent(dp)
    agent.on_snapshot(Snapshot((pod("b", "10.244.0.11", **{"kubernetes.io/ingress-bandwidth": "50M"}),),
                               DL_CLASSES, DL_BUDGETS))
    assert agent.sync() and dp.applied[-1].shapers.download
    minor = agent.node.state.minors["ns/b"]
    for sent, backlog in ((0, 0), (0, 0), (1_000_000, 60_000)):  # idle, idle, then held both ways
        st = ClassStats(minor, sent, sent // 1000, 0, 0, backlog, backlog // 1500, 1000, 1000)
        dp.stats, dp.download_stats = {minor: st}, {minor: st}
        agent.sampler.sample()
        time.sleep(0.2)
    assert agent.demand["ns/b"].demand_bps == 20 * M
    assert agent.lanes.download.demand["ns/b"].demand_bps == 50 * M


def test_a_bad_ingress_annotation_keeps_the_default_download_class_and_is_told():
    dp = FakeDataPath()
    agent, metrics = make_agent(dp)
    for bad in ("-5M", "0", "lots", "1e30"):
        agent.on_snapshot(Snapshot((pod("a", "10.244.0.10", **{"kubernetes.io/ingress-bandwidth": bad}),),
                                   DL_CLASSES, DL_BUDGETS))
        assert agent.sync(), bad
        p = agent.pods[0]
        assert [r for r, _ in p.problems] == ["InvalidIngressBandwidth"], (bad, p.problems)
        assert "kubernetes.io/ingress-bandwidth" in p.problems[0][1]
        assert download_classes(dp.applied[-1])["ns/a"][1] <= wire(300 * M)  # the class's ingress max applies
    # the problem goes the way of every policy problem (ProblemReporter: one Event, the metric, a log line)


def test_controller_download_answers_lease_and_own_cap():
    """The controller's download numbers while the lease holds; a pod with no download allocation
    (None in the answer) gets its own cap; after the lease the download floor, never nothing."""
    dp = FakeDataPath()
    agent, metrics = make_agent(dp, controller="http://controller")
    agent.on_snapshot(Snapshot((pod("a", "10.244.0.10"), pod("b", "10.244.0.11", **{"kubernetes.io/ingress-bandwidth": "40M"})),
                               DL_CLASSES, DL_BUDGETS))
    lease = time.monotonic() + 60
    egress = AllocationSet(pods={}, node_rate_bps=50 * M, safe_floor_bps=2 * M, lease_expires=lease, source="controller")
    ingress = AllocationSet(pods={"ns/a": Allocation(30 * M, 60 * M)}, node_rate_bps=200 * M, safe_floor_bps=3 * M,
                            lease_expires=lease, source="controller", own_cap=True)
    agent.set_allocations(PerDirection(egress, ingress))
    assert agent.sync()
    got = download_classes(dp.applied[-1])
    assert got["ns/a"] == wire(30 * M, 60 * M)
    assert got["ns/b"][1] == wire(40 * M)  # its own cap: kubernetes.io/ingress-bandwidth
    assert dp.applied[-1].shapers.download.node_rate == wire(200 * M)
    agent.lanes.download.allocations.current.lease_expires = time.monotonic() - 1
    assert agent.sync()
    assert set(download_classes(dp.applied[-1]).values()) == {wire(3 * M, 3 * M)}


def test_the_report_carries_downloads_only_when_the_download_shaper_is_programmed():
    from netagent.reporter import answer_allocations, build_report
    from core.wire import NodeAnswer, PodAllocation
    dp = FakeDataPath()
    agent, metrics = make_agent(dp, controller="http://controller")
    agent.on_snapshot(Snapshot((pod("a", "10.244.0.10", **{"kubernetes.io/ingress-bandwidth": "40M"}),),
                               DL_CLASSES, DL_BUDGETS))
    assert not build_report(agent.report_inputs(), 1, 5.0, 0.0).shapes_ingress  # nothing programmed yet
    assert agent.sync()
    report = build_report(agent.report_inputs(), 2, 5.0, 0.0, node_ingress_bps=7e6)
    assert report.shapes_ingress and report.node_internet_ingress_bps == 7e6
    assert report.pods[0].ingress_bandwidth == "40M"
    answer = NodeAnswer(node="n1", generation=1, lease_seconds=30.0, safe_floor_bps=1e6, node_rate_bps=10e6,
                        pods=[PodAllocation("ns", "a", "a", "bronze", 1e6, 2e6)])
    allocs = answer_allocations(answer, 0.0, None, PerDirection(None, None)).download
    assert allocs.own_cap and allocs.pods == {} and allocs.node_rate_bps > 10 ** 15  # unlimited: the pods' caps hold


def test_the_clusters_service_cidrs_are_internal_and_followed_where_none_were_given():
    """No --service-cidr with Kubernetes: the ServiceCIDRs a snapshot carries are internal from the next sync,
    and a change follows; with --service-cidr given, or a snapshot that does not know them, nothing changes."""
    dp = FakeDataPath()
    agent, _ = make_agent(dp)
    agent.cfg = agent.node.cfg = dataclasses.replace(agent.cfg, services_from_cluster=True)
    p = (pod("p", "10.244.0.10"),)
    agent.on_snapshot(Snapshot(p, CLASSES, BUDGETS, service_cidrs=("10.96.0.0/16", "fd00:96::/112")))
    assert agent.sync()
    assert dp.applied[-1].classifier.internal_cidrs == ("10.0.0.0/8", "10.96.0.0/16", "fd00:96::/112")
    agent.on_snapshot(Snapshot(p, CLASSES, BUDGETS, service_cidrs=("10.96.0.0/16", "172.30.0.0/24")))
    assert agent.sync()
    assert dp.applied[-1].classifier.internal_cidrs == ("10.0.0.0/8", "10.96.0.0/16", "172.30.0.0/24")
    for unknown in (None, ()):  # not known from the source, or no ServiceCIDR: the last ones stay
        agent.on_snapshot(Snapshot(p, CLASSES, BUDGETS, service_cidrs=unknown))
        assert agent.sync()
        assert dp.applied[-1].classifier.internal_cidrs == ("10.0.0.0/8", "10.96.0.0/16", "172.30.0.0/24")
    given, _ = make_agent(FakeDataPath())  # --service-cidr given (services_from_cluster False): never changed
    given.on_snapshot(Snapshot(p, CLASSES, BUDGETS, service_cidrs=("10.96.0.0/16",)))
    assert given.sync() and given.facts.internal == ("10.0.0.0/8",)


def test_service_cidrs_of_serviceCIDR_objects_are_checked_and_bounded():
    objs = [{"metadata": {"name": "kubernetes"}, "spec": {"cidrs": ["10.96.0.0/16", "fd00:96::/112"]}},
            {"metadata": {"name": "more"}, "spec": {"cidrs": ["10.97.0.1/24", "10.96.0.0/16"]}},
            {"metadata": {"name": "bad"}, "spec": {"cidrs": ["banana", "0.0.0.0/0"]}},
            {"metadata": {"name": "odd"}, "spec": {"cidrs": "10.98.0.0/16"}}, {"metadata": {"name": "empty"}}]
    cidrs, problems = service_cidrs_of(objs)
    assert cidrs == ("10.96.0.0/16", "10.97.0.0/24", "fd00:96::/112")
    assert problems == ("ServiceCIDR bad: 'banana' is not a network",
                        "ServiceCIDR bad: 0.0.0.0/0 is every address, not a service range",
                        "ServiceCIDR odd: spec.cidrs is not a list")
    many = [{"metadata": {"name": f"s{i}"}, "spec": {"cidrs": [f"10.{i}.0.0/16"]}} for i in range(100)]
    cidrs, problems = service_cidrs_of(many)
    assert len(cidrs) == MAX_SERVICE_CIDRS and "only the first 64" in problems[0]


def test_the_report_gives_the_node_and_its_classes_rates_over_the_same_seconds():
    """Issue 37: the node's internet bytes and its classes' IP bytes are read together, so the report's
    node_internet_egress_bps and node_shaped_egress_bps cover the same seconds (the controller's gain
    then needs no steady plant). A class made since the last read counts from 0; classes not read with
    the node's counter (a slow read) give no node_shaped rate, that time and the next."""
    from netagent.reporter import Reporter
    dp = FakeDataPath()
    agent, _ = make_agent(dp, controller="http://controller")
    agent.on_snapshot(Snapshot((pod("a", "10.244.0.10"), pod("b", "10.244.0.11")), CLASSES, BUDGETS))
    assert agent.sync()
    base = agent.report_inputs()
    a, b = (p.key for p in base.pods)
    assert base.read_at is not None and base.class_bytes.upload is not None  # read (the fake has no counters)
    reads = [(100.0, 1_000, {a: 5_000}), (105.0, 4_001_000, {a: 2_505_000, b: 1_000_000, "node-class": 9}),
             (110.0, 5_001_000, None), (115.0, 6_001_000, {a: 100, b: 1_500_000}),
             (120.0, 7_251_000, {a: 50, b: 2_000_000})]

    class Inputs:
        def report_inputs(self):
            at, node, classes = reads.pop(0)
            return dataclasses.replace(base, node_internet_bytes=PerDirection(node, None),
                                       class_bytes=PerDirection(classes, None), read_at=at)

        def view(self):
            raise RuntimeError("no view in this test")

        def set_controller_reachable(self, reachable: bool) -> None:
            pass

    reporter = Reporter(Inputs(), "http://controller", None, insecure_http=True)  # type: ignore[arg-type]
    reporter.controller_report_version = 1  # as a controller's answer says (NodeAnswer.report_version)
    got = [reporter.build_report() for _ in range(5)]
    assert got[0].node_shaped_egress_bps is None  # nothing to count from yet
    assert got[1].node_internet_egress_bps == pytest.approx(4e6 * 8 / 5)
    assert got[1].node_shaped_egress_bps == pytest.approx(3.5e6 * 8 / 5)  # b is new: from 0; not the node's class
    assert got[2].node_internet_egress_bps == pytest.approx(1e6 * 8 / 5) and got[2].node_shaped_egress_bps is None
    assert got[3].node_shaped_egress_bps is None  # the read before it had no classes
    # a's class was made again (its counter went back): from 0
    assert got[4].node_shaped_egress_bps == pytest.approx((50 + 500_000) * 8 / 5)
    assert got[4].node_internet_egress_bps == pytest.approx(1.25e6 * 8 / 5)
    assert all(r.node_shaped_ingress_bps is None for r in got)  # no download shaper programmed
    # an older controller (its answers carry no report_version; its NodeReport refuses a field it does not
    # know) gets none, and neither does the next controller until it answers: after a failure the agent
    # cannot tell which one it reaches (a rollout)
    reads.extend([(125.0, 8_000_000, {a: 100_050, b: 2_500_000}), (130.0, 9_000_000, {a: 200_050, b: 3_000_000})])
    reporter.controller_report_version = 0
    assert reporter.build_report().node_shaped_egress_bps is None
    reporter.controller_report_version = 1
    assert reporter.build_report().node_shaped_egress_bps == pytest.approx(600_000 * 8 / 5)
    reporter._failed(RuntimeError("refused"), True)
    assert reporter.controller_report_version == 0
