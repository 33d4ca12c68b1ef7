"""Helpers to run the real agent (`python3 -m netagent run`) inside a lab node and look at it.

Used by tests/test_agent_lab.py and bench/agent.py. The agent is a real subprocess in
the node's namespace; its endpoints are read from inside that namespace through a
netns worker thread, and kernel state is read with the project's own readers (tc over
netlink) or the standard tools (iptables-save, ipset), never through the agent.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from tc.netlink import Shaper

from .topology import INTERNAL_CIDRS, Lab, Node, Pod, run
from .nsexec import NetnsWorker, http_get
from .procs import wait_for

IFB = "netagent0"
INGRESS_IFB = "netagent-in"  # downloads


def pod_object(pod: Pod, node: Node, namespace: str = "team-a", name: str | None = None,
               annotations: dict | None = None, host_network: bool = False, ips: bool = True) -> dict:
    status: dict = {"phase": "Running"}
    if ips:
        status.update(podIP=pod.ip4, podIPs=[{"ip": pod.ip4}, {"ip": pod.ip6}])
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name or pod.name, "namespace": namespace, "annotations": annotations or {}},
        "spec": {"nodeName": node.name, "hostNetwork": host_network},
        "status": status,
    }


def write_objects(path: Path, objects: list[dict]) -> None:
    """Write atomically (rename), as editors and config-management tools do."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    os.replace(tmp, path)


class AgentProcess:
    def __init__(self, lab: Lab, node: Node, files: list[Path], port: int, extra: list[str] = (),
                 log_dir: Path | None = None, resync: float = 2.0, node_name: str | None = None,
                 learn_uplink: bool = False):
        self.lab, self.node, self.files, self.port, self.extra = lab, node, files, port, list(extra)
        self.resync = resync
        self.node_name = node_name or node.name  # the name the agent is told (--node)
        self.learn_uplink = learn_uplink  # no --uplink: the agent finds the default-route device
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="netagent-agent-")) / f"agent-{node.name}.log"
        self.proc: subprocess.Popen | None = None
        self.worker = NetnsWorker(node.netns)

    @property
    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "netagent", "run", "--node", self.node_name,
                "--listen", f"127.0.0.1:{self.port}", "--resync-period", str(self.resync)]
        if not self.learn_uplink:
            argv += ["--uplink", self.node.uplink]
        for f in self.files:
            argv += ["--from-file", str(f)]
        for c in INTERNAL_CIDRS:
            argv += ["--internal-cidr", c]
        return argv + self.extra

    def start(self) -> "AgentProcess":
        log = open(self.log_path, "a")
        log.write(f"--- start {' '.join(self.argv)}\n")
        log.flush()
        self.proc = self.lab.spawn(self.node.netns, self.argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def kill9(self) -> None:
        # the spawned process is `ip netns exec` which execs python: same pid
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self) -> int:
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGUSR1)  # the agent writes every thread's stack to its log
            time.sleep(1)
            raise AssertionError(f"the agent did not stop within 20 s of SIGTERM; its threads:\n{self.log()}") from None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            return self.worker.call(http_get, f"http://127.0.0.1:{self.port}{path}", timeout=15)
        except OSError as exc:
            return 0, str(exc).encode()

    def state(self) -> dict | None:
        code, body = self.get("/state")
        return json.loads(body) if code == 200 else None

    def pod(self, name: str) -> dict | None:
        st = self.state()
        return next((p for p in st["pods"] if p["name"] == name), None) if st else None

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of the samples of `name` whose label set contains `labels` (e.g. 'kind="tc"');
        0 when there is no such series (a counter never incremented)."""
        code, body = self.get("/metrics")
        if code != 200:
            raise AssertionError(f"/metrics answered {code}: {body[:200]!r}")
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
                   if line.startswith(name) and line[len(name)] in "{ " and labels in line)

    def wait_ready(self, timeout: float = 30) -> dict:
        def ready():
            if not self.alive():
                raise AssertionError(f"agent exited ({self.proc.returncode}); log:\n{self.log()}")
            code, _ = self.get("/readyz")
            return self.state() if code == 200 else None
        return wait_for(ready, timeout, 0.1, "agent ready")

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-6000:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.worker.close()


# -- kernel state, read without the agent ------------------------------------------------------

def tc_classes(netns: str, ifb: str = IFB, major: int = 0x1) -> dict[int, tuple[int, int]]:
    """HTB classes on the IFB (the download one: INGRESS_IFB, major 2): minor -> (rate, ceil) in bit/s."""

    with Shaper(netns) as s:
        return {m: (st.rate_bytes * 8, st.ceil_bytes * 8) for m, st in s.stats(ifb, major).items()}


def tc_class_bytes(netns: str, minor: int) -> int:

    with Shaper(netns) as s:
        st = s.stats(IFB).get(minor)
        return st.bytes if st else 0


def iptables_text(netns: str) -> str:
    """The classifier's kernel state: our mangle rules, and the ipsets where the pods' addresses live."""
    out = []
    for tool in ("iptables-save", "ip6tables-save"):
        out.append(run([tool, "-t", "mangle"], netns))
    out.append(run(["ipset", "save"], netns, check=False))
    return "\n".join(out)


def classified_into_missing_classes(netns: str, ifb: str = IFB) -> list[str]:
    """The pods' upload set entries whose class (skbprio) the kernel does not hold: a pod half
    applied, its packets sent to a class that is not there."""
    held = set(re.findall(r"class htb (\S+)", run(["tc", "class", "show", "dev", ifb], netns, check=False)))
    return [line for line in run(["ipset", "save"], netns, check=False).splitlines()
            if line.startswith("add netagent-egress-inet4 ")
            and (m := re.search(r"skbprio (\S+)", line)) and m.group(1) not in held]


def kernel_dump(netns: str, uplink: str = "eth0") -> str:
    """Everything netagent programs, without counters: equal dumps mean no change was made."""
    parts = [
        run(["tc", "qdisc", "show", "dev", IFB], netns),
        run(["tc", "class", "show", "dev", IFB], netns),
        run(["tc", "qdisc", "show", "dev", uplink], netns),
        run(["tc", "filter", "show", "dev", uplink, "egress"], netns),
        run(["ip", "-d", "link", "show", IFB], netns),
    ]
    for tool in ("iptables-save", "ip6tables-save"):
        parts.append("\n".join(l for l in run([tool], netns).splitlines() if not l.startswith("#")))
    # the pod sets count bytes per member: what was programmed is the rest of each line
    parts.append(re.sub(r" packets \d+ bytes \d+", "", run(["ipset", "save"], netns, check=False)))
    return "\n".join(parts)


def iperf_server(lab: Lab, netns: str, port: int) -> None:
    lab.iperf_server(netns, port)


def received_bps(result: dict) -> float:
    return float(result["end"]["sum_received"]["bits_per_second"])


_INTERVAL = re.compile(r"\]\s+([\d.]+)-([\d.]+)\s+sec\s+[\d.]+ \w?Bytes\s+([\d.]+) (\w?)bits/sec")
_SCALE = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}


def server_intervals(result: dict) -> list[tuple[float, float, float]]:
    """(start s, end s, bits/s) of each interval the receiving side measured (the client ran
    with --get-server-output; the lab's servers print text). The summary lines at the end are
    left out."""
    text = result.get("server_output_text") or ""
    lines = [l for l in text.splitlines() if "receiver" not in l and "sender" not in l]
    return [(float(m[1]), float(m[2]), float(m[3]) * _SCALE[m[4]])
            for l in lines if (m := _INTERVAL.search(l))]


class NetnsPortForward:
    """A TCP port inside a lab namespace that forwards to an address in the test's own
    namespace (the apiserver on loopback), with no link between the namespaces.
    `pause()` drops every connection and refuses new ones (the apiserver unreachable);
    `resume()` serves again; `retarget()` points it at a restarted apiserver."""

    def __init__(self, netns: str, target: tuple[str, int]):

        self.target = target
        self.worker = NetnsWorker(netns)
        self._socket = socket
        self.port = 0
        self._conns: list = []
        self._lock = threading.Lock()
        self._listener = None
        self.resume()

    def _listen(self):
        s = self._socket.socket(self._socket.AF_INET, self._socket.SOCK_STREAM)  # created inside the netns
        s.setsockopt(self._socket.SOL_SOCKET, self._socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        return s

    def resume(self) -> None:
        listener = self.worker.call(self._listen)
        with self._lock:
            self._listener = listener
        self.port = listener.getsockname()[1]
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = self._socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                stale = listener is not self._listener  # paused while this one connected upstream:
                if not stale:  # it must not outlive the pause (an agent's watch kept flowing once)
                    self._conns += [client, upstream]
            if stale:
                for c in (client, upstream):
                    c.close()
                return
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(self._socket.SHUT_RDWR)
                except OSError:
                    pass

    def pause(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            listener.close()
        for c in conns:
            try:
                c.shutdown(self._socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def retarget(self, target: tuple[str, int]) -> None:
        self.target = target

    def close(self) -> None:
        self.pause()
        self.worker.close()
