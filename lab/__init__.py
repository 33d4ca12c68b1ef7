"""Tooling beside the product: the namespace lab (`topology`, `netns`, `nsexec`), the agent as a
lab process (`agentproc`), traffic generators (`udpflood`) and the single-machine demo (`demo`).

Tests, benchmarks and `netagent demo` use it; the agent and the controller never import it,
and neither the wheel nor the image carries it (checked by import-linter and by tests).
"""
