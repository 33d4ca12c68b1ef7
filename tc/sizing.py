"""How big HTB's buckets and quanta are: pure arithmetic, with the reasons.

pyroute2's defaults are wrong for a shaper that sees GSO super-packets: its burst
is rate/HZ + 1600 bytes (~1.6 KB at low rates), so a 64 KiB GSO segment exceeds
the bucket and the class stalls or overshoots. The CNI bandwidth plugin hit the
same trap. So every class gets an explicit burst, cburst and quantum.
"""
from __future__ import annotations

GSO_MAX_BYTES = 64 * 1024
MTU_BYTES = 1514
R2Q = 100  # root r2q; quanta are always set explicitly, this only silences kernel warnings
MAX_QUANTUM = 1 << 21


# HTB charges a whole packet against a class's ceil when it sends it, and keeps the debt in time
# at the ceil of that moment: one 64 KiB GSO packet at 27 kbit/s owes 19 s, and raising the ceil
# later does not shorten it (measured: a TCP flow held at 27 kbit/s for 1 s, then given 100 Mbit/s,
# moved nothing for 12 s). At LEAST_CEIL_BPS one such packet owes at most MAX_PACKET_DEBT_S.
MAX_PACKET_DEBT_S = 0.125
LEAST_CEIL_BPS = int(GSO_MAX_BYTES * 8 / MAX_PACKET_DEBT_S)  # 4.19 Mbit/s


def bytes_per_second(bps: int) -> int:
    """bit/s -> byte/s, never 0 (HTB treats 0 as 'unset')."""
    return max(1, bps // 8)


def burst_bytes(bps: int) -> int:
    """A bucket that holds one GSO segment and at least 1 ms of traffic at this rate."""
    return max(GSO_MAX_BYTES + MTU_BYTES, bytes_per_second(bps) // 1000)


def quantum_bytes(bps: int) -> int:
    """DRR quantum: proportional to the rate so that borrowing is shared in
    proportion to guarantees (HTB's own rule), never below one MTU."""
    return min(MAX_QUANTUM, max(MTU_BYTES, bytes_per_second(bps) // R2Q))


def leaf_limit_packets(bps: int) -> int:
    """pfifo length: about 100 ms of full-size packets at the ceil, kept between
    64 and 2000 so slow classes don't bloat and fast ones don't tail-drop bursts."""
    return min(2000, max(64, bytes_per_second(bps) // 10 // MTU_BYTES))


LEAF_QUEUE_MS = 5  # bfifo: what the queue may hold at the ceil, beyond one GSO packet
# The kernel's bfifo limit is 32 bits (pyroute2 packs it signed); 5 ms at 400 Gbit/s is 250 MB, so
# a larger ceil (an uncapped pod's, up to MAX_BPS) gets this, a queue its ceil never fills anyway.
LEAF_LIMIT_MAX_BYTES = 1 << 28


def leaf_limit_bytes(bps: int) -> int:
    """bfifo (and the segmenting tbf leaf's) length in bytes: a few milliseconds at the ceil plus one GSO packet (the largest
    skb TCP hands down; a byte limit below it would drop every full-size GSO packet). A packet
    count cannot bound the delay: GSO makes one "packet" anything from 64 B to 64 KiB."""
    return min(LEAF_LIMIT_MAX_BYTES, bytes_per_second(bps) * LEAF_QUEUE_MS // 1000 + GSO_MAX_BYTES + MTU_BYTES)


# The segmenting leaf (kind "tbf", where the kernel has no fq_codel). HTB sends a packet as soon as
# its class has any tokens and pays for it afterwards, so a 64 KiB GSO packet is a queue of its own
# that nothing shows: a ping behind a saturating upload waited twice what the CNI plugin's TBF makes
# it wait with the same backlog in bytes (docs/datapath.md, "Latency under load"). A TBF whose
# bucket holds one frame splits every larger GSO packet into frames as it enqueues them
# (tbf_segment), so HTB's debt is one frame. Its rate must never hold a frame back: with a one-frame
# bucket every wait is a timer, and at 10x a 1 Gbit/s ceil those waits cut a TCP flow to half the
# ceil (measured). At 2^40 bytes/s a frame's tokens refill in about a nanosecond, faster than HTB
# can hand it the next one.
SEGMENTER_RATE_BYTES = 1 << 40
# Splitting costs CPU per frame, in the sender's softirq: one IFB carried 3-4 Gbit/s of segmented TCP
# on the 2-core development VM against 13-25 unsegmented (`bench/ceiling.py --leaf`), and a UDP GSO
# flood into a 1 Gbit/s class could no longer offer twice the rate. So only classes whose ceil is at
# most this are split: where a 64 KiB GSO packet is a wait of a millisecond or more.
SEGMENT_CEIL_BPS = 500_000_000
SEGMENTER_L2_BYTES = 22  # Ethernet header and two VLAN tags beyond the device's MTU
SEGMENTER_LEAST_MTU = 1500


def segmenter_burst_bytes(mtu: int) -> int:
    """The segmenting leaf's bucket: the largest frame the feeding devices send. TBF drops a packet
    larger than its bucket that is not a GSO packet, so the bucket follows their MTU (the agent
    resyncs on every link change)."""
    return max(mtu, SEGMENTER_LEAST_MTU) + SEGMENTER_L2_BYTES


# The pod's control leaf is guaranteed this share of the pod's rate (and may borrow the pod's whole
# ceil, first among the pod's leaves): an ACK stream is ~2 % of the data it acknowledges (52 bytes
# per two 1448-byte segments), so a pod's download at 8x its upload guarantee still gets its ACKs
# out at the control leaf's own rate, before the pod's bulk data.
ACK_SHARE_DIVISOR = 8


def split_rate(bps: int, least: int) -> tuple[int, int]:
    """(control leaf, bulk leaf) guarantees that add up to the pod's rate `bps` (HTB lets a class
    under its own rate send without asking its parent, so the leaves' rates must not add up to more);
    neither below `least` (the caller's MIN_RATE_BPS: HTB cannot express less)."""
    ack = max(least, bps // ACK_SHARE_DIVISOR)
    return ack, max(least, bps - ack)
