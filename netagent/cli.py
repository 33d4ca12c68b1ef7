"""The `netagent` command: one entry point, one subcommand per job.

Each subcommand lives in the module that owns its concern; this file only wires
them to argparse, so adding a command never means editing another's code.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help). Each module provides add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("netagent.agent_cli", "run the per-node agent"),
    "status": ("netagent.agent_cli_status", "print this node's pods: class, allocation, rate, bytes, drops"),
    "cleanup": ("netagent.cleanup_cli", "remove everything netagent created on this node (idempotent)"),
    "plan": ("controller.whatif", "print the allocation a policy gives for given demands"),
    "controller": ("controller.main", "run the central controller"),
    "demo": ("netagent.demo", "run the single-machine demo (root; needs no cluster)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="netagent", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # not built yet in this checkout
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
