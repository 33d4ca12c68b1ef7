"""How many bytes HTB counts per IP byte of one class, measured from the class's own counters.

A rate is IP bytes per second (what clouds bill). HTB counts each segment's frame, the IP packet
plus the link-layer header, so `desired.to_wire` gives a class its IP rate times the frame-per-IP
ratio of full-size segments, (MTU + 14) / MTU. A class that also carries small packets carries
less IP than its rate at its ceil: a pod's upload class carries the pure ACKs of its downloads
(52 bytes of IP in a 66-byte frame, one for every two segments it receives), and in the demo,
where every pod uploads and downloads at its limit, the pods carried 0.75 % less than the upload
budget and 0.3 % less than the download budget, every pod throttled at its ceil.

So each class's ratio is measured: frames over IP bytes (frames - 14 x packets, exact per segment)
across at least MIN_PACKETS packets. It is bounded: never below the full-size ratio (a class is
never given less than its IP rate in full-size frames) and at most MAX_EXTRA above it, so a class
whose mix turns to full-size packets carries at most that much over its IP rate until the next
measurement, a second later. And a new ratio replaces the one in use only when they differ by
more than STEP, so noise in the mix does not change a class every period. Pure: no kernel here.
"""
from __future__ import annotations

from typing import Hashable, Iterable

from .desired import frames_bits

MIN_PACKETS = 1000  # a ratio from fewer packets is not adopted (a 12 Mbit/s class sends ~1000 full-size packets a second)
MAX_EXTRA = 0.03  # at most 3 % above the full-size ratio (an average IP packet of ~470 bytes at MTU 1500)
STEP = 0.002  # 0.2 %: a measured ratio replaces the one in use only when they differ by more


class FrameRatios:
    """Per class key (a pod key, or the node's): the frame-per-IP ratio in use, from its counters."""

    def __init__(self, mtu: int, l2_bytes: int):
        self.full = (mtu + l2_bytes) / mtu
        self.l2 = l2_bytes
        self._start: dict[Hashable, tuple[int, int]] = {}  # (frame bytes, packets) when the window began
        self.ratios: dict[Hashable, float] = {}

    def observe(self, key: Hashable, frames: int, packets: int) -> bool:
        """One reading of a class's cumulative counters (HTB's bytes and packets); True when the
        class's ratio in use changed."""
        start = self._start.get(key)
        if start is None or frames < start[0] or packets < start[1]:  # new, or the class was re-made
            self._start[key] = (frames, packets)
            return False
        d_frames, d_packets = frames - start[0], packets - start[1]
        if d_packets < MIN_PACKETS:
            return False
        self._start[key] = (frames, packets)
        ip = d_frames - self.l2 * d_packets
        if ip <= 0:
            return False
        ratio = min(max(d_frames / ip, self.full), self.full * (1 + MAX_EXTRA))
        if abs(ratio / self.ratios.get(key, self.full) - 1) <= STEP:
            return False
        self.ratios[key] = ratio
        return True

    def seed(self, key: Hashable, ip_rate: int, ip_ceil: int, wire_rate: int, wire_ceil: int) -> None:
        """A class this process has no ratio for keeps the one the kernel shows it was given (by the
        agent before a restart, which measured it): when its HTB rate and ceil (bit/s) are exactly
        its IP rate and ceil in frames of one ratio within the bounds, that ratio is taken. So a
        restart changes nothing in the kernel, and the next measurement goes on from there."""
        if key in self.ratios or ip_ceil <= 0 or ip_rate <= 0:
            return
        # frames_bits(ip, r) == wire for (wire - 8) / ip < r <= wire / ip (whole bytes): the middle
        # of where the rate's and the ceil's ranges overlap gives both numbers back
        low = max((wire_rate - 8) / ip_rate, (wire_ceil - 8) / ip_ceil)
        high = min(wire_rate / ip_rate, wire_ceil / ip_ceil)
        ratio = (low + high) / 2
        if not (low < high and self.full * (1 + STEP) < ratio <= self.full * (1 + MAX_EXTRA) * (1 + 1e-9)):
            return
        if frames_bits(ip_ceil, ratio) == wire_ceil and frames_bits(ip_rate, ratio) == wire_rate:
            self.ratios[key] = ratio

    def get(self, key: Hashable) -> float | None:
        """The ratio in use; None: full-size (nothing measured that differs)."""
        return self.ratios.get(key)

    def keep(self, keys: Iterable[Hashable]) -> None:
        """Forget the classes not in `keys` (pods that left)."""
        alive = set(keys)
        for d in (self._start, self.ratios):
            for gone in [k for k in d if k not in alive]:
                del d[gone]
