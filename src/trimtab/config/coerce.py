"""A layered config dict (YAML, --set, keyword overrides) into typed sections: an unknown key
named with the closest valid one, each value coerced to its field's type (YAML 1.1 reads 3e-4 and
1e3 as strings), a nested section merged over its field's own default."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from trimtab.errors import ConfigError


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def nested(path: list[str], value: Any) -> dict[str, Any]:
    out: Any = value
    for key in reversed(path):
        out = {key: out}
    return out


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.')}' must be a section (mapping)")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown config key '{prefix}{key}'{_unknown_hint(cls, hints, names, key, prefix)}")
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            value = merge(_default_of(cls, key), value)  # over the field's own default, not its class's
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def known_only(cls: type, data: dict[str, Any], prefix: str = "") -> tuple[dict[str, Any], list[str]]:
    """`data` without the keys `cls` has no field for, and those keys (dotted): a run's saved
    config.yaml holds every key of the trimtab that wrote it, so one a later version removed is no
    error of the person resuming it (from_dict's, for their own config). Sections recursed into."""
    if not dataclasses.is_dataclass(cls) or not isinstance(data, dict):
        return data, []
    hints, kept, dropped = typing.get_type_hints(cls), {}, []
    for key, value in data.items():
        if key not in hints:
            dropped.append(f"{prefix}{key}")
            continue
        kept[key], inner = known_only(hints[key], value, f"{prefix}{key}.")
        dropped += inner
    return kept, dropped


def _unknown_hint(cls: type, hints: dict[str, Any], names: list[str], key: Any, prefix: str) -> str:
    """The likeliest fix for an unknown key: the key of one of this section's own sections, written
    one level too shallow (`moe:` with `n_experts:` not indented under it, for which the closest
    name, model.norm_eps, was suggested), else the closest valid name, else all of them."""
    owners = [n for n in names if dataclasses.is_dataclass(hints[n]) and key in _field_names(hints[n])]
    if len(owners) == 1:  # several (orchestrator.enabled: every rule's): which one was meant is a guess
        return f"; did you mean '{prefix}{owners[0]}.{key}'? (in YAML: indented under '{owners[0]}:')"
    near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
    return f"; did you mean '{prefix}{near[0]}'?" if near else f"; valid keys: {', '.join(names)}"


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _default_of(cls: type, name: str) -> dict[str, Any]:
    """A section field's default as a mapping: finetune.optim starts at lr 3e-4 and warm-up 10, not
    OptimConfig's own, so `--set finetune.optim.lr=1e-4` keeps that warm-up (it reset it to 50)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return dataclasses.asdict(default) if dataclasses.is_dataclass(default) else {}


def _coerce(tp: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value or {}, key + ".")
    origin = typing.get_origin(tp)
    if origin is list:
        if isinstance(value, str):  # `--set faults=nan_loss@5` or one YAML string
            value = [value]
        if isinstance(value, list):
            return [_coerce(typing.get_args(tp)[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        for option in options:  # the first that takes the value (int before str: 200 stays a number)
            try:
                return _coerce(option, value, key)
            except ConfigError:
                pass
        names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
        raise ConfigError(f"config key '{key}' must be {names}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):  # YAML 1.1 reads 1e3 as a string: a whole number written so is one
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, bool):  # YAML reads `true` for a str field like optim.fused
            return "true" if value else "false"
        if isinstance(value, (str, int, float)):
            return str(value)
    name = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"config key '{key}' must be {name}, got {value!r}")
