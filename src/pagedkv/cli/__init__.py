"""Command line: ``pagedkv plan | models | simulate | generate``.

Each subcommand lives in its own module exposing ``register(subparsers)``; the parser it
adds sets ``func(args) -> int``. Every pagedkv error becomes one line on stderr and exit
status 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence

from pagedkv import __version__
from pagedkv.errors import PagedKVError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors: one line, status 2
        self.exit(2, f"pagedkv: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from pagedkv.cli import generate_cmd, models_cmd, plan_cmd, simulate_cmd

    parser = _Parser(prog="pagedkv", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in (plan_cmd, models_cmd, simulate_cmd, generate_cmd):
        module.register(sub)
    return parser


def _one_line(message, category, filename, lineno, file=None, line=None) -> None:
    """The library's warnings as the CLI's own lines (not Python's file:line form)."""
    print(f"pagedkv: warning: {message}", file=file or sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line
            return int(args.func(args) or 0)
    except BrokenPipeError:  # `pagedkv ... | head`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (PagedKVError, OSError, ValueError) as exc:  # OSError, ValueError: unreadable
        # files, malformed numbers from the OS/json; one line even where a message nests one
        print(f"pagedkv: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
