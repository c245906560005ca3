"""User-facing error types. Each carries one line that names the key, file or value at fault.

The CLI turns these into a one-line message on stderr and exit code 2; anything else is a bug
and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: config, data, checkpoint path. Exit code 2, no traceback."""


class ConfigError(UserError, ValueError):
    """A config key with an unknown name, a wrong type or an out-of-range value."""


class DataError(UserError):
    """A dataset that is missing, empty or has the wrong schema."""


class CheckpointError(UserError):
    """A checkpoint path that does not exist, holds no checkpoint, or does not fit the model."""


class PlanningError(UserError):
    """No layout fits the model on the cluster; the message says what would be needed."""
