"""Errors both sides of the wire raise for a user to fix."""


class UserError(Exception):
    """A problem with what the user asked for; the `loom` command prints it as one line, exit code 2."""
