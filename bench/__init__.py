"""Benchmarks: each file is a script that prints figures and a ratio against a baseline (see README)."""
