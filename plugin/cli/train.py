"""`loom train ...`: the embedded model's recipe (engine/train/cli.py; also `python -m loom_live.engine.train`)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train Loom's embedded default model (prepare, table, fit, eval, picture)",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="the recipe's own command and options (prepare, table, fit, eval, picture; --help lists them)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loom_live.engine.train.cli import main

    return main(args.rest or ["--help"])
