"""User-facing errors. The CLI prints these as one line and exits 2, never a traceback."""


class TrimtabError(Exception):
    """Base class for errors caused by user input (config, data, run directory)."""


class ConfigError(TrimtabError):
    """A config key, value or file is wrong; the message names the key and the fix."""


class DataError(TrimtabError):
    """A data source is missing, empty or malformed; the message names the file/line and the fix."""


class CheckpointError(TrimtabError):
    """No usable checkpoint, or a run directory that does not match the config."""


class RunStateError(TrimtabError):
    """A run directory is being trained by another process, or is not running when a command needs
    a live job; the message says who holds it, or when it was last alive."""
