"""The image's base is pinned by digest, and the pin is moved by hack/image/update-base-digest.sh.

The script resolves the digest with skopeo, crane or buildah. No registry is reachable here, so the
test points it (resolver buildah) at real images in buildah's local storage: a tiny one it builds
from scratch and rebuilds with other content; the resolution and the rewrite are the script's own.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "hack" / "image" / "update-base-digest.sh"
PIN = re.compile(r"^ARG BASE=([a-z0-9][a-z0-9._/:-]*)@(sha256:[0-9a-f]{64})$", re.M)


def test_dockerfile_default_base_is_pinned_by_digest():
    import dockerfile

    commands = dockerfile.parse_file(str(REPO / "Dockerfile"))
    first_from = next(i for i, c in enumerate(commands) if c.cmd == "FROM")
    args = [c.value[0] for c in commands[:first_from] if c.cmd == "ARG"]
    base, = [a for a in args if a.startswith("BASE=")]
    assert PIN.match(f"ARG {base}"), f"the Dockerfile's default base is not pinned by digest: {base}"
    # the tag the pin was resolved from stays readable beside the digest
    assert ":" in base.split("@")[0].split("/")[-1], base


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_script_refuses_what_it_cannot_pin(tmp_path):
    copy = tmp_path / "Dockerfile"
    copy.write_text("FROM scratch\n")
    result = run("--dockerfile", str(copy), "--resolver", "buildah", check=False)
    assert result.returncode == 1 and "exactly one 'ARG BASE=' line" in result.stderr
    copy.write_text("ARG BASE=x:1@sha256:" + "0" * 64 + "\nFROM ${BASE}\n")
    result = run("--dockerfile", str(copy), "--resolver", "buildah", "x@sha256:" + "0" * 64, check=False)
    assert result.returncode == 1 and "give a tag to resolve" in result.stderr
    result = run("--dockerfile", str(copy), "--resolver", "nosuch", check=False)
    assert result.returncode == 1
    assert copy.read_text() == "ARG BASE=x:1@sha256:" + "0" * 64 + "\nFROM ${BASE}\n"


def _buildah(*args: str) -> str:
    result = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"buildah {' '.join(args)}: {result.stderr}"
    return result.stdout.strip()


def _commit_image(image: dict, content: str, tmp_path: Path) -> str:
    """A one-file image from scratch in buildah's local storage, tagged image["name"]; returns
    its digest. Its ID is recorded for the fixture's cleanup (a retagged image stays behind)."""
    ctr = _buildah("from", "scratch")
    try:
        payload = tmp_path / "payload"
        payload.write_text(content)
        _buildah("add", ctr, str(payload), "/payload")
        image["ids"].append(_buildah("commit", "--quiet", ctr, image["name"]))
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True)
    return _buildah("inspect", "--type", "image", "--format", "{{.FromImageDigest}}", image["name"])


@pytest.fixture
def local_image(tmp_path):
    if not shutil.which("buildah") or os.geteuid() != 0:
        if os.environ.get("NETAGENT_REQUIRE_KUBE"):
            pytest.fail("buildah (as root) is needed to resolve a local image's digest")
        pytest.skip("needs buildah as root")
    image = {"name": f"localhost/netagent-digest-test:{os.getpid()}", "ids": []}
    try:
        yield image
    finally:
        for image_id in reversed(image["ids"]):
            subprocess.run(["buildah", "rmi", "--force", image_id], capture_output=True)


def test_script_rewrites_the_pin_to_the_resolved_digest(tmp_path, local_image):
    original = (REPO / "Dockerfile").read_text()
    copy = tmp_path / "Dockerfile"
    copy.write_text(original)
    digest = _commit_image(local_image, "one", tmp_path)
    name = local_image["name"]

    out = run("--dockerfile", str(copy), "--resolver", "buildah", name).stdout
    assert f"-> {name}@{digest}" in out
    text = copy.read_text()
    assert PIN.findall(text) == [(name, digest)]
    # only the pin changed
    assert [l for l in text.splitlines() if not l.startswith("ARG BASE=")] == \
        [l for l in original.splitlines() if not l.startswith("ARG BASE=")]
    # now current: --check agrees, a second run changes nothing
    assert "(current)" in run("--dockerfile", str(copy), "--resolver", "buildah", "--check").stdout
    run("--dockerfile", str(copy), "--resolver", "buildah")
    assert copy.read_text() == text

    # the tag moves to other content: --check fails and names it, the update follows it
    moved = _commit_image(local_image, "two", tmp_path)
    assert moved != digest
    result = run("--dockerfile", str(copy), "--resolver", "buildah", "--check", check=False)
    assert result.returncode == 1 and moved in result.stderr
    assert copy.read_text() == text
    run("--dockerfile", str(copy), "--resolver", "buildah")
    assert PIN.findall(copy.read_text()) == [(name, moved)]
    assert (REPO / "Dockerfile").read_text() == original
