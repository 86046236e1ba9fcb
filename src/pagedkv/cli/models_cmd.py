"""``pagedkv models``: the bundled catalog."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("models", help="list the bundled model catalog")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedkv.models import catalog_description, catalog_names

    names = catalog_names()
    width = max(len(n) for n in names)
    for name in names:
        print(f"{name:<{width}}  {catalog_description(name)}")
    return 0
