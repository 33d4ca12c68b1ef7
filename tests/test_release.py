"""Version and release (issue 36): one version everywhere, the stamp a build carries (`-dirty` for a
dirty tree), the image `make release` builds (labels, bytecode, no pip/apt/dpkg), the packaged chart
and the SBOM.

The image test reuses what tests/test_install.py built: hack/image/build.sh with buildah's layer
cache rebuilds an unchanged tree in seconds. The SBOM test needs syft, which CI does not build
(hack/release/syft.sh, minutes once): it runs where the binary is (docs/release.md says so).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

import netagent
from tests.node import require_image_builder, require_node_assets

REPO = Path(__file__).resolve().parent.parent
STAMP = REPO / "hack" / "release" / "stamp.py"
RELEASE = REPO / "hack" / "release" / "release.sh"
SYFT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "netagent" / "release-assets"


def _stamp_module():
    spec = importlib.util.spec_from_file_location("netagent_release_stamp", STAMP)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


stamp_mod = _stamp_module()


# --- one version ------------------------------------------------------------------------------


def test_one_version_in_code_pyproject_chart_and_cli():
    import tomllib

    version = netagent.__version__
    assert stamp_mod.SEMVER_CORE.match(version), version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    # pyproject reads the code's version: no second copy to forget
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "netagent.__version__"}
    assert stamp_mod.project_version(REPO) == version
    chart = yaml.safe_load((REPO / "charts" / "netagent" / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == version
    for args in ([], ["controller"], ["run"]):
        out = subprocess.run([sys.executable, "-m", "netagent", *args, "--version"], capture_output=True,
                             text=True, timeout=60, cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"netagent {version} ") and out.stdout.count("\n") == 1, out.stdout
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert "keepachangelog.com" in changelog and "## [Unreleased]" in changelog


# --- the stamp --------------------------------------------------------------------------------

SHA = "0813e79" + "a" * 33


@pytest.mark.parametrize("facts, expected", [
    ({"revision": SHA, "tagged": True}, "0.1.0"),
    ({"revision": SHA, "tagged": True, "dirty": True}, "0.1.0-dirty"),
    ({"revision": SHA, "commits": 77}, "0.1.0-dev.77.g0813e79aaaaa"),
    ({"revision": SHA, "commits": 77, "dirty": True}, "0.1.0-dev.77.g0813e79aaaaa-dirty"),
    ({"revision": None}, "0.1.0-unknown"),
    ({"revision": None, "dirty": True}, "0.1.0-unknown"),
])
def test_stamp(facts, expected):
    assert stamp_mod.stamp("0.1.0", **facts) == expected
    # a SemVer 2 version and an image tag, so image, label and chart carry the same string
    assert re.match(r"^\d+\.\d+\.\d+(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$", expected)
    assert stamp_mod.OCI_TAG.match(expected)


def test_stamp_dev_builds_sort_by_commit_count():
    # SemVer compares numeric pre-release identifiers as numbers: dev.100 after dev.99
    a, b = (stamp_mod.stamp("0.2.0", revision=SHA, commits=n) for n in (99, 100))
    key = lambda v: [int(x) if x.isdigit() else x for x in v.split("-", 1)[1].split(".")]  # noqa: E731
    assert key(a) < key(b)


@pytest.mark.parametrize("version, facts, message", [
    ("0.1", {"revision": SHA}, "MAJOR.MINOR.PATCH"),
    ("v0.1.0", {"revision": SHA}, "MAJOR.MINOR.PATCH"),
    ("0.1.0", {"revision": "0813e79"}, "full git object name"),
    ("0.1.0", {"revision": SHA, "commits": 0}, "at least one commit"),
])
def test_stamp_refuses(version, facts, message):
    with pytest.raises(stamp_mod.StampError, match=message):
        stamp_mod.stamp(version, **facts)


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_CONFIG_GLOBAL": "/dev/null"}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


def _run_stamp(repo: Path) -> list[str]:
    out = subprocess.run([sys.executable, str(STAMP), "--repo", str(repo)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_stamp_script_follows_git(tmp_path):
    """The script against a scratch repository: untagged, dirty (tracked or untracked), tagged."""
    repo = tmp_path / "repo"
    (repo / "netagent").mkdir(parents=True)
    (repo / "netagent" / "__init__.py").write_text('__version__ = "1.2.3"\n')
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "HEAD")
    stamped, revision, tree, created = _run_stamp(repo)
    assert (stamped, revision, tree) == (f"1.2.3-dev.1.g{head[:12]}", head, "clean")
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", created)
    (repo / "notes.txt").write_text("untracked: the build context may copy it\n")
    assert _run_stamp(repo)[0] == f"1.2.3-dev.1.g{head[:12]}-dirty"
    (repo / "notes.txt").unlink()
    _git(repo, "tag", "v1.2.3")
    assert _run_stamp(repo)[:3] == ["1.2.3", head, "clean"]
    (repo / "netagent" / "__init__.py").write_text('__version__ = "1.2.3"\nX = 1\n')
    assert _run_stamp(repo)[:3] == ["1.2.3-dirty", head, "dirty"]
    # a tag of another version is not this release
    _git(repo, "commit", "-q", "-am", "two")
    _git(repo, "tag", "v1.2.2")
    assert _run_stamp(repo)[0].startswith("1.2.3-dev.2.g")
    # not a git checkout (an unpacked tarball): it says so rather than guess
    plain = tmp_path / "plain"
    shutil.copytree(repo / "netagent", plain / "netagent")
    assert _run_stamp(plain)[:3] == ["1.2.3-unknown", "unknown", "unknown"]
    # bad input: a clear error, exit 2
    (plain / "netagent" / "__init__.py").write_text('__version__ = "1.2"\n')
    out = subprocess.run([sys.executable, str(STAMP), "--repo", str(plain)], capture_output=True, text=True)
    assert out.returncode == 2 and "MAJOR.MINOR.PATCH" in out.stderr and not out.stdout


# --- the packaged chart -----------------------------------------------------------------------


def _sha256sums_hold(out: Path) -> None:
    for line in (out / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name


def _released(stdout: str) -> tuple[str, str]:
    """The stamp and revision release.sh says it used (the shared tree's HEAD may move meanwhile)."""
    found = re.search(r"^release: version (\S+) \(revision (\S+),", stdout, re.M)
    assert found, stdout
    return found.group(1), found.group(2)


def test_release_packages_the_chart_with_the_stamp(tmp_path):
    helm = require_node_assets(["helm"]) / "helm"
    env = {**os.environ, "NETAGENT_HELM": str(helm)}
    result = subprocess.run(["bash", str(RELEASE), "--chart-only", "--out", str(tmp_path)], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    stamped, revision = _released(result.stdout)
    # a dirty tree's release says so, in the version and in words
    assert stamped.endswith("-dirty") == ("uncommitted changes" in result.stderr)
    assert stamped.startswith(netagent.__version__) and f".g{revision[:12]}" in stamped
    package = tmp_path / f"netagent-{stamped}.tgz"
    with tarfile.open(package) as tar:
        chart = yaml.safe_load(tar.extractfile("netagent/Chart.yaml"))
    assert chart["version"] == chart["appVersion"] == stamped
    _sha256sums_hold(tmp_path)
    # the packaged chart's default image is the image the release tags
    rendered = subprocess.run([str(helm), "template", "egress", str(package), "-n", "traffic-control"],
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    images = {c["image"] for d in yaml.safe_load_all(rendered.stdout) if d and d.get("kind") == "DaemonSet"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images and all(i.endswith(f":{stamped}") for i in images), images


# --- the image --------------------------------------------------------------------------------


def _buildah(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, f"buildah {' '.join(args)}: {result.stderr}"
    return result


@pytest.fixture(scope="module")
def built_image():
    """The image as hack/image/build.sh builds it (a cached rebuild after tests/test_install.py)."""
    builder = require_image_builder()
    if os.geteuid() != 0:
        pytest.skip("buildah's storage needs root")
    build = subprocess.run(["bash", str(builder)], capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    # what it stamped (HEAD may move while it builds, so the test reads it rather than recomputing it)
    stamp = re.search(r"^image: version (\S+), revision (\S+), tree (\S+)$", build.stdout, re.M)
    assert stamp, build.stdout
    return build.stdout.strip().splitlines()[-1], stamp.groups()


@pytest.fixture
def image_container(built_image):
    ctr = _buildah("from", "--quiet", "--pull-never", built_image[0]).stdout.strip()
    try:
        yield ctr
    finally:
        _buildah("rm", ctr, check=False)


# Inside the image: every module of the venv and the standard library has its bytecode, the
# interpreter loads it (python -v names the .pyc it takes the code from), and no package manager
# is left. Printed as JSON for the test.
INSIDE = r"""
import json, os, shutil, subprocess, sys, sysconfig
missing = []
for root in (sys.prefix + "/lib", sysconfig.get_paths()["stdlib"]):
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("__pycache__", "test", "tests", "idle_test")]
        for f in files:
            if f.endswith(".py"):
                pyc = os.path.join(d, "__pycache__", f[:-3] + "." + sys.implementation.cache_tag + ".pyc")
                if not os.path.exists(pyc):
                    missing.append(os.path.join(d, f))
verbose = subprocess.run([sys.executable, "-v", "-c", "import cli.main, netagent.daemon, controller.app"],
                         capture_output=True, text=True).stderr
from_source = [l for l in verbose.splitlines() if l.startswith("# code object from") and l.rstrip("'").endswith(".py")]
from_pyc = [l for l in verbose.splitlines() if l.startswith("# code object from") and ".pyc" in l]
tools = {t: shutil.which(t) for t in ("pip", "pip3", "apt", "apt-get", "dpkg", "dpkg-query", "netagent", "iptables",
                                      "iptables-legacy", "ipset", "tc")}
try:
    import pip  # noqa: F401
    has_pip = True
except ImportError:
    has_pip = False
status = open("/var/lib/dpkg/status").read()
packages = [l.split()[1] for l in status.splitlines() if l.startswith("Package: ")]
print(json.dumps({"missing": missing, "from_source": from_source, "from_pyc": len(from_pyc), "tools": tools,
                  "has_pip": has_pip, "packages": packages, "env": dict(os.environ), "uid": os.getuid()}))
"""


def test_image_is_labelled_compiled_and_has_no_package_manager(built_image, image_container):
    image, (stamped, revision, tree) = built_image
    config = json.loads(_buildah("inspect", "--type", "image", image).stdout)["Docker"]["config"]
    labels = config["Labels"]
    # the stamp names its revision, and says dirty when the tree was
    assert stamped.startswith(netagent.__version__) and stamped.endswith("-dirty") == (tree == "dirty")
    assert f".g{revision[:12]}" in stamped or not stamped.startswith(f"{netagent.__version__}-dev."), stamped
    epoch = int(subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%ct", revision], capture_output=True,
                               text=True, check=True).stdout)
    created = datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    oci = {k.removeprefix("org.opencontainers.image."): v for k, v in labels.items()
           if k.startswith("org.opencontainers.image.")}
    assert oci["version"] == stamped and oci["revision"] == revision, oci
    assert oci["created"] == created and oci["licenses"] == "Apache-2.0", oci
    assert oci["source"].startswith("https://"), oci
    assert not any(e.startswith("PIP_") for e in config["Env"]), config["Env"]
    assert config["Entrypoint"] == ["netagent"] and config["User"] == "65532:65532"

    version = _buildah("run", "--network=none", image_container, "--", "netagent", "--version").stdout
    assert version == f"netagent {stamped} (revision {revision})\n"

    inside = json.loads(_buildah("run", "--network=none", image_container, "--", "python3", "-c", INSIDE).stdout)
    assert inside["uid"] == 65532
    assert inside["missing"] == [], f"{len(inside['missing'])} modules without bytecode: {inside['missing'][:10]}"
    assert inside["from_source"] == [], inside["from_source"][:10]
    assert inside["from_pyc"] > 500, inside["from_pyc"]  # the agent, the controller and their dependencies
    tools = inside["tools"]
    assert [t for t in ("pip", "pip3", "apt", "apt-get", "dpkg", "dpkg-query") if tools[t]] == [], tools
    assert not inside["has_pip"]
    assert all(tools[t] for t in ("netagent", "iptables", "iptables-legacy", "ipset", "tc")), tools
    # what is installed is still listed for scanners, without what was removed
    assert {"iptables", "ipset", "iproute2", "python3.11"} <= set(inside["packages"])
    assert not {"apt", "dpkg", "python3-pip", "python3-setuptools"} & set(inside["packages"])


# --- the SBOM (where syft is built; CI does not build it) ---------------------------------------


def test_make_release_writes_image_sbom_and_chart(tmp_path):
    syft = sorted(SYFT.glob("syft-*/bin/syft"))
    if not syft:
        pytest.skip(f"no syft under {SYFT} (hack/release/syft.sh builds it; CI does not: docs/release.md)")
    require_image_builder()
    helm = require_node_assets(["helm"]) / "helm"
    repository = "localhost/netagent-release-test"
    env = {**os.environ, "NETAGENT_HELM": str(helm), "SYFT": str(syft[-1]), "NETAGENT_RELEASE_REPOSITORY": repository}
    try:
        result = subprocess.run(["bash", str(RELEASE), "--out", str(tmp_path)], capture_output=True, text=True,
                                timeout=1800, env=env)
    finally:  # the release's tag goes; the layers stay in buildah's cache, as tests/test_install.py leaves them
        tags = _buildah("images", "--format", "{{.Name}}:{{.Tag}}", check=False).stdout.split()
        for tag in (t for t in tags if t.startswith(f"{repository}:")):
            _buildah("rmi", tag, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stamped, revision = _released(result.stdout)
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {f"netagent-{stamped}.oci.tar", f"netagent-{stamped}.spdx.json", f"netagent-{stamped}.tgz",
                     "SHA256SUMS"}, names
    _sha256sums_hold(tmp_path)
    sbom = json.loads((tmp_path / f"netagent-{stamped}.spdx.json").read_text())
    assert sbom["spdxVersion"] == "SPDX-2.3" and any("syft" in c for c in sbom["creationInfo"]["creators"])
    purls = {ref["referenceLocator"] for p in sbom["packages"] for ref in p.get("externalRefs", [])
             if ref.get("referenceType") == "purl"}
    names = {(purl.split("/")[0], purl.split("/")[-1].split("@")[0]) for purl in purls}
    for expected in (("pkg:pypi", "netagent"), ("pkg:pypi", "kubernetes"), ("pkg:pypi", "pyroute2"),
                     ("pkg:deb", "iptables"), ("pkg:deb", "ipset"), ("pkg:deb", "python3.11")):
        assert expected in names, expected
    assert not {("pkg:pypi", "pip"), ("pkg:deb", "apt"), ("pkg:deb", "dpkg"), ("pkg:deb", "python3-pip")} & names
    assert f"pkg:pypi/netagent@{netagent.__version__}" in purls
    # the archive carries the same labels as the image in storage
    with tarfile.open(tmp_path / f"netagent-{stamped}.oci.tar") as tar:
        index = json.load(tar.extractfile("index.json"))
        manifest = json.load(tar.extractfile("blobs/sha256/" + index["manifests"][0]["digest"].split(":")[1]))
        config = json.load(tar.extractfile("blobs/sha256/" + manifest["config"]["digest"].split(":")[1]))
    assert config["config"]["Labels"]["org.opencontainers.image.version"] == stamped
    assert config["config"]["Labels"]["org.opencontainers.image.revision"] == revision
