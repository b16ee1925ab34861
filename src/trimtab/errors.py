"""User-facing errors. The CLI prints these as one line and exits 2, never a traceback."""

from typing import Any


class TrimtabError(Exception):
    """Base class for errors caused by user input (config, data, run directory)."""


class ConfigError(TrimtabError):
    """A config key, value or file is wrong; the message names the key and the fix."""


class SavedConfigError(ConfigError):
    """A run directory's own config.yaml is missing or unreadable; `problem` says what is wrong
    with it (the message adds the fix)."""

    def __init__(self, message: str, problem: str = ""):
        super().__init__(message)
        self.problem = problem or message


class DataError(TrimtabError):
    """A data source is missing, empty or malformed; the message names the file/line and the fix."""


class CheckpointError(TrimtabError):
    """No usable checkpoint, or a run directory that does not match the config."""


class NewerCheckpointError(CheckpointError):
    """A checkpoint written by a newer trimtab: not corrupt (never set aside, nor passed over for
    an older one, which would train the run back from there), only unreadable by this code."""


class RunStateError(TrimtabError):
    """A run directory is being trained by another process, or is not running when a command needs
    a live job; the message says who holds it, or when it was last alive."""


class RunFinished(Exception):
    """Not an error: `train` on a run that has already reached the length its config asks for
    trains nothing and changes nothing. The message says so; `summary` is the run's saved one.
    The CLI prints the message and exits 0 (RunPastLength: 2); trimtab.train() warns it and returns
    the summary."""

    def __init__(self, message: str, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.summary = summary


class RunPastLength(RunFinished, TrimtabError):
    """`train` asked for fewer steps than the run has already trained (its newest checkpoint is
    past the length asked for, or at it but saved on the way to a longer one): nothing is trained
    and nothing changes, as for RunFinished, but the run is not complete at the length asked for,
    so the CLI exits 2 (a usage error: a scheduler must not read success); trimtab.train() warns
    and returns the summary."""
