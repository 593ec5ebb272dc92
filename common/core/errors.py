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
