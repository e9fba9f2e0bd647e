"""``python -m ace_extproc.sim --port 8001``: run one simulated pod."""

from __future__ import annotations

import argparse
import sys

from .app import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ace_extproc.sim",
        description="run one simulated vLLM-compatible engine pod",
    )
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
