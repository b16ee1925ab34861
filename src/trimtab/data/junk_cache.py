"""A source's junk verdicts (junk.kinds), cached in the run's cache directory by the documents' text.

Every run on the same corpus (the built-in one, each test's slice of it) judged it again at start-up:
0.06-0.09 s of CPU a run on 2 cores (0.3 s under cProfile). The key holds the texts and the
source code and the thresholds of the modules that decide a verdict, so an edit to a rule or a threshold
(in the file or set at run time) is a miss, not a stale verdict; the tokens' cache
(packing.tokenize_documents) is written and read the same way.

Each corpus slice and edit of a rule is an entry of its own (a test suite's slices, a developer's
edits: hundreds over weeks), so the cache keeps the KEPT entries used last (a hit touches its entry's time)
and removes the rest as it writes a new one.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trimtab.data import bigrams, dumps, junk, mojibake, quality, repeats, word_order
from trimtab.data.tokenizer import cache_not_written

logger = logging.getLogger(__name__)
# entries kept (the ones used last): more than a run's sources and a test suite's corpora use in a session; an
# entry is 40 bytes a document (the built-in corpus's: 0.7 MB), so tens of MB at most on corpora of its size
KEPT = 64


def kinds(texts: Sequence[str], cache_dir: Path | None) -> list[junk.Verdict | None]:
    """junk.kinds(texts), read from cache_dir when it was judged before (None: no cache)."""
    if cache_dir is None:
        return junk.kinds(texts)
    path = Path(cache_dir) / f"junk-{_key(texts)}.npy"
    if path.is_file() and (cached := _load(path, len(texts))) is not None:
        _touch(path)
        return cached
    verdicts = junk.kinds(texts)
    _save(path, verdicts)
    _prune(path.parent)
    return verdicts


def _entries(folder: Path) -> list[tuple[float, Path]]:
    """(last used, path) of the cache's entries, not another process's entry being written (its .tmp name)."""
    found = []
    for path in folder.glob("junk-*.npy"):
        try:
            found.append((path.stat().st_mtime, path))
        except OSError:  # removed meanwhile by another run's prune
            continue
    return [(used, path) for used, path in found if ".tmp" not in path.name]


def _prune(folder: Path) -> None:
    """All but the KEPT entries used last removed (a read-only or shared cache that refuses: left as it is)."""
    for _, path in sorted(_entries(folder), reverse=True)[KEPT:]:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            return


def _touch(path: Path) -> None:
    """A hit: the entry's time made now, so that pruning keeps what is used."""
    try:
        os.utime(path)
    except OSError:  # a read-only cache: read, never pruned by this run
        pass


@functools.cache
def _code() -> bytes:
    """The source of the modules whose rules and thresholds decide a verdict."""
    return b"".join(
        Path(module.__file__).read_bytes() for module in (junk, bigrams, quality, dumps, repeats, mojibake, word_order)
    )


def _settings() -> bytes:
    """The rules' thresholds as they stand now: a module constant set at run time (a test's monkeypatch, a
    person's experiment) is a miss too, not a verdict judged under another value."""
    found = [
        (module.__name__, name, value)
        for module in (junk, bigrams, quality, dumps, repeats, mojibake, word_order)
        for name, value in sorted(vars(module).items())
        if name.isupper() and isinstance(value, (int, float, str, tuple))
    ]
    return repr(found).encode()


def _key(texts: Sequence[str]) -> str:
    h = hashlib.sha256(_code())
    h.update(_settings())
    for text in texts:
        data = text.encode()
        h.update(b"%d:" % len(data))
        h.update(data)
    return h.hexdigest()[:20]


def _save(path: Path, verdicts: list[junk.Verdict | None]) -> None:
    rows = np.array([junk.Verdict.row(v) for v in verdicts], dtype=np.float64).reshape(len(verdicts), 5)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npy")
    try:
        np.save(tmp, rows)
        os.replace(tmp, path)  # atomic: a reader sees the whole entry or none
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        cache_not_written(path, exc)


def _load(path: Path, n: int) -> list[junk.Verdict | None] | None:
    """The cached verdicts; None (a miss, judged again and written over) when the entry cannot be read."""
    try:
        rows = np.load(path, allow_pickle=False)
    except (OSError, EOFError, ValueError) as exc:
        logger.warning("junk verdict cache %s cannot be read (%s); judging the documents again", path, exc)
        return None
    if rows.shape != (n, 5):
        logger.warning("junk verdict cache %s is %s, not (%d, 5); judging the documents again", path, rows.shape, n)
        return None
    return [junk.Verdict.of_row(*row) for row in rows.tolist()]
