"""The type checker over the product packages: mypy with the settings in pyproject.toml's [tool.mypy]
(strict for the pure core modules, the defaults elsewhere, attr-defined everywhere).

Its cache lives in the temporary directory, not the tree: a fresh clone checks everything (~40 s of
CPU), a second run only what changed (a few seconds).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(tempfile.gettempdir()) / "netagent-mypy-cache"


def product_packages() -> list[str]:
    """The wheel's top-level packages (pyproject's [tool.setuptools] packages): -p takes their subpackages."""
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    return [p for p in packages if "." not in p]


def mypy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
                           "--cache-dir", str(CACHE), *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "MYPYPATH": str(REPO)})


def test_the_product_packages_type_check():
    result = mypy(*(arg for p in product_packages() for arg in ("-p", p)))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "Success" in result.stdout


def test_a_protocol_that_lacks_a_method_the_code_calls_fails_the_check(tmp_path):
    """The test of the test: the checker catches a call to a method a Protocol does not declare, on a
    Protocol of its own and on the agent's DataPath (which declares class_stats per direction, its
    download half since this checker found it missing; egress_class_stats does not exist)."""
    own = tmp_path / "gap_own.py"
    own.write_text(textwrap.dedent("""\
        from typing import Protocol

        class Source(Protocol):
            def read(self) -> int: ...

        def use(source: Source) -> int:
            return source.read() + source.read_more()
        """))
    agent = tmp_path / "gap_agent.py"
    agent.write_text(textwrap.dedent("""\
        from netagent.datapath import DataPath

        def use(dp: DataPath) -> int:
            return len(dp.class_stats()) + len(dp.sample_stats()[1]) + len(dp.egress_class_stats())
        """))
    result = mypy(str(own), str(agent))
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, result.stdout
    assert '"Source" has no attribute "read_more"  [attr-defined]' in errors[0]
    assert '"DataPath" has no attribute "egress_class_stats"' in errors[1] and "[attr-defined]" in errors[1]
