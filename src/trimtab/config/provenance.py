"""Who set each key of a run config in the session that built it: its --set items, its YAML file, a
caller's overrides (the CLI's flags, the API's keywords); every other key is the preset's or this
trimtab's default. A RunConfig keeps values, not who set them, so a resume's config-change decision
(training/changes.py) labelled a person's explicit `--set optim.weight_decay=0.1` "this version's
default" because 0.1 is the default.

The origins ride on the resolved config beside its fields, not as one (to_dict, == and config.yaml's
keys are as before), set by load_config and kept by derive. config.yaml carries them as its first
line, a YAML comment (HEADER), so the next session tells an earlier session's setting it did not
repeat from a default that moved between versions. A config.yaml without the line (an older
trimtab's) reads as before, its origins unknown; an older trimtab reads this one's (a comment).

A run's own config.yaml given back as the config file (`trimtab train RUN/config.yaml --out RUN`) is
not a person setting its every key: its keys keep the origins its line gives, one whose value differs
from the layer under the file (the preset's and the defaults') is the file's, a person's edit of a
copy (an `optim.lr` edited in a copy was left out of the next line, as nobody's), and the others are
the preset's or the defaults' (every key was said to be the file's: a 28 KB first line, and each
later change called that file's setting). A subcommand's own settings (`trimtab rl` turning the
likelihood rules off) are said to be the subcommand's (by_command), not a person's flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trimtab.config.checks import leaves

SET = "--set"
OVERRIDE = "a flag or an API override"
FOR_ITS_RUNS = " for its runs"  # a subcommand's own setting: `trimtab rl for its runs` (by_command)
HEADER = "# who set each key the preset and the defaults did not: "  # + their origins as one JSON line
VALUES = "# the values they set then: "  # + those keys' values as one JSON line (header's second line)
OLD_HEADERS = ("# keys set by a person in the session that wrote this file: ",)  # read as HEADER


def origins(
    user: dict[str, Any],
    path: Any,
    layers: list[tuple[str, dict[str, Any]]],
    saved: dict[str, str] | None = None,
    below: dict[str, Any] | None = None,
    then: dict[str, Any] | None = None,
) -> dict[str, str]:
    """Each dotted key a layer above the preset set (load_config's order, the later winning) -> where
    it was set: `user` (the YAML file at `path`), then each of `layers` (origin, sections of keys).
    `saved`: the file's own origins where it is a run's config.yaml (saved_sources): the keys it names
    keep where it says unless their value is no longer the one it set (`then`: saved_values; a person's
    edit, even back to the preset's value); of the others (trimtab writes every key), those a person edited
    (edited, against `below`: the preset's and the defaults' resolved leaves) are the file's."""
    file = f"the config file {path}"
    if saved is None:
        found = dict.fromkeys(leaves(user), file)
    else:
        values, then = leaves(user), then or {}
        kept = {key for key in saved if key not in then or then[key] == values.get(key)}
        found = {key: saved[key] if key in kept else file for key in edited(user, saved, below or {})}
    for origin, keys in layers:
        found |= {key: origin for key in leaves(keys)}
    return found


# The keys a run's config.yaml holds from its data where the layers under leave them to it (setup.complete):
# model.vocab_size 0 is the tokenizer's vocabulary, train.max_steps auto the planner's length: the run's, not an edit
FILLED = {"model.vocab_size": 0, "train.max_steps": "auto"}


def edited(user: dict[str, Any], saved: dict[str, str], below: dict[str, Any]) -> list[str]:
    """The keys of a run's config.yaml (`user`) that it set: those its line names (`saved`), and those whose
    value is not the layer's under it (`below`), a person's edit of it, but for the values a run fills (FILLED)."""
    missing = object()  # a key the layer under lacks (a section's own): an edit
    return [
        key
        for key, value in leaves(user).items()
        if key in saved or (value != below.get(key, missing) and below.get(key, missing) != FILLED.get(key, missing))
    ]


def command_origin(command: str) -> str:
    """The origin of the settings a subcommand fixes for its runs (`trimtab rl`: the rl section on)."""
    return command + FOR_ITS_RUNS


def by_command(origin: str) -> bool:
    """Whether `origin` is a subcommand's own setting (command_origin), not a person's."""
    return origin.endswith(FOR_ITS_RUNS)


def sources(cfg: Any) -> dict[str, str]:
    """The keys this session's config set, and where (origins); {} for a config built another way
    (by hand, from a saved config.yaml): nothing known to be a person's."""
    return dict(getattr(cfg, "_sources", None) or {})


def with_sources(cfg: Any, found: dict[str, str]) -> Any:
    """`cfg` carrying `found` as its origins (not a field: a resolved config's fields stay frozen)."""
    object.__setattr__(cfg, "_sources", dict(found))
    return cfg


def header(cfg: Any) -> str:
    """config.yaml's first two lines, YAML comments: the keys `cfg`'s session set, and their values then
    (a copy's edit of one of them is then told from the value its line's origin set: origins)."""
    values = leaves(cfg.to_dict())
    then = {key: values[key] for key in sources(cfg) if key in values}
    return HEADER + json.dumps(sources(cfg), sort_keys=True) + "\n" + VALUES + json.dumps(then, sort_keys=True) + "\n"


def saved_sources(config_yaml: Path) -> dict[str, str] | None:
    """The keys the session that wrote `config_yaml` set (its HEADER line); None where it has none
    (an older trimtab wrote it, a hand edit dropped it) or cannot be read: unknown."""
    found = _comment(config_yaml, 0, (HEADER, *OLD_HEADERS))
    return {str(k): str(v) for k, v in found.items()} if found is not None else None


def saved_values(config_yaml: Path) -> dict[str, Any] | None:
    """The values of the keys its HEADER line names, as the session that wrote `config_yaml` set them (its
    VALUES line); None where it has none (an older trimtab's, a hand edit dropped it): unknown."""
    return _comment(config_yaml, 1, (VALUES,))


def _comment(config_yaml: Path, index: int, prefixes: tuple[str, ...]) -> dict[str, Any] | None:
    """The JSON object of config.yaml's line `index`, a comment starting with one of `prefixes`; None where
    the line is not one, or cannot be read."""
    try:
        with open(config_yaml, encoding="utf-8-sig") as f:
            lines = [f.readline() for _ in range(index + 1)]
    except (OSError, UnicodeDecodeError):
        return None
    prefix = next((p for p in prefixes if lines[index].startswith(p)), None)
    if prefix is None:
        return None
    try:
        found = json.loads(lines[index][len(prefix) :])
    except ValueError:
        return None
    return found if isinstance(found, dict) else None
