"""Shared pytest configuration.

Fixture plugins are listed in pytest_plugins so every test module sees them.
"""
import os
import sys

pytest_plugins: list[str] = ["tests.kube", "tests.node"]

# Under the project's venv (`.venv/bin/python -m pytest`, scripts/bootstrap.sh) its console scripts
# (lint-imports, hadolint) and its python3 come first on PATH, as if the venv were activated, for the
# tests' shutil.which and for the processes they start.
if sys.prefix != sys.base_prefix:
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
