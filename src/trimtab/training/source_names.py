"""A resumed mixture's source names: the ones the run trained under, from its checkpoint.

An unnamed source is named by its path (config/data.py source_name), and that name can change under
a run: trimtab named a source by its whole last path component (web.jsonl) before it took the stem
(web), and a source renamed on disk is named anew. A resume then logged its metrics (data/NAME/share,
data/NAME/epochs, val_loss/NAME) under the new name: each series split in two at the resume. The
checkpoint's loader state names each source it drew from (data/batches.py _part_state); a resume
keeps those names for the sources the config leaves unnamed. A name the config gives
(data.mix[i].name) is a person's choice and wins.
"""

from __future__ import annotations

import logging
from typing import Any

from trimtab.config.data import DataConfig

log = logging.getLogger(__name__)


def saved_names(state: dict[str, Any] | None) -> dict[int, list[str]]:
    """{phase: its sources' names} from a checkpoint's state, for the phase it was saved in (its loader's
    are the only names it holds); {} without a checkpoint or a mixture."""
    parts = ((state or {}).get("data") or {}).get("parts") or []
    names = [part.get("name") for part in parts]
    if len(names) < 2 or not all(isinstance(name, str) and name for name in names):
        return {}
    return {int(((state or {}).get("train") or {}).get("phase", 0)): names}


def kept_names(data: DataConfig, names: list[str], saved: list[str] | None, key: str) -> list[str]:
    """`names` (data.names) with each unnamed source's name the checkpoint's (`saved`), said once; `names`
    as they are where the sources differ in number (the loader refuses that resume: data/batches.py) or
    where the saved names would name two sources alike."""
    if not saved or len(saved) != len(names):
        return names
    kept = [name if part.name else old for name, old, part in zip(names, saved, data.sources)]
    if kept == names or len(set(kept)) < len(kept):
        return names
    log.info(
        "%s.mix: its unnamed sources keep the names this run trained under (%s; their paths name them %s now), "
        "so their metrics go on as one series; set %s.mix[i].name to choose a name",
        key,
        ", ".join(kept),
        ", ".join(names),
        key,
    )
    return kept
