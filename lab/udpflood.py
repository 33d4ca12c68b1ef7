"""A paced UDP flood with UDP GSO, for the lab: `python3 -m lab.udpflood DST PORT BITRATE SECONDS`.

iperf3 3.12 is single-threaded and sends one datagram per syscall: on a 2-core machine it
tops out near 0.7 Gbit/s of 1400-byte datagrams, too little to flood a 1 Gbit/s class at
twice its rate. With UDP_SEGMENT the kernel cuts each 61 KB send into 1400-byte datagrams
(real, separate UDP packets on the wire), so one process offers several Gbit/s.
Prints one JSON line: bytes (UDP payload), datagrams, seconds, bits_per_second (payload). SIGTERM
ends a flood before its SECONDS, and it still prints that line (a test that has measured what it needs
need not wait for the rest).

`--burst DST PORT` sends one GSO send of 44 datagrams (61,600 bytes): a single packet of the
largest size a socket hands the stack, for tests of what one such packet costs a shaper.

Downloads (towards a pod behind the node's NAT): `--reply PORT BITRATE SECONDS` on the internet
host floods whoever sends it a datagram; `--sink DST PORT SECONDS` in the pod sends that datagram.
"""
from __future__ import annotations

import json
import signal
import socket
import sys
import time

UDP_SEGMENT = 103  # linux/udp.h
DATAGRAM = 1400
PER_SEND = 44  # datagrams per sendto (61,600 bytes: under the 64 KB GSO limit)
_stopping = False  # set by SIGTERM: the flood ends at its next send and reports


def _stop(signum, frame) -> None:
    global _stopping
    _stopping = True


def flood(dst: str, port: int, bitrate: float, seconds: float, sock: socket.socket | None = None) -> dict:
    family = socket.AF_INET6 if ":" in dst else socket.AF_INET
    sock = sock or socket.socket(family, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_UDP, UDP_SEGMENT, DATAGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    payload = b"\0" * (DATAGRAM * PER_SEND)
    sent = 0
    start = time.monotonic()
    end = start + seconds
    while (now := time.monotonic()) < end and not _stopping:
        if sent * 8 > bitrate * (now - start):
            time.sleep(0.0002)  # ahead of the pace: wait
            continue
        try:
            sent += sock.sendto(payload, (dst, port))
        except OSError:  # a full queue (ENOBUFS) or an ICMP error: a flood keeps going
            continue
    elapsed = time.monotonic() - start
    return {"bytes": sent, "datagrams": sent // DATAGRAM, "seconds": elapsed, "bits_per_second": sent * 8 / elapsed}


def burst(dst: str, port: int) -> dict:
    """One sendto of PER_SEND datagrams with UDP_SEGMENT: the stack keeps it one GSO packet as far
    as the devices allow (veth and IFB do), so a qdisc sees one 61,600-byte packet."""
    family = socket.AF_INET6 if ":" in dst else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_UDP, UDP_SEGMENT, DATAGRAM)
        sent = sock.sendto(b"\0" * (DATAGRAM * PER_SEND), (dst, port))
    return {"bytes": sent}


def reply_flood(port: int, bitrate: float, seconds: float, wait: float = 30.0) -> dict:
    """A download flood: wait on `port` (IPv4 and IPv6) for one datagram, then flood its sender
    from the same port, so the packets match the NAT mapping the pod's datagram made."""
    sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(("::", port))
    sock.settimeout(wait)
    _, peer = sock.recvfrom(2048)
    sock.settimeout(None)
    return flood(peer[0], peer[1], bitrate, seconds, sock)


def sink(dst: str, port: int, seconds: float) -> dict:
    """The pod's side of a download flood: one datagram to `dst` every 0.5 s from one socket (the
    NAT mapping), never reading (the flood fills the socket's buffer and the rest is dropped in
    the pod, with no ICMP back)."""
    family = socket.AF_INET6 if ":" in dst else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    end = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < end:
        try:
            sock.sendto(b"go", (dst, port))
            sent += 1
        except OSError:
            pass
        time.sleep(0.5)
    return {"triggers": sent}


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "--reply":
        print(json.dumps(reply_flood(int(argv[1]), float(argv[2]), float(argv[3]))), flush=True)
        return 0
    if len(argv) == 4 and argv[0] == "--sink":
        print(json.dumps(sink(argv[1], int(argv[2]), float(argv[3]))), flush=True)
        return 0
    if len(argv) == 3 and argv[0] == "--burst":
        print(json.dumps(burst(argv[1], int(argv[2]))), flush=True)
        return 0
    if len(argv) != 4:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    dst, port, bitrate, seconds = argv[0], int(argv[1]), float(argv[2]), float(argv[3])
    signal.signal(signal.SIGTERM, _stop)
    print(json.dumps(flood(dst, port, bitrate, seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
