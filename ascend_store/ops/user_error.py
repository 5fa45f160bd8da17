"""The CLI's failures a user can fix, and its exit codes (ops/cli.py says what each means)."""

from __future__ import annotations

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
EXIT_BROKEN_PIPE = 141  # what a shell reports for a tool that SIGPIPE stopped
GIB = 2**30


class UserError(Exception):
    """A failure the user can fix: printed as one paragraph, exit ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code
