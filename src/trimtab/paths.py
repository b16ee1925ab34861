"""Where trimtab keeps what it can rebuild (tokenizers, tokenized corpora, the measured CPU peak).

A module of its own so that training, hardware and benchmarks share it without importing each other
(how a small file is written whole: trimtab/rundir.py write_atomic).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$TRIMTAB_CACHE, else ~/.cache/trimtab."""
    return Path(os.environ.get("TRIMTAB_CACHE", Path.home() / ".cache" / "trimtab"))
