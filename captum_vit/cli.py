"""The ``captum-vit`` command line (console script ``captum-vit = captum_vit.cli:main``).

Each sub-command is a module of :mod:`captum_vit.commands` exposing
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from captum_vit.commands import evaluate, explain

COMMANDS = {"explain": explain, "evaluate": evaluate}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per command."""
    parser = argparse.ArgumentParser(prog="captum-vit",
                                     description="Explain Vision Transformers with Captum.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, mod in COMMANDS.items():
        mod.add_arguments(sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0]))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``captum-vit``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"captum-vit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
