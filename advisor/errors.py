"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class UsageError(Exception):
    """Bad input from the user (unknown preset, malformed layout, impossible split...)."""
