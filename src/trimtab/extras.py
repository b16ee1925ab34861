"""The optional packages some commands need, and the pyproject.toml extra that installs each.

A command that imports one lazily asks here, so a missing package is one line naming the command,
the package and the install command, never an ImportError traceback. trimtab is installed from
its checkout (`pip install -e .`): `pip install trimtab[data]` would look for it on PyPI.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from trimtab.errors import ConfigError, TrimtabError

# import name -> (the package to name, the extra that installs it); every extra is also in [dev]
EXTRAS: dict[str, tuple[str, str]] = {
    "transformers": ("transformers", "hf"),
    "datasets": ("datasets", "data"),
    "pyarrow": ("pyarrow", "data"),
    "zstandard": ("zstandard", "data"),
    "lm_eval": ("lm-evaluation-harness", "eval"),
    "mlflow": ("mlflow", "track"),
    "wandb": ("wandb", "track"),
    "prometheus_client": ("prometheus-client", "track"),
    "torchft": ("torchft", "ft"),
    "math_verify": ("math-verify", "rl"),
    "torchao": ("torchao", "fp8"),
    "fsspec": ("fsspec", "storage"),
    "s3fs": ("s3fs", "storage"),
}


def install_command(module: str) -> str:
    """The pip command that installs an optional `module`: its extra, through the constraints."""
    return f"pip install -c constraints.txt -e '.[{EXTRAS[module][1]}]'"


def missing(module: str, what: str) -> str:
    """'WHAT needs PACKAGE: pip install ... -e '.[EXTRA]'' for an optional `module`."""
    return f"{what} needs {EXTRAS[module][0]}: {install_command(module)}"


def require(module: str, what: str, error: type[TrimtabError] = ConfigError) -> ModuleType:
    """Import an optional `module` for `what` (a command, a key, a file), or raise `error` saying
    which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise error(missing(module, what)) from None


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (mlflow takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules as None (a test's way of hiding it)
        return False
