"""Running the iptables/ipset tools, and choosing nft vs legacy as kubernetes-sigs/iptables-wrappers does.

Detection order (first that answers wins):
1. kubelet's hint chains (KUBE-IPTABLES-HINT, KUBE-KUBELET-CANARY) in the mangle table of
   iptables-nft, then ip6tables-nft, then in the whole of iptables-legacy / ip6tables-legacy
   (never `-t mangle` on legacy: that would create the table);
2. our own chains: a restarted agent keeps the backend it programmed;
3. the backend with more rules (the wrappers' older heuristic), a tie going to nft.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable

from iptables.errors import IptablesError

BACKENDS = ("nft", "legacy")
_KUBELET_HINT = re.compile(r"^:(KUBE-IPTABLES-HINT|KUBE-KUBELET-CANARY)\b", re.M)
_RULE = re.compile(r"^(\[\d+:\d+\] )?-A ", re.M)
TIMEOUT = 60


@dataclass
class Runner:
    """Executes the tools, in a network namespace when one is given."""

    netns: str | None = None

    def tool(self, family: int, backend: str, action: str) -> str:
        base = "iptables" if family == 4 else "ip6tables"
        suffix = {"save": "-save", "restore": "-restore", "cmd": ""}[action]
        return f"{base}-{backend}{suffix}"

    def require(self, binary: str, package: str) -> None:
        if shutil.which(binary) is None:
            raise IptablesError(f"{binary} not found in PATH: install the {package} package (Debian: apt-get install {package})")

    def run(self, argv: list[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        full = ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv
        try:
            proc = subprocess.run(full, input=stdin, capture_output=True, text=True, timeout=TIMEOUT)
        except FileNotFoundError as exc:
            raise IptablesError(f"{full[0]} not found: install it (iptables, ipset and iproute2 are required)") from exc
        except subprocess.TimeoutExpired as exc:
            raise IptablesError(f"{' '.join(argv)} did not finish within {TIMEOUT}s (is the xtables lock held?)") from exc
        if check and proc.returncode != 0:
            detail = " ".join((proc.stderr.strip() or proc.stdout.strip()).split())  # one line for logs
            raise IptablesError(f"{' '.join(argv)} failed (exit {proc.returncode}): {detail}")
        return proc

    def save(self, family: int, backend: str, table: str | None = "mangle", counters: bool = False) -> str:
        argv = [self.tool(family, backend, "save")]
        if counters:
            argv.append("-c")
        if table:
            argv += ["-t", table]
        proc = self.run(argv, check=False)
        if proc.returncode != 0:
            # iptables-save exits non-zero when the table does not exist yet: treat as empty,
            # but a missing kernel module or tool is an error worth naming
            if "does not exist" in proc.stderr:
                return ""
            raise IptablesError(f"{argv[0]} failed (exit {proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def restore(self, family: int, backend: str, text: str) -> None:
        self.run([self.tool(family, backend, "restore"), "--noflush", "-w", "5"], stdin=text)


def has_kubelet_hint(save_text: str) -> bool:
    return bool(_KUBELET_HINT.search(save_text))


def rule_count(save_text: str) -> int:
    return len(_RULE.findall(save_text))


def detect(runner: Runner, prefix: str) -> str:
    """'nft' or 'legacy' for this (network namespace's) host."""
    available = [b for b in BACKENDS if shutil.which(runner.tool(4, b, "save"))]
    if not available:
        raise IptablesError("neither iptables-nft-save nor iptables-legacy-save is in PATH: install the iptables package")
    if len(available) == 1:
        return available[0]
    return choose_backend(runner.save, prefix)


def choose_backend(save: Callable[[int, str, str | None], str], prefix: str) -> str:
    """The detection order of the module docstring; `save(family, backend, table)` returns a dump."""
    ours = re.compile(rf"^:{re.escape(prefix)}-", re.M)
    nft = [save(f, "nft", "mangle") for f in (4, 6)]
    if any(has_kubelet_hint(t) for t in nft):
        return "nft"
    legacy = [save(f, "legacy", None) for f in (4, 6)]
    if any(has_kubelet_hint(t) for t in legacy):
        return "legacy"
    if any(ours.search(t) for t in nft):
        return "nft"
    if any(ours.search(t) for t in legacy):
        return "legacy"
    nft_rules = sum(rule_count(save(f, "nft", None)) for f in (4, 6))
    if sum(rule_count(t) for t in legacy) > nft_rules:
        return "legacy"
    return "nft"
