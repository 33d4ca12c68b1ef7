"""Faults to inject into a lab node, and a receiver that counts bytes per 100 ms.

Used by tests/test_agent_drift.py and bench/faults_agent.py. Every fault is what an operator,
another component or the kernel really does (iptables -F, ip link del/down/set name, flock on
the xtables lock, kill -9); none goes through the agent.

`python3 -m lab.faults sink PORT SECONDS` receives UDP on PORT for SECONDS and prints one JSON
line: the bytes received in each 100 ms bucket (the receiver's view of the shaped rate).
`python3 -m lab.faults controller ...` is a fault-injecting fake controller (see `serve_controller`).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .netns import run, sh

BUCKET_S = 0.1
XTABLES_LOCK = "/run/xtables.lock"


# -- faults ------------------------------------------------------------------------------------

def flush_mangle(netns: str) -> None:
    sh("iptables -t mangle -F; ip6tables -t mangle -F", netns)


def delete_link(netns: str, dev: str) -> None:
    run(["ip", "link", "del", dev], netns)


def link_down(netns: str, dev: str) -> None:
    run(["ip", "link", "set", dev, "down"], netns)


def default_routes(netns: str) -> list[str]:
    """`ip route add`-able default routes of the namespace, both families."""
    out = []
    for family in ("-4", "-6"):
        for route in json.loads(run(["ip", "-j", family, "route", "show", "default"], netns) or "[]"):
            out.append(f"{family} route replace default via {route['gateway']} dev {route['dev']}")
    return out


def rename_link(netns: str, old: str, new: str) -> None:
    """Rename a device as udev or an operator does: down, rename, up; the routes that went with
    the down are put back (on the same device, now under its new name)."""
    routes = [r.replace(f" dev {old}", f" dev {new}") for r in default_routes(netns)]
    sh(f"ip link set {old} down && ip link set {old} name {new} && ip link set {new} up", netns)
    for r in routes:
        sh(f"ip {r}", netns, check=False)


def hold_xtables_lock(seconds: float) -> subprocess.Popen:
    """Hold the xtables lock (a file lock, the same in every namespace of the machine) like a
    long iptables run of another component. Returns the holder; it exits after `seconds`."""
    proc = subprocess.Popen(["flock", "-x", XTABLES_LOCK, "sleep", str(seconds)], start_new_session=True)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # until it holds the lock
        if subprocess.run(["flock", "-n", XTABLES_LOCK, "true"]).returncode != 0:
            break
        time.sleep(0.01)
    return proc


def release(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


# -- the receiver ------------------------------------------------------------------------------

def sink(port: int, seconds: float) -> dict:
    """Bytes per BUCKET_S received on UDP `port` (IPv4) during `seconds`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("0.0.0.0", port))
    sock.settimeout(0.05)
    start = time.monotonic()
    buckets = [0] * int(seconds / BUCKET_S + 1)
    print(json.dumps({"listening": port}), flush=True)
    while time.monotonic() - start < seconds:
        try:
            n = len(sock.recv(65536))
        except socket.timeout:
            continue
        i = int((time.monotonic() - start) / BUCKET_S)
        if i < len(buckets):
            buckets[i] += n
    return {"bucket_seconds": BUCKET_S, "bytes": buckets}


def seconds_over(buckets: list[int], limit_bps: float, tolerance: float = 1.2, bucket_s: float = BUCKET_S) -> float:
    """Seconds during which the receiver saw more than `tolerance` × the limit (per bucket)."""
    return sum(bucket_s for b in buckets if b * 8 / bucket_s > limit_bps * tolerance)


def peak_over(buckets: list[int], limit_bps: float, window: int = 10, bucket_s: float = BUCKET_S) -> float:
    """The highest rate over any `window` buckets (1 s), as % above the limit (0 when under)."""
    if len(buckets) < window:
        return 0.0
    best = max(sum(buckets[i:i + window]) for i in range(len(buckets) - window + 1)) * 8 / (window * bucket_s)
    return max(0.0, (best / limit_bps - 1) * 100)


# -- a fault-injecting controller ----------------------------------------------------------------

ANSWERS = {
    # what a broken or hostile controller might send; a real one cannot be made to
    "nan": '{{"node":"{node}","generation":5,"lease_seconds":NaN,"safe_floor_bps":NaN,"node_rate_bps":NaN,"pods":[]}}',
    "huge": '{{"node":"{node}","generation":5,"lease_seconds":1e30,"safe_floor_bps":1e30,"node_rate_bps":1e30,'
            '"pods":[]}}',
    "negative": '{{"node":"{node}","generation":5,"lease_seconds":-1,"safe_floor_bps":-1,"node_rate_bps":-1,'
                '"pods":[]}}',
}


def serve_controller(port: int, cert: str, key: str, mode: str, good: str, log_path: str) -> None:
    """HTTPS on 127.0.0.1:`port`: the answer in the file `good` (NODE replaced by the node's name)
    until the file `<log_path>.fault` exists, then `mode`: an answer from ANSWERS, or
    "redirect:URL" (a 307 to URL). Whether each request carried a token is appended to `log_path`
    (a foreign host run with this logs what reached it)."""
    fault_flag = log_path + ".fault"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with open(log_path, "a") as f:
                f.write(json.dumps({"t": time.time(), "path": self.path,
                                    "token": bool(self.headers.get("Authorization"))}) + "\n")
            node = self.path.split("/")[3] if self.path.count("/") >= 4 else "node"
            if not os.path.exists(fault_flag):
                body, code, headers = open(good, "rb").read().replace(b"NODE", node.encode()), 200, {}
            elif mode.startswith("redirect:"):
                body, code, headers = b"", 307, {"Location": mode.split(":", 1)[1] + self.path}
            else:
                body, code, headers = ANSWERS[mode].format(node=node).encode(), 200, {}
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print(json.dumps({"listening": port}), flush=True)
    server.serve_forever()


def main(argv: list[str]) -> int:
    if argv[:1] == ["sink"]:
        print(json.dumps(sink(int(argv[1]), float(argv[2]))), flush=True)
        return 0
    if argv[:1] == ["controller"]:
        serve_controller(int(argv[1]), argv[2], argv[3], argv[4], argv[5], argv[6])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
