"""The `loom` command: one entry point, one module per subcommand under engine.commands.

Each subcommand module exposes `add_parser(subparsers)`, which registers its parser and sets
`func` to a callable taking the parsed arguments and returning an exit code. Errors a user can
fix (bad config, missing file) end with a one-line message and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from host_bridge.typed_config import ConfigError

SUBCOMMANDS = ("info", "play", "serve", "encode-prompts", "bench", "eval", "train")
EXIT_USAGE = 2


class UserError(Exception):
    """A problem with what the user asked for; printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="Loom: live video restyling with streaming diffusion.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"engine.commands.{name.replace('-', '_')}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except (ConfigError, UserError, FileNotFoundError, ValueError) as exc:
        print(f"loom {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"loom {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
