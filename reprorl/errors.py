"""User-facing errors.

Anything raised as a `ReproRLError` is a problem with the user's input (a config key, a
file, a row, a field). The CLI prints its message as one line and exits non-zero, without
a traceback; every other exception is a bug and keeps its traceback.
"""


class ReproRLError(Exception):
    """An error in the user's input; the message names what is wrong and what was expected."""


class ConfigError(ReproRLError):
    """A bad config key, value or combination of values."""


class DataError(ReproRLError):
    """A bad dataset file, row or field."""


class CheckpointError(ReproRLError):
    """A checkpoint or model directory that cannot be read: missing, incomplete, or not
    matching its config.json."""


class DeterminismError(ReproRLError, RuntimeError):
    """Under full determinism, two parts disagree where the contract says their bits are
    equal (the engine's log-probs and the trainer's); the run stops at that step."""
