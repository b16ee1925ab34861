"""What the config sections share: validation helpers (each error names the key and the fix) and
Section, the base that makes a resolved config read-only."""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from typing import Any

from trimtab.errors import ConfigError


class Section:
    """Base of every config dataclass. Built, it is a draft that may still be changed; resolved
    (trimtab.config.resolve), it is frozen: setting a field raises FrozenInstanceError, and code
    that needs a different config derives a new one (trimtab.config.derive)."""

    _frozen = False  # set on the instance by freeze(); not a field (asdict, replace and == ignore it)

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise dataclasses.FrozenInstanceError(
                f"the config is resolved and read-only (setting {type(self).__name__}.{name}); "
                "derive a changed copy with trimtab.config.derive(cfg, {section: {key: value}})"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self._frozen:
            raise dataclasses.FrozenInstanceError(f"the config is resolved and read-only (deleting {name})")
        object.__delattr__(self, name)

    @property
    def frozen(self) -> bool:
        """Whether this section belongs to a resolved config (read-only)."""
        return self._frozen


def freeze(obj: Any) -> Any:
    """Make a config dataclass and every section and list entry inside it read-only; returns it."""
    if isinstance(obj, Section):
        for f in dataclasses.fields(obj):
            freeze(getattr(obj, f.name))
        object.__setattr__(obj, "_frozen", True)
    elif isinstance(obj, list):
        for item in obj:
            freeze(item)
    return obj


def thawed(obj: Any) -> Any:
    """A changeable deep copy of a config section (a draft), for building another from it."""
    out = copy.deepcopy(obj)
    stack = [out]
    while stack:
        item = stack.pop()
        if isinstance(item, Section):
            object.__setattr__(item, "_frozen", False)
            stack += [getattr(item, f.name) for f in dataclasses.fields(item)]
        elif isinstance(item, list):
            stack += item
    return out


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' {message}")


def _positive(obj: Any, section: str, *names: str) -> None:
    for name in names:
        _check(getattr(obj, name) > 0, f"{section}.{name}", f"must be > 0 (got {getattr(obj, name)})")


def _finite(obj: Any, section: str, *names: str) -> None:
    """Numbers a training step multiplies by: an infinity (YAML's .inf, `--set KEY=inf`) would
    make its first update NaN, which the orchestrator would take for a broken model."""
    for name in names:
        value = getattr(obj, name)
        _check(math.isfinite(value), f"{section}.{name}", f"must be a finite number (got {value})")


def check_sections(data: dict[str, Any], cls: type, source: str, prefix: str = "") -> None:
    """Refuse a section the file wrote as a value (`train: 5`) before the layers merge: a flag or
    --set that touches the section would replace it with a mapping and the file's value would
    be dropped without a word."""
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        tp = hints.get(key)
        if tp is None or not dataclasses.is_dataclass(tp):
            continue  # an unknown key is named by from_dict, with the closest valid one
        if value is not None and not isinstance(value, dict):
            raise ConfigError(
                f"{source}: config key '{prefix}{key}' must be a section (mapping), got {value!r}; write it as "
                f"'{key}:' followed by indented 'key: value' lines, or remove it"
            )
        if value:
            check_sections(value, tp, source, f"{prefix}{key}.")


def leaves(section: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config's values by dotted key, in the config's order; a list (data.mix) is one value."""
    flat: dict[str, Any] = {}
    for k, v in section.items():
        if isinstance(v, dict):
            flat |= leaves(v, f"{prefix}{k}.")
        else:
            flat[prefix + k] = v
    return flat
