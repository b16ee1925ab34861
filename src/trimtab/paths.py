"""Where trimtab keeps what it can rebuild (tokenizers, tokenized corpora, the measured CPU peak),
and how a small file is written whole (write_atomic).

A module of its own so that training, hardware and benchmarks share it without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$TRIMTAB_CACHE, else ~/.cache/trimtab."""
    return Path(os.environ.get("TRIMTAB_CACHE", Path.home() / ".cache" / "trimtab"))


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temp file beside it and a rename: a reader never sees half a
    file, and a write that fails (a full disk) leaves the old file as it was and no temp file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
