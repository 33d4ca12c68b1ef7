"""netagent.accounting: counters that never go backwards when the kernel's do (pure)."""
from __future__ import annotations

from netagent.accounting import Accounting, Carry, ClassReading


def test_a_reset_of_the_kernel_counter_is_carried_never_negative_nor_counted_twice():
    c = Carry()
    assert [c.read(v) for v in (0, 100, 250)] == [0, 100, 250]
    assert c.read(40) == 290  # the class was made again and counted 40 since: 250 kept, 40 added
    assert c.read(40) == 290 and c.read(90) == 340
    assert c.read(0) == 340  # an empty new class: nothing lost, nothing new


def test_delivered_and_dropped_per_pod_and_direction():
    a = Accounting()
    assert a.delivered("egress", "ns/p") is None  # no class seen: the rules alone count
    a.observe("egress", {"ns/p": ClassReading(1_000, 10, backlog_ip_bytes=200)})
    assert a.delivered("egress", "ns/p") == (1_000, 10)
    assert a.delivered("ingress", "ns/p") is None  # directions apart
    # offered 5,000: 1,000 sent, 200 still queued, 3,800 dropped
    assert a.dropped("egress", "ns/p", 5_000) == 3_800
    a.observe("egress", {"ns/p": ClassReading(1_500, 15, backlog_ip_bytes=0)})
    # the queue drained: the offered count read before it is not a lower drop figure
    assert a.dropped("egress", "ns/p", 5_000) == 3_800
    assert a.dropped("egress", "ns/p", 9_000) == 7_500
    a.observe("egress", {"ns/p": ClassReading(100, 1)})  # class recreated
    assert a.delivered("egress", "ns/p") == (1_600, 16)


def test_a_pod_that_left_starts_again_from_zero():
    a = Accounting()
    a.observe("egress", {"ns/p": ClassReading(1_000, 10), "ns/q": ClassReading(7, 1)})
    a.keep("egress", ["ns/q"])
    assert a.delivered("egress", "ns/p") is None and a.delivered("egress", "ns/q") == (7, 1)
    a.observe("egress", {"ns/p": ClassReading(50, 1)})
    assert a.delivered("egress", "ns/p") == (50, 1)


def test_carries_kept_by_the_agent_before_are_gone_on_from():
    a = Accounting()
    a.observe("egress", {"ns/p": ClassReading(1_000, 10)})
    a.observe("egress", {"ns/p": ClassReading(200, 2)})  # reset: 1,000 carried
    kept = a.take_dirty()
    assert kept == {("egress", "ns/p"): (1_000, 10)} and a.take_dirty() is None  # once per change
    b = Accounting()  # the next agent, the class's count gone on to 300
    b.restore(kept)
    assert not b.seeding
    b.observe("egress", {"ns/p": ClassReading(300, 3)})
    assert b.delivered("egress", "ns/p") == (1_300, 13)


def test_the_first_agent_counting_delivered_bytes_goes_on_from_the_offered_count():
    a = Accounting()
    a.restore(None)  # nothing kept on the node: an upgrade from the agent that counted offered bytes
    assert a.seeding
    a.observe("egress", {"ns/p": ClassReading(1_000, 10), "ns/q": ClassReading(500, 5)})
    a.seed("egress", {"ns/p": 25_000, "ns/q": 400})  # the old counters: p was throttled
    assert a.delivered("egress", "ns/p")[0] == 25_000  # no step down, no restart from zero
    assert a.delivered("egress", "ns/q")[0] == 500  # never below what the class sent
    assert not a.seeding and a.take_dirty() == {("egress", "ns/p"): (24_000, 0)}
    a.observe("egress", {"ns/p": ClassReading(1_800, 18)})
    assert a.delivered("egress", "ns/p")[0] == 25_800  # then it grows by what is sent
    empty = Accounting()
    empty.restore(None)
    empty.seed("egress", {})
    assert empty.take_dirty() == {}  # kept even when empty: the next agent does not seed again


def test_a_class_not_sampled_yet_shows_its_carry_with_the_kernels_count():
    a = Accounting()
    a.restore({("egress", "ns/p"): (1_000, 10)})
    assert a.delivered("egress", "ns/p") is None
    assert a.delivered("egress", "ns/p", ClassReading(300, 3)) == (1_300, 13)  # a scrape before the first sample
    assert a.delivered("egress", "ns/q", ClassReading(300, 3)) == (300, 3)
    a.observe("egress", {"ns/p": ClassReading(400, 4)})
    assert a.delivered("egress", "ns/p", ClassReading(0, 0)) == (1_400, 14)  # observed: the caller's copy is not used
