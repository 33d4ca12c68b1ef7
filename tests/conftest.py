"""Shared pytest configuration.

Fixture plugins are listed in pytest_plugins so every test module sees them.
"""
pytest_plugins: list[str] = ["tests.kube", "tests.node"]
