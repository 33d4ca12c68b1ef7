#!/usr/bin/env python3
"""The version an image or a release is stamped with: netagent.__version__ and where the tree is in
git, so a build from a dirty tree says so in its version (issue 36's bad input).

    hack/release/stamp.py [--repo DIR]
    # prints: <stamped version> <revision> <clean|dirty|unknown> <created>

created: the revision's commit time (UTC, RFC 3339), the org.opencontainers.image.created label;
from the commit rather than the clock, so an unchanged tree builds the same image (buildah's
layer cache) - a dirty tree's build is as old as its revision. Not a git checkout: the clock.

  HEAD tagged v<version>, clean      0.1.0
  HEAD tagged v<version>, dirty      0.1.0-dirty
  untagged (N commits to HEAD)       0.1.0-dev.N.g<12 hex>           (-dirty appended when dirty)
  not a git checkout                 0.1.0-unknown                   (revision "unknown")

Dirty: any change `git status --porcelain` shows, untracked files included (the build context
copies whole directories, so an untracked file can be in the image). Every stamp is a SemVer 2
version (a pre-release until tagged: `0.1.0-dev.N...` sorts before `0.1.0`) and a valid image tag
(no `+`), so the image's tag, its version label and the packaged chart's version can be the same
string. tests/test_release.py tests `stamp` as a pure function and the script against a scratch
git repository.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

SEMVER_CORE = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")
# the OCI distribution spec's tag grammar
OCI_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
REVISION = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")  # SHA-1 or SHA-256 object names


class StampError(ValueError):
    pass


def stamp(version: str, *, revision: str | None, commits: int = 0, tagged: bool = False,
          dirty: bool = False) -> str:
    """The stamped version from the facts git gives (revision None: not a git checkout)."""
    if not SEMVER_CORE.match(version):
        raise StampError(f"version {version!r} is not MAJOR.MINOR.PATCH (netagent/__init__.py's __version__)")
    if revision is None:
        return f"{version}-unknown"
    if not REVISION.match(revision):
        raise StampError(f"revision {revision!r} is not a full git object name")
    if tagged:
        out = version
    else:
        if commits < 1:
            raise StampError(f"an untagged revision has at least one commit, not {commits}")
        out = f"{version}-dev.{commits}.g{revision[:12]}"
    if dirty:
        out += "-dirty"
    assert OCI_TAG.match(out), out
    return out


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def facts(repo: Path) -> dict:
    """The git facts stamp() takes, read from the checkout at repo."""
    try:
        inside = _git(repo, "rev-parse", "--is-inside-work-tree") == "true"
    except (subprocess.CalledProcessError, FileNotFoundError):
        inside = False
    if not inside:
        return {"revision": None, "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    revision = _git(repo, "rev-parse", "HEAD")
    epoch = int(_git(repo, "log", "-1", "--format=%ct", "HEAD"))
    return {
        "revision": revision,
        "created": datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commits": int(_git(repo, "rev-list", "--count", "HEAD")),
        "tags": _git(repo, "tag", "--points-at", "HEAD").split(),
        "dirty": bool(_git(repo, "status", "--porcelain", "--untracked-files=normal")),
    }


def project_version(repo: Path) -> str:
    """netagent.__version__, read without importing the package (a build host needs no deps)."""
    try:
        text = (repo / "netagent" / "__init__.py").read_text()
    except OSError as exc:
        raise StampError(f"no netagent/__init__.py under {repo}: {exc.strerror}") from None
    found = re.findall(r'^__version__ = "([^"]*)"$', text, re.M)
    if len(found) != 1:
        raise StampError(f"{repo}/netagent/__init__.py must assign __version__ once, as a string")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent.parent)
    a = parser.parse_args(argv)
    try:
        version = project_version(a.repo)
        f = facts(a.repo)
        stamped = stamp(version, revision=f["revision"], commits=f.get("commits", 0),
                        tagged=f"v{version}" in f.get("tags", ()), dirty=f.get("dirty", False))
    except StampError as exc:
        print(f"stamp: {exc}", file=sys.stderr)
        return 2
    state = "unknown" if f["revision"] is None else "dirty" if f["dirty"] else "clean"
    print(stamped, f["revision"] or "unknown", state, f["created"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
