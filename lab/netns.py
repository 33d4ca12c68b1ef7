"""Commands in network namespaces, and scratch namespaces for kernel tests: unique names, always removed."""
from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import subprocess


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


def sh(cmd: str, netns: str | None = None, check: bool = True) -> str:
    """`run` through a shell: pipes and redirections work."""
    return run(cmd, netns, check, shell=True)


def require_root() -> None:
    # A kernel test that cannot run must fail, not skip: CI runs as root.
    if os.geteuid() != 0:
        raise AssertionError("this test needs root and network namespaces (run the suite as root, as CI does)")


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
