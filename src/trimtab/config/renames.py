"""Older configs read by this version: keys renamed since (one name per thing) under their new
names, values spelled another way in their one spelling. The only place older names are read."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("trimtab.config")

# Keys renamed (one name per thing): an older config still loads; a user's gets a warning.
RENAMED = {
    ("data", "vocab_size"): "bpe_vocab_size",
    ("finetune", "data", "vocab_size"): "bpe_vocab_size",
    ("model", "moe", "aux_loss_coef"): "balance_coef",
}

# Values spelled another way, read as the one name the code knows (no warning: YAML's doing).
RESPELLED = {
    ("orchestrator", "mode"): {False: "off", "false": "off"},  # YAML 1.1 reads a bare `off` as false
    ("resilience", "watchdog"): {False: "off", "false": "off", True: "on", "true": "on"},  # and `on` as true
    ("data", "garbage_filter"): {False: "off", "false": "off"},  # the `garbage` decision tells a person to set it off
    ("finetune", "data", "garbage_filter"): {False: "off", "false": "off"},
    # a boolean before selective checkpointing existed: true was a whole block's recompute
    ("train", "activation_checkpointing"): {False: "off", "false": "off", True: "full", "true": "full"},
}


def upgrade(data: dict[str, Any], source: str = "") -> dict[str, Any]:
    """`data` with renamed keys under their new names (with `source`, a warning for each) and
    respelled values in their one spelling: the only place older names are read."""
    for path, new in RENAMED.items():
        node = _parent(data, path)
        if isinstance(node, dict) and path[-1] in node:
            old_key, new_key = ".".join(path), ".".join([*path[:-1], new])
            if source:
                log.warning("%s: config key '%s' is now '%s'; rename it there", source, old_key, new_key)
            node.setdefault(new, node.pop(path[-1]))
    for path, spellings in RESPELLED.items():
        node = _parent(data, path)
        if isinstance(node, dict) and path[-1] in node:
            value = node[path[-1]]
            if isinstance(value, (bool, str)) and value in spellings:
                node[path[-1]] = spellings[value]
    return data


def _parent(data: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = data
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    return node
