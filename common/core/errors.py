"""User-facing errors.

Every problem a user can fix (bad config, bad data, missing file, unreachable server)
raises PipelineError with a message that says what went wrong, the offending value and
what to do. The stage CLIs print it as one line and exit with status 2, no traceback.
"""


class PipelineError(Exception):
    """An error the user can act on; printed without a traceback."""


class ConfigError(PipelineError):
    """Invalid configuration: unknown key, wrong type, bad value, missing path."""


class DataError(PipelineError):
    """Invalid input data: malformed file, wrong fields, mismatched tokenizer."""


def printable(text: str) -> str:
    """text with every character a terminal would act on written as an escape (ESC, BEL, CR, bidi
    overrides, ...): error lines quote user data (sample ids, file contents), which must not set the
    terminal title or clear the screen. Newlines stay: some messages quote a log's last lines."""
    return "".join(c if c.isprintable() or c == "\n" else c.encode("unicode_escape").decode("ascii") for c in text)
