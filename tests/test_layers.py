"""The house's floors as a test: import-linter's contracts (pyproject.toml) hold, they are not
vacuous (a deliberately wrong arrow breaks them), no import is hidden in a function to dodge a
cycle, and each process loads only its own part."""
from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("cli", "netagent", "controller", "core", "tc", "iptables", "nlwire")
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
    ("nlwire/__init__.py", "import tc.rawnl", "layers"),  # the wire above what speaks it
    ("core/quantity.py", "import pyroute2", "pyroute2"),  # netlink outside tc/ and iptables/
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


# The only places a module is imported inside a function: where a process picks a part by mode, so
# that it never loads what it does not run (the footprint test below holds them to it).
LOADED_BY_MODE = {
    "cli/main.py": "each subcommand imports the process it runs",
    "netagent/daemon.py": "the kubernetes client only with Kubernetes, the engine (numpy) only in single-node mode",
}


def test_imports_inside_functions_only_where_a_part_is_chosen_by_mode():
    """An import inside a function hides an arrow from a reader and usually dodges a cycle."""
    hidden = []
    for package in PRODUCT:
        for path in sorted((REPO / package).rglob("*.py")):
            if str(path.relative_to(REPO)) in LOADED_BY_MODE:
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for inner in ast.walk(node):
                        if isinstance(inner, (ast.Import, ast.ImportFrom)):
                            hidden.append(f"{path.relative_to(REPO)}:{inner.lineno}")
    assert not hidden, f"imports inside functions: {hidden}"


@pytest.mark.parametrize("mode,loaded", [
    # the agent as `netagent run --from-file` builds it (single-node): the engine, not the client
    ("files", {"numpy"}),
    # the agent with Kubernetes and a controller: the client, not the engine
    ("kube", {"kubernetes"}),
])
def test_the_agent_loads_only_its_own_part(mode, loaded):
    """The agent's memory is its budget (docs: RSS aim): it never loads the controller's web server,
    the demo's terminal UI or plotting, and only the mode's own heavy parts."""
    code = f"""
import json, sys, functools
import cli.main
from netagent import daemon
from netagent.config import AgentConfig
if {mode!r} == "files":
    from netagent.local import LocalAllocator
else:
    from netagent.sources import KubeSource, kube_event_emitter, load_api_client
print(json.dumps(sorted(m for m in ("aiohttp", "rich", "matplotlib", "controller.app", "controller.whatif", "lab",
                                    "kubernetes", "numpy") if m in sys.modules)))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(json.loads(done.stdout)) == loaded


def test_the_agent_loads_only_the_pyroute2_modules_it_uses():
    """pyroute2's own __init__ imports the whole library (NDB and sqlite, IPDB, wireless...: ~6 MiB
    of the agent's RSS aim); nlwire registers the package without it. A name only the __init__
    defines still works, and loads the rest then."""
    code = """
import json, sys
import cli.main
from netagent import daemon
from netagent.local import LocalAllocator
from netagent.sources import KubeSource
before = sorted(m for m in ("pyroute2.ndb.main", "pyroute2.ipdb", "sqlite3", "pyroute2.plan9.client") if m in sys.modules)
import pyroute2.netns
from pyroute2 import netlink
quiet = "pyroute2.ndb.main" in sys.modules
from pyroute2 import IPRoute, NDB
import pyroute2
print(json.dumps([before, quiet, IPRoute.__name__, NDB.__name__, pyroute2.__version__ != "unknown"]))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == [[], False, "IPRoute", "NDB", True]
