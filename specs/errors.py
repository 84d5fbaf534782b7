"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class UsageError(Exception):
    """Bad input from the user (unknown preset, malformed layout, impossible split...).

    The message is folded onto one line: it often quotes what the user wrote or what a parser said
    (YAML errors span lines, a key may hold a newline). A subclass whose message is a list by
    design sets `multiline`."""

    multiline = False

    def __init__(self, message: object = "") -> None:
        text = str(message)
        super().__init__(text if self.multiline else " ".join(text.split()))


class TrainingStopped(UsageError, RuntimeError):
    """Training gave up by its own rule (the loss kept spiking past the rollback budget): one line and
    exit 2 with what to change, not an "internal error"; the run dir keeps its newest good checkpoint."""
