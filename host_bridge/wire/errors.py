"""Errors both sides of the wire raise for a user to fix, and how an engine process reports one."""

from __future__ import annotations

import argparse
from typing import NoReturn

# The exit code of a process that refused what the user asked for (a bad option or config, missing
# weights): the `loom` command's and the engine's. Starting the same engine again cannot help, so a
# host's supervisor does not restart an engine that exits with it.
EXIT_USER_ERROR = 2
# How the engine process prints that refusal (one line, on stderr); the launcher finds it by this.
SERVE_ERROR_PREFIX = "loom serve: error: "


class UserError(Exception):
    """A problem with what the user asked for; the `loom` command prints it as one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose mistakes are one line, as every other refusal is (`loom play: error: argument
    --size: ...`), ending with a pointer to --help instead of following the usage block argparse prints (14
    lines for `loom play`, which buried the error). `add_subparsers` makes its subcommands of the same class."""

    def error(self, message: str) -> NoReturn:
        lists = "commands" if self._subparsers is not None else "options"
        hint = f" ({self.prog} --help lists the {lists})" if self.add_help else ""
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message}{hint}\n")
