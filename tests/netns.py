"""Scratch network namespaces for kernel tests: unique names, always removed."""
from __future__ import annotations

import contextlib
import os
import secrets
import subprocess


def sh(cmd: str, netns: str | None = None, check: bool = True) -> str:
    if netns:
        argv = ["ip", "netns", "exec", netns, "sh", "-c", cmd]
    else:
        argv = ["sh", "-c", cmd]
    p = subprocess.run(argv, capture_output=True, text=True)
    if check and p.returncode:
        raise AssertionError(f"{cmd!r} failed: {p.stderr}")
    return p.stdout


def require_root() -> None:
    # A kernel test that cannot run must fail, not skip: CI runs as root.
    if os.geteuid() != 0:
        raise AssertionError("this test needs root and network namespaces (run the suite as root, as CI does)")


@contextlib.contextmanager
def scratch_netns(tag: str = "t"):
    require_root()
    name = f"na-{tag}-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        sh("ip link set lo up", name)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
