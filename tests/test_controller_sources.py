"""controller/sources.py's file mode (`netagent controller --from-file`): the NetworkScopes document named
`cluster` in the policy files reaches the cost keeper at start and on every change, as the cluster mode's
watch does (issue 39: prices, hence cost and cost quotas, without an API server; the demo's cost quota)."""
from __future__ import annotations

import copy

import yaml

from controller.cost import CostKeeper
from controller.sources import FilePolicy
from lab.procs import wait_for
from tests.test_scopes import EXAMPLE

BUDGET = {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressBudget", "metadata": {"name": "default"},
          "spec": {"total": "100M", "teams": [{"name": "web", "namespaces": ["web"]}]}}


def write(path, docs) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(docs))
    tmp.replace(path)


def test_the_files_networkscopes_prices_follow_the_file(tmp_path):
    f = tmp_path / "policy.yaml"
    write(f, [BUDGET, EXAMPLE])
    keeper = CostKeeper()
    files = FilePolicy([str(f)])
    files.on_scopes = keeper.set_scopes
    files.start()
    try:
        assert keeper.prices is not None and keeper.prices.currency == "USD"  # the first read, at start
        refused = copy.deepcopy(EXAMPLE)
        refused["spec"]["prices"]["currency"] = "XXY"
        write(f, [BUDGET, refused])
        wait_for(lambda: keeper.problems, what="the refused description")
        assert any("spec.prices.currency" in p for p in keeper.problems)
        assert keeper.prices.currency == "USD"  # the last valid stays in force
        write(f, [BUDGET])
        wait_for(lambda: keeper.prices is None, what="the prices gone with the document")
    finally:
        files.stop()
