"""Typed errors. A QfdError is a user mistake or an unmet precondition: the CLI prints its
message as one red line and exits with code 2, never a traceback."""


class QfdError(Exception):
    """An error the user can fix; the message names the problem and the fix."""

    exit_code = 2
