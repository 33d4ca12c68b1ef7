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
