"""The house's floors as a test: import-linter's contracts (pyproject.toml) hold, they are not
vacuous (a deliberately wrong arrow breaks them), and the product imports at module level only
(no import hidden in a function to dodge a cycle)."""
from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("cli", "netagent", "controller", "core", "tc", "iptables")
PACKAGES = (*PRODUCT, "lab", "tests", "bench")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports")
    assert exe, "lint-imports is missing: pip install -e '.[test]' (import-linter)"
    return subprocess.run([exe, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})


def test_the_layer_contracts_hold():
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


@pytest.mark.parametrize("module,line,broken", [
    ("netagent/agent.py", "import controller.state", "layers"),  # sibling processes
    ("controller/state.py", "import netagent.reporter", "layers"),
    ("core/policy.py", "import controller.allocator", "layers"),  # the core above a process
    ("controller/app.py", "import lab.topology", "layers"),  # the product imports the lab
    ("tc/model.py", "import iptables.model", "layers"),  # sibling libraries
    ("iptables/apply.py", "import pyroute2", "pyroute2"),
    ("netagent/sync.py", "import tests.kube", "tests"),
    ("core/wire.py", "import aiohttp", "core needs"),
])
def test_a_wrong_arrow_breaks_a_contract(tmp_path, module, line, broken):
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # deliberately wrong\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0, f"{module}: `{line}` went unnoticed"
    broken_contracts = [ln for ln in done.stdout.splitlines() if " BROKEN" in ln]
    assert any(broken in ln for ln in broken_contracts), done.stdout[-3000:]


def test_the_product_imports_at_module_level_only():
    """An import inside a function hides an arrow from the drawing and usually dodges a cycle."""
    hidden = []
    for package in PRODUCT:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for inner in ast.walk(node):
                        if isinstance(inner, (ast.Import, ast.ImportFrom)):
                            hidden.append(f"{path.relative_to(REPO)}:{inner.lineno}")
    assert not hidden, f"imports inside functions: {hidden}"
