"""The `diloco` command line: one entry point for users, containers and tests.

apps/commands.py registers the subcommands (the simulator's two in apps/sim/cli.py); each
handler imports its component when it runs, so `diloco --help` and `diloco validate` stay fast
and the syncer image, which has no JAX, runs every command it needs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

DISTRIBUTION = "decoupled-diloco"  # pyproject.toml's [project] name


def build_parser() -> argparse.ArgumentParser:
    from diloco.apps import commands
    from diloco.apps.plan import cli as plan_cli
    from diloco.apps.sim import cli as sim_cli

    parser = argparse.ArgumentParser(
        prog="diloco",
        description="Decoupled DiLoCo: asynchronous, fault-tolerant LLM pre-training.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parsers(sub)
    sim_cli.add_simulate_parser(sub)
    sim_cli.add_bandwidth_parser(sub)
    plan_cli.add_parser(sub)
    return parser


def version() -> str:
    """The installed package's version (its metadata: what `pip install` recorded), so an image
    and a bug report name the same release."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
