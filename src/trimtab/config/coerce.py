"""A layered config dict (YAML, --set, keyword overrides) into typed sections: an unknown key
named with the closest valid one, each value coerced to its field's type (YAML 1.1 reads 3e-4 and
1e3 as strings), a nested section merged over its field's own default."""

from __future__ import annotations

import dataclasses
import difflib
import os
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


def from_dict(cls: type, data: dict[str, Any], prefix: str = "", root: type | None = None) -> Any:
    """`cls` from `data`, each value coerced; `root`: the config's top section (`cls` at the top),
    searched for an unknown key's right place."""
    root = root or cls
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.')}' must be a section (mapping)")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            hint = _unknown_hint(cls, hints, names, key, prefix, root)
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            value = merge(_default_of(cls, key), value)  # over the field's own default, not its class's
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}", root)
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


def _unknown_hint(cls: type, hints: dict[str, Any], names: list[str], key: Any, prefix: str, root: type) -> str:
    """The likeliest fix for an unknown key: the key of one of this section's own sections, written
    one level too shallow (`moe:` with `n_experts:` not indented under it, for which the closest
    name, model.norm_eps, was suggested), else the same key in another section, or SECTION_KEY
    written for SECTION.KEY (train.checkpoint_every, for which train.log_every was suggested:
    checkpoint.every), else the closest valid name, else all of them."""
    owners = [n for n in names if dataclasses.is_dataclass(hints[n]) and key in _field_names(hints[n])]
    if len(owners) == 1:  # several (orchestrator.enabled: every rule's): which one was meant is a guess
        return f"; did you mean '{prefix}{owners[0]}.{key}'? (in YAML: indented under '{owners[0]}:')"
    near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
    elsewhere = _elsewhere(root, f"{prefix}{key}")
    if elsewhere:  # a close name here holding the key stays an option: model.seq_len may mean model.max_seq_len
        also = f" (or '{prefix}{near[0]}')" if near and str(key) in near[0] else ""
        return f"; did you mean '{elsewhere}'{also}? (it is in another section)"
    return f"; did you mean '{prefix}{near[0]}'?" if near else f"; valid keys: {', '.join(names)}"


def _elsewhere(root: type, path: str) -> str | None:
    """The key `path` (dotted) names in another section of `root`: its last part as a key there, or
    SECTION_KEY as SECTION.KEY; of several, the one sharing most of `path`'s sections, then the shortest,
    and None when that leaves a tie (train.enabled: every rule has one)."""
    *sections, key = path.split(".")
    found = [
        ".".join(where + [name])
        for where, fields in _sections(root, [])
        for name in fields
        if name == key or (where and key == f"{where[-1]}_{name}")
    ]

    def rank(found_path: str) -> tuple[int, int]:
        parts = found_path.split(".")
        return -len(os.path.commonprefix([sections, parts[:-1]])), len(parts)

    ranked = sorted(found, key=rank)
    if not ranked or (len(ranked) > 1 and rank(ranked[0]) == rank(ranked[1])):
        return None
    return ranked[0]


def _sections(cls: type, where: list[str]) -> list[tuple[list[str], list[str]]]:
    """Each section of `cls` (itself first): its dotted place and the names of its values, not of its
    sections (orchestrator.lr, a rule, is no place for train.lr's number)."""
    hints = typing.get_type_hints(cls)
    out = [(where, [name for name, tp in hints.items() if not dataclasses.is_dataclass(tp)])]
    for name, tp in hints.items():
        if dataclasses.is_dataclass(tp):
            out += _sections(tp, [*where, name])
    return out


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _default_of(cls: type, name: str) -> dict[str, Any]:
    """A section field's default as a mapping: finetune.optim starts at lr 3e-4 and warm-up 10, not
    OptimConfig's own, so `--set finetune.optim.lr=1e-4` keeps that warm-up (it reset it to 50)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return dataclasses.asdict(default) if dataclasses.is_dataclass(default) else {}


def _coerce(tp: Any, value: Any, key: str, root: type | None = None) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value or {}, key + ".", root)
    origin = typing.get_origin(tp)
    if origin is list:
        if isinstance(value, str):  # `--set faults=nan_loss@5` or one YAML string
            value = [value]
        if isinstance(value, list):
            return [_coerce(typing.get_args(tp)[0], v, f"{key}[{i}]", root) for i, v in enumerate(value)]
    elif origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        for option in options:  # the first that takes the value (int before str: 200 stays a number)
            try:
                return _coerce(option, value, key, root)
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
