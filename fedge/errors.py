"""The base of every error whose message tells a user what was wrong and what to do."""


class UserError(Exception):
    """A problem with input, configuration or environment that the user can fix; the CLI prints its message in
    one line and exits 2. Anything else is a bug and keeps its traceback."""
