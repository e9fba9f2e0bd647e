"""The top-level command: its help, its version, and a bad log level refused cleanly."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

from ace_extproc import cli


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "ace_extproc.cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_help_describes_the_command_in_a_whole_sentence() -> None:
    out = _run("--help")
    assert out.returncode == 0
    assert f"\n{cli.DESCRIPTION}\n" in out.stdout
    assert cli.DESCRIPTION.endswith(".")


def test_version_is_the_package_metadata() -> None:
    out = _run("--version")
    assert out.returncode == 0
    assert out.stdout == f"ace-extproc {metadata.version('ace-extproc')}\n"


@pytest.mark.parametrize("level", ["bogus", "verbose"])
def test_a_bad_log_level_is_a_usage_error(level: str) -> None:
    out = _run("serve", "--log-level", level)
    assert out.returncode == 2
    assert "argument --log-level: invalid choice" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_log_level_is_taken_in_any_case() -> None:
    args = cli.build_parser("serve").parse_args(["serve", "--log-level", "debug"])
    assert args.log_level == "DEBUG"
