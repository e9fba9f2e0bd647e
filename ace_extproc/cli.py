"""The ``ace-extproc`` command. Each subcommand lives in its own module, which
provides ``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib import metadata

DESCRIPTION = "Prefix-cache-aware routing for LLM fleets: an Envoy ext_proc sidecar."
# What ``--log-level`` accepts, in any subcommand that has one (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("ace_extproc.server", "run the ext_proc gRPC server"),
    "up": ("ace_extproc.stack", "start Envoy, ace-extproc and simulated pods on 127.0.0.1:8080"),
    "sim": ("ace_extproc.sim.app", "run one simulated vLLM-compatible engine pod"),
    "envoy-config": ("ace_extproc.envoy_config", "render the Envoy bootstrap for a fleet"),
    "ctl": ("ace_extproc.ctl", "a running server's admin API: pods, lookup, drain, config"),
    "schema": ("ace_extproc.config_schema", "fleet.yaml's JSON Schema, or its reference"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or with ``only`` one subcommand's arguments: its module alone is
    imported, so a simulated pod never loads gRPC, nor the server the pods' code."""
    parser = argparse.ArgumentParser(prog="ace-extproc", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or name == only:
            importlib.import_module(module).add_arguments(p)
            _check_log_level(p)
        p.set_defaults(_module=module)
    return parser


def version() -> str:
    """The installed package's version (its metadata), or "unknown" in a bare checkout."""
    try:
        return metadata.version("ace-extproc")
    except metadata.PackageNotFoundError:
        return "unknown"


def _check_log_level(parser: argparse.ArgumentParser) -> None:
    """A subcommand's ``--log-level`` takes a level's name only: argparse refuses any
    other word with a usage error, rather than logging's ValueError later."""
    for action in parser._actions:
        if action.dest == "log_level" and action.choices is None:
            action.type = str.upper
            action.choices = LOG_LEVELS
            action.metavar = "{" + ",".join(level.lower() for level in LOG_LEVELS) + "}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    module = importlib.import_module(args._module)
    result: int = module.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
