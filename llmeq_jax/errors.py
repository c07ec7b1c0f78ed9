"""The one exception type for mistakes a user can fix (a missing file, a bad option, a clash of options).

The library raises it with a message that says what was expected; the CLI prints it as
one line on stderr and exits with status 2.
"""


class UsageError(Exception):
    """An error the user can fix; its message is one line that says what was expected."""
