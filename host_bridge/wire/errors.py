"""Errors both sides of the wire raise for a user to fix, and how an engine process reports one."""

# The exit code of a process that refused what the user asked for (a bad option or config, missing
# weights): the `loom` command's and the engine's. Starting the same engine again cannot help, so a
# host's supervisor does not restart an engine that exits with it.
EXIT_USER_ERROR = 2
# How the engine process prints that refusal (one line, on stderr); the launcher finds it by this.
SERVE_ERROR_PREFIX = "loom serve: error: "


class UserError(Exception):
    """A problem with what the user asked for; the `loom` command prints it as one line, exit code 2."""
