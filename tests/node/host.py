"""Host state a real node touches, each helper scoped to one node's own paths and names: mounts,
processes, cgroups, kernel tunables and the kubelet's iptables chains."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from tests.kube import KubeHarnessError, Process
from tests.node.assets import CGROUP_ROOT, KERNEL_TUNABLES, KUBELET_CHAINS



def mounts_under(*roots: Path) -> list[str]:
    """Mount points at or below `roots`, deepest first (from /proc/self/mountinfo)."""
    found = []
    prefixes = [str(r.resolve()) for r in roots]
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if any(point == p or point.startswith(p + "/") for p in prefixes):
                found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def unmount_all(*roots: Path) -> list[str]:
    """Unmount everything under `roots`; returns what could not be unmounted."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    MNT_DETACH = 2
    for _ in range(3):
        left = mounts_under(*roots)
        for point in left:
            if libc.umount2(point.encode(), 0) != 0:
                libc.umount2(point.encode(), MNT_DETACH)
        if not mounts_under(*roots):
            return []
    return mounts_under(*roots)


def pids_with_arg(argument: str) -> list[int]:
    """PIDs whose command line contains `argument` as one argument (e.g. our containerd socket)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argument.encode() in args:
            pids.append(int(entry.name))
    return pids


def cgroup_dirs(cgroup_root: str) -> list[Path]:
    """Our cgroup subtree's top directory in every mounted hierarchy (v1 and the unified one)."""
    return [d / cgroup_root.strip("/") for d in CGROUP_ROOT.iterdir()
            if d.is_dir() and (d / cgroup_root.strip("/")).is_dir()]


def cgroup_pids(cgroup_root: str) -> set[int]:
    pids: set[int] = set()
    for top in cgroup_dirs(cgroup_root):
        for procs in top.rglob("cgroup.procs"):
            try:
                pids.update(int(p) for p in procs.read_text().split())
            except (OSError, ValueError):
                pass
    return pids


def remove_cgroups(cgroup_root: str) -> list[str]:
    """rmdir the subtree (deepest first) in every hierarchy; returns what is left."""
    left = []
    for top in cgroup_dirs(cgroup_root):
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [top]:
            for _ in range(20):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                left.append(str(d))
    return left


def create_cgroup_root(cgroup_root: str) -> None:
    """The kubelet refuses a cgroupRoot that does not exist: make it in every v1 hierarchy (cpuset
    needs its cpus and mems copied from the parent before anything can join it)."""
    for d in CGROUP_ROOT.iterdir():
        if not d.is_dir() or not (d / "cgroup.procs").exists() or d.name == "unified":
            continue
        target = d / cgroup_root.strip("/")
        target.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (target / knob).exists() and not (target / knob).read_text().strip():
                (target / knob).write_text((d / knob).read_text())


def kill(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def log_errors(process: Process, lines: int = 8) -> str:
    """The last error lines of a kubelet (klog E/F) or containerd (level=error/fatal) log, else its tail."""
    try:
        text = process.log_file.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in text if line[:1] in ("E", "F") and line[1:2].isdigit()
              or "level=error" in line or "level=fatal" in line]
    return "\n".join((errors or text)[-lines:])


def read_tunables() -> dict[str, str]:
    values = {}
    for name in KERNEL_TUNABLES:
        try:
            values[name] = (Path("/proc/sys") / name).read_text().strip()
        except OSError:
            pass
    return values


def restore_tunables(saved: dict[str, str]) -> list[str]:
    failed = []
    for name, value in saved.items():
        path = Path("/proc/sys") / name
        try:
            if path.read_text().strip() != value:
                path.write_text(value)
        except OSError as e:
            failed.append(f"sysctl {name}={value}: {e}")
    return failed


def kubelet_chains() -> set[tuple[str, str, str]]:
    """(tool, table, chain) for the kubelet's chains present now."""
    found = set()
    for tool in ("iptables", "ip6tables"):
        for table in ("mangle", "nat", "filter"):
            out = subprocess.run([tool, "-w", "-t", table, "-S"], capture_output=True, text=True).stdout
            for line in out.splitlines():
                fields = line.split()
                if fields[:1] == ["-N"] and fields[1] in KUBELET_CHAINS:
                    found.add((tool, table, fields[1]))
    return found


def remove_chains(chains: Iterable[tuple[str, str, str]]) -> list[str]:
    """Delete the jumps to these chains, then flush and delete them."""
    import shlex

    failed = []
    for tool, table, chain in sorted(chains):
        out = subprocess.run([tool, "-w", "-t", table, "-S"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            rule = shlex.split(line)
            if rule[:1] == ["-A"] and rule[1] != chain and "-j" in rule and rule[rule.index("-j") + 1] == chain:
                subprocess.run([tool, "-w", "-t", table, "-D", *rule[1:]], capture_output=True)
        for op in ("-F", "-X"):
            done = subprocess.run([tool, "-w", "-t", table, op, chain], capture_output=True, text=True)
            if done.returncode:
                failed.append(f"{tool} -t {table} {op} {chain}: {done.stderr.strip()}")
                break
    return failed


def default_route_ip() -> str:
    """The source address of the default route (the kubelet's node IP must be a non-loopback
    address of the host; it is only registered, no traffic is sent to it by these tests)."""
    out = subprocess.run(["ip", "-j", "route", "get", "192.0.2.255"], capture_output=True, text=True)
    try:
        return json.loads(out.stdout)[0]["prefsrc"]
    except (ValueError, LookupError, KeyError):
        raise KubeHarnessError(f"cannot find the host's default-route address: {out.stderr.strip()}") from None
