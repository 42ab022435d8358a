"""The ``captum-vit`` command line (console script ``captum-vit = captum_vit.cli:main``).

Each sub-command is a module of :mod:`captum_vit.commands` exposing
``add_arguments(parser)`` and ``run(args) -> int``. A command's module (and with it torch)
is imported only when that command is parsed or its help is shown, so ``captum-vit
--help`` answers at once.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from captum_vit.commands.options import HelpFormatter

COMMANDS: dict[str, str] = {
    "explain": "captum_vit.commands.explain",
    "evaluate": "captum_vit.commands.evaluate",
}
"""Sub-command name -> the module implementing it."""

EPILOG = """examples:
  captum-vit explain                                  # the bundled model and a sample image
  captum-vit explain --image photo.png --methods gae,rollout --target Sneaker
  captum-vit evaluate --methods gae,rollout,random --n 32 --out evaluation

'captum-vit COMMAND --help' lists a command's options."""


def summary(module: str) -> str:
    """The first line of a command module's docstring, read without importing it.

    Args:
        module (str): the module's dotted name, e.g. ``"captum_vit.commands.explain"``.

    Returns:
        str: the line, without reST markup and the leading ``captum-vit NAME:``.
    """
    spec = importlib.util.find_spec(module)
    doc = None
    if spec is not None and spec.origin and spec.origin.endswith(".py"):
        doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8")))
    if doc is None:
        doc = importlib.import_module(module).__doc__
    line = (doc or "").strip().splitlines()[0].replace("``", "") if doc else ""
    return re.sub(r"^captum-vit \w+:\s*", "", line)


class CommandParser(argparse.ArgumentParser):
    """The parser of one sub-command: its module adds the options the first time the
    parser parses or formats help, so commands that are not run are never imported."""

    def __init__(self, *args: Any, module: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.module = module
        self.loaded = not module

    def load(self) -> None:
        """Import the command's module and add its options (once)."""
        if not self.loaded:
            self.loaded = True
            importlib.import_module(self.module).add_arguments(self)

    # argparse's overloads type the namespace; this override loads the options, then defers
    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> Any:
        self.load()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.load()
        return super().format_help()

    def format_usage(self) -> str:
        self.load()
        return super().format_usage()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per command (their options are added
    when the command is parsed; see :class:`CommandParser`).

    Returns:
        argparse.ArgumentParser: the ``captum-vit`` parser.
    """
    parser = argparse.ArgumentParser(prog="captum-vit",
                                     description="Explain Vision Transformers with Captum.",
                                     epilog=EPILOG, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=CommandParser)
    for name, module in COMMANDS.items():
        text = summary(module)
        sub.add_parser(name, help=text, description=text, module=module,
                       formatter_class=HelpFormatter)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``captum-vit``.

    Args:
        argv (Sequence[str], optional): the arguments; default ``sys.argv[1:]``.

    Returns:
        int: the exit status (2 for a usage error).
    """
    args = build_parser().parse_args(argv)
    try:
        return importlib.import_module(COMMANDS[args.command]).run(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"captum-vit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
