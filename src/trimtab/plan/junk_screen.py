"""`trimtab plan --data` on raw text: the junk screen training runs on it (data/packing.py _screen, data/junk.py),
on a sample (data/junk_sample.py) so the plan stays fast. A prepared directory's is its manifest's (chinchilla.py);
raw text had none, so a corpus of random characters was planned at its full 49,000 tokens, where training refuses
it, and a corpus 75% word salad by bytes was planned whole, where training leaves the salad out."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trimtab.config import RunConfig
from trimtab.errors import ConfigError

log = logging.getLogger(__name__)
SHOWN = 3  # junk documents named


@dataclass(frozen=True)
class Screened:
    """The share of the data's bytes judged junk (the sample's: an estimate), how many of each kind, and whether
    training leaves those documents out of its tokens (data.garbage_filter=drop, or warn with the orchestrator in
    auto mode: data/held_out.py screened_out)."""

    share: float
    kinds: str
    left_out: bool


def screen(cfg: RunConfig, texts: Sequence[str], names: Sequence[str], path: str, key: str) -> Screened | None:
    """The junk screen of the documents `texts` (named `names`) read from `path`; None with data.garbage_filter=off or
    none judged junk. Every document junk, judged whole, is refused as training refuses it (a source of junk alone:
    packing.JunkSource); in a sample, said, as the sample cannot tell every document."""
    from trimtab.data.held_out import screened_out
    from trimtab.data.junk_sample import SAMPLE_CHARS, sampled_kinds

    if cfg.data.garbage_filter == "off" or not texts:
        return None
    found = sampled_kinds(texts)
    junky = np.array([v is not None for v in found.verdicts], dtype=bool)
    if not junky.any():
        return None
    kinds = ", ".join(f"{n:,} {kind}" for kind, n in sorted(Counter(v.kind for v in found.verdicts if v).items()))
    if found.whole and junky.all():
        raise ConfigError(
            f"{key} {path}: every one of its {len(texts):,} documents is junk ({kinds}; data/junk.py): training "
            "refuses it alone and leaves it out of a mixture, so it has no training tokens; plan on the data that "
            "trains, or set data.garbage_filter=off to count it as it is"
        )
    n_bytes = np.array([len(texts[i].encode()) for i in found.which], dtype=np.float64)
    share = float(n_bytes[junky].sum() / max(n_bytes.sum(), 1.0))
    shown = [f"{names[i]} ({v})" for i, v in zip(found.which, found.verdicts) if v][:SHOWN]
    where = (
        "of its documents"
        if found.whole
        else f"of a sample of {len(found.which):,} of its {len(texts):,} documents (their first {SAMPLE_CHARS:,} "
        "characters at most: an estimate)"
    )
    said = (
        f"{int(junky.sum()):,} {where} ({share:.1%} of the bytes) are junk ({kinds}; data/junk.py, as training judges "
        f"them): {', '.join(shown)}"
    )
    left_out = cfg.data.garbage_filter == "drop" or screened_out(cfg.data, cfg)
    # a sample all junk: training refuses the source if every document is, which the sample cannot tell
    alone = "every document sampled is junk; training refuses a source of junk alone: " if junky.all() else ""
    log.warning("%s %s: %s%s", key, path, alone, said)
    return Screened(share, kinds, left_out)
