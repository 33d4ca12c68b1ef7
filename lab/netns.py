"""Commands in network namespaces, and scratch namespaces for kernel tests: unique names, always removed."""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import subprocess
import tempfile


class LabError(RuntimeError):
    """A lab command failed; the message has the command and what it printed."""


def run(cmd: str | list[str], netns: str | None = None, check: bool = True, timeout: float = 60,
        shell: bool = False) -> str:
    """Run `cmd` (in `netns` when given) and return its standard output; LabError when it fails
    and `check`. A string is split like a shell would, or run by `sh -c` with `shell=True`."""
    if shell:
        argv = ["sh", "-c", cmd if isinstance(cmd, str) else shlex.join(cmd)]
    else:
        argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def normalised(text: str) -> str:
    """An iptables dump without counters and comment lines: equal means the same rules."""
    text = re.sub(r"\[\d+:\d+\]", "", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def residue_snapshot(netns: str) -> dict[str, str]:
    """What a data path leaves in `netns`: rules, sets, qdiscs, classes, filters, links. Two equal
    snapshots around an install and its cleanup mean the cleanup was exact."""
    devices = [d["ifname"] for d in json.loads(run("ip -j link show", netns))]
    snap = {
        "iptables-save": normalised(run("iptables-save", netns)),
        "ip6tables-save": normalised(run("ip6tables-save", netns)),
        "ipset list": run("ipset list", netns),
        "tc qdisc": run("tc qdisc show", netns),
        "ip link": re.sub(r"link/ether \S+", "", run("ip -o link show", netns)),
    }
    for legacy in ("iptables-legacy-save", "ip6tables-legacy-save"):
        snap[legacy] = normalised(run(legacy, netns, check=False))
    for dev in devices:
        snap[f"tc class {dev}"] = run(["tc", "class", "show", "dev", dev], netns)
        for hook in ("ingress", "egress"):
            snap[f"tc filter {dev} {hook}"] = run(["tc", "filter", "show", "dev", dev, hook], netns, check=False)
    return snap


def sh(cmd: str, netns: str | None = None, check: bool = True) -> str:
    """`run` through a shell: pipes and redirections work."""
    return run(cmd, netns, check, shell=True)


def require_root() -> None:
    # A kernel test that cannot run must fail, not skip: CI runs as root.
    if os.geteuid() != 0:
        raise AssertionError("this test needs root and network namespaces (run the suite as root, as CI does)")


@contextlib.contextmanager
def bpf_filesystem():
    """A bpf filesystem of the caller's own on a fresh directory (this machine mounts none at /sys/fs/bpf),
    for the device counter's pinned map; unmounted and removed after the block (what is pinned goes with it)."""
    require_root()
    root = tempfile.mkdtemp(prefix="netagent-bpffs-")
    try:
        subprocess.run(["mount", "-t", "bpf", "bpf", root], check=True)
        try:
            yield root
        finally:
            subprocess.run(["umount", root], check=True)
    finally:
        os.rmdir(root)


@contextlib.contextmanager
def scratch_netns(tag: str = "t"):
    """A fresh network namespace (loopback up) for the block; removed after it, also on error."""
    require_root()
    name = f"na-{tag}-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        sh("ip link set lo up", name)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
