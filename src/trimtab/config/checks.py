"""Validation helpers shared by the config sections: each error names the key and the fix."""

from __future__ import annotations

from typing import Any

from trimtab.errors import ConfigError


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' {message}")


def _positive(obj: Any, section: str, *names: str) -> None:
    for name in names:
        _check(getattr(obj, name) > 0, f"{section}.{name}", f"must be > 0 (got {getattr(obj, name)})")
