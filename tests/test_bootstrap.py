"""scripts/bootstrap.sh never pip-installs into the system's Python (README, "Bootstrap").

Each test copies what bootstrap and the install read (the script, pyproject.toml, README.md, the
product's packages) into a throwaway checkout, runs `bootstrap.sh --demo` there for real, as root,
and compares `pip freeze --all` of the interpreters it could have written to, before and after.
The install is offline from the machine's wheelhouse (~/.cache/netagent/wheels) once the main
bootstrap filled it, as CI's did; the apt step finds everything installed and does nothing.

The second test stands in for "a machine with another project's packages in the system Python":
the python3 first on PATH is a throwaway venv holding an old release of a package the project
needs (prometheus_client 0.9.0 against our >=0.20), the case where the old bootstrap upgraded the
other project's packages. That release is a wheel this test writes itself (name, version and one
module: no network in tests); pip treats it as any installed distribution. What CI does not run:
Debian's own /usr/bin/python3 with packages pip installed under /usr/local (PEP 668 refuses those
installs there); the venv stand-in is what the suite can make and remove on demand.
"""
from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from lab.netns import require_root

pytestmark = [pytest.mark.root]

REPO = Path(__file__).resolve().parent.parent
# what `pip install -e .[demo]` and the script read (.dockerignore lists the same product)
CHECKOUT = ("pyproject.toml", "README.md", "scripts/bootstrap.sh",
            "cli", "netagent", "controller", "core", "tc", "iptables", "nlwire")


def outside_venvs(path: str) -> str:
    """PATH without any venv's bin directory: what a shell that never activated one would have."""
    return os.pathsep.join(d for d in path.split(os.pathsep) if d and not (Path(d).parent / "pyvenv.cfg").exists())


def system_python() -> str:
    found = shutil.which("python3", path=outside_venvs(os.environ.get("PATH", "")))
    assert found, "no python3 on PATH outside a venv"
    return found


def freeze(python: str) -> list[str]:
    done = subprocess.run([python, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def checkout(tmp: Path) -> Path:
    root = tmp / "checkout"
    for name in CHECKOUT:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / name)
    return root


def bootstrap(root: Path, path: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    # no byte-compiling of what the throwaway venv gets: it halves the install's CPU and changes nothing of
    # where pip writes
    env |= {"PATH": path, "PIP_NO_COMPILE": "1"}
    done = subprocess.run(["bash", "scripts/bootstrap.sh", "--demo"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def venv_reports(root: Path, code: str) -> str:
    return subprocess.run([str(root / ".venv/bin/python"), "-c", code], cwd="/", capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


def test_bootstrap_leaves_the_system_python_alone(tmp_path):
    require_root()
    system = system_python()
    before = freeze(system)
    root = checkout(tmp_path)
    path = outside_venvs(os.environ["PATH"])

    first = bootstrap(root, path)
    assert f"python3 -m venv .venv (from {shutil.which('python3', path=path)})" in first.stdout, first.stdout
    assert freeze(system) == before
    # the project runs from the venv, editable from this checkout
    assert venv_reports(root, "import netagent; print(netagent.__file__)") == str(root / "netagent/__init__.py")

    # a re-run changes nothing and installs nothing
    again = bootstrap(root, path)
    assert "has .[demo] (pyproject.toml unchanged)" in again.stdout, again.stdout
    assert "pip" not in again.stdout.replace("(pyproject.toml unchanged)", ""), again.stdout
    assert freeze(system) == before


def old_release_wheel(directory: Path, name: str, version: str) -> Path:
    """A minimal wheel of `name` at `version`: one module and the dist-info pip needs to install,
    list and uninstall it."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f'__version__ = "{version}"\n',
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests/test_bootstrap.py\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def test_bootstrap_beside_another_projects_old_packages(tmp_path):
    require_root()
    system = system_python()
    system_before = freeze(system)
    # "the system Python" of another project: python3 first on PATH, with an old prometheus_client
    other = tmp_path / "other-project"
    subprocess.run([system, "-m", "venv", str(other)], check=True, timeout=300)
    (tmp_path / "wheels").mkdir()
    wheel = old_release_wheel(tmp_path / "wheels", "prometheus_client", "0.9.0")
    subprocess.run([str(other / "bin/python"), "-m", "pip", "install", "-q", "--no-index", "--find-links",
                    str(wheel.parent), "prometheus-client==0.9.0"], check=True, timeout=120)
    other_before = freeze(str(other / "bin/python"))
    assert "prometheus-client==0.9.0" in other_before, other_before
    root = checkout(tmp_path)
    path = os.pathsep.join([str(other / "bin"), outside_venvs(os.environ["PATH"])])

    first = bootstrap(root, path)
    assert f"python3 -m venv .venv (from {other / 'bin/python3'})" in first.stdout, first.stdout
    # the other project keeps its release; ours has its own, from the venv
    assert freeze(str(other / "bin/python")) == other_before
    assert freeze(system) == system_before
    version = venv_reports(root, "import prometheus_client, importlib.metadata as m; "
                                 "print(m.version('prometheus-client'), prometheus_client.__file__)")
    number, where = version.split()
    assert tuple(int(p) for p in number.split(".")[:2]) >= (0, 20), version
    assert where.startswith(str(root / ".venv")), version
