"""A paced UDP flood with UDP GSO, for the lab: `python3 -m lab.udpflood DST PORT BITRATE SECONDS`.

iperf3 3.12 is single-threaded and sends one datagram per syscall: on a 2-core machine it
tops out near 0.7 Gbit/s of 1400-byte datagrams, too little to flood a 1 Gbit/s class at
twice its rate. With UDP_SEGMENT the kernel cuts each 61 KB send into 1400-byte datagrams
(real, separate UDP packets on the wire), so one process offers several Gbit/s.
Prints one JSON line: bytes (UDP payload), datagrams, seconds, bits_per_second (payload).
"""
from __future__ import annotations

import json
import socket
import sys
import time

UDP_SEGMENT = 103  # linux/udp.h
DATAGRAM = 1400
PER_SEND = 44  # datagrams per sendto (61,600 bytes: under the 64 KB GSO limit)


def flood(dst: str, port: int, bitrate: float, seconds: float) -> dict:
    family = socket.AF_INET6 if ":" in dst else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_UDP, UDP_SEGMENT, DATAGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    payload = b"\0" * (DATAGRAM * PER_SEND)
    sent = 0
    start = time.monotonic()
    end = start + seconds
    while (now := time.monotonic()) < end:
        if sent * 8 > bitrate * (now - start):
            time.sleep(0.0002)  # ahead of the pace: wait
            continue
        try:
            sent += sock.sendto(payload, (dst, port))
        except OSError:  # a full queue (ENOBUFS) or an ICMP error: a flood keeps going
            continue
    elapsed = time.monotonic() - start
    return {"bytes": sent, "datagrams": sent // DATAGRAM, "seconds": elapsed, "bits_per_second": sent * 8 / elapsed}


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    dst, port, bitrate, seconds = argv[0], int(argv[1]), float(argv[2]), float(argv[3])
    print(json.dumps(flood(dst, port, bitrate, seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
