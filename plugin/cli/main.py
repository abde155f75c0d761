"""The `loom` command: one entry point, one module per subcommand under plugin.cli.

The engine's own entry point (`python -m loom_live.engine serve`, what the launcher runs) is
`engine.server.main`; `loom serve` registers that same parser here, so `engine` never imports `plugin`.

Each subcommand module exposes `add_parser(subparsers)`, which registers its parser and sets
`func` to a callable taking the parsed arguments and returning an exit code. Errors a user can
fix (bad config, missing file, a mistaken option) end with a one-line message and exit code 2, never a
traceback or a usage block.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from loom_live.engine.graphs.compile_cache import enable_bytecode_cache
from loom_live.host_bridge.wire import logs
from loom_live.host_bridge.wire.errors import OneLineParser, UserError
from loom_live.host_bridge.wire.typed_config import ConfigError
from loom_live.plugin.cli.common import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_USAGE, version

SUBCOMMANDS = ("info", "play", "web", "serve", "pull", "prepare", "encode-prompts", "bench", "eval", "train")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="loom", description="Loom: live video restyling with streaming diffusion.")
    parser.add_argument("--version", action="version", version=f"loom {version()}",
                        help="print Loom's version and exit")
    logs.add_option(parser)  # global: `loom --log-level debug play ...`; engines it launches log at it too
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = "loom_live.engine.server.main" if name == "serve" else f"loom_live.plugin.cli.{name.replace('-', '_')}"
        try:
            importlib.import_module(module).add_parser(sub)
        except ImportError as exc:  # a broken library (OpenCV without libGL, a torch without its CUDA libraries)
            _unavailable(sub, name, exc)  # costs that command only: `loom info` must still say what is wrong
    return parser


def _unavailable(sub: argparse._SubParsersAction, name: str, exc: ImportError) -> None:
    """A subcommand whose module cannot be imported: listed, and refused in one line naming the import error."""
    why = f"{type(exc).__name__}: {exc}"

    def refuse(args: argparse.Namespace) -> int:
        raise UserError(f"this command cannot run here: a library it needs does not load ({why}); `loom info` "
                        "lists what is installed")

    command = sub.add_parser(name, help=f"(not available: {why[:80]})", add_help=False)
    command.set_defaults(func=refuse, unavailable=True)


def main(argv: list[str] | None = None) -> int:
    enable_bytecode_cache()  # before a command imports torch; the engines it launches inherit the setting
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command == "train":  # the recipe parses its own options; argparse's REMAINDER
        args.rest = [*unknown, *args.rest]     # leaves a leading one out (`loom train --help`, `-h`)
        unknown = []
    if unknown and getattr(args, "unavailable", False):  # its options are unknown: say why it cannot run instead
        unknown = []
    if unknown:  # named by the subcommand's own usage, not the top-level one
        command = parser._subparsers._group_actions[0].choices.get(args.command) if args.command else None
        (command or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    logs.configure(args.log_level)
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
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`loom pull --list | head`): the rest is not wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's own flush is quiet
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
