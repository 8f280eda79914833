"""One error type for bad input: the CLI prints its message as one line and exits non-zero."""


class DraftsmithError(Exception):
    """A problem the user can fix; the message says what and where."""
