"""tests/README.md's naming scheme holds: every test file is test_<package>_<...>.py, so a module's tests
are found from its name; the files named before the scheme are listed here until they are renamed."""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).parent
PACKAGES = ("core", "agent", "controller", "tc", "iptables", "cli", "chart", "dashboards", "lab", "bench", "repo",
            "quota", "scopes", "team")
# named before the scheme (tests/README.md): renamed when nobody is editing them; this list only shrinks
BEFORE_THE_SCHEME = {
    "test_alerts_chart.py", "test_bootstrap.py", "test_closed_loop.py", "test_demo.py", "test_deploy.py",
    "test_e2e_lab.py", "test_faults_controller.py", "test_image_base.py", "test_install.py", "test_kube_harness.py",
    "test_layers.py", "test_quantity_bytes.py", "test_rate_grammar.py", "test_real_node.py", "test_release.py",
    "test_status_cluster.py", "test_typecheck.py",
}


def test_every_test_file_is_named_for_its_package():
    names = {p.name for p in TESTS.glob("test_*.py")}
    outside = sorted(n for n in names - BEFORE_THE_SCHEME if n.removeprefix("test_").split("_")[0] not in PACKAGES
                     and n.removeprefix("test_").removesuffix(".py") not in PACKAGES)
    assert not outside, f"name these test_<package>_<module>[_kernel|_traffic|_kube|_lab].py (tests/README.md): {outside}"
    gone = sorted(BEFORE_THE_SCHEME - names)
    assert not gone, f"renamed or removed: take them off BEFORE_THE_SCHEME: {gone}"
