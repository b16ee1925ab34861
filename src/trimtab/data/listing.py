"""The files of a data source, listed: a file, a directory walked in a fixed order, a glob or a list
of these; what a walk leaves out (broken symlinks, directories it cannot read, a link loop) said in
one line; and the same bytes under a second name told apart, so that the in-memory reader reads
them once, as `trimtab data prepare` prepares them once (by their sha256)."""

from __future__ import annotations

import functools
import glob
import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from trimtab.errors import DataError
from trimtab.rundir import CONFIG, METRICS_FILE

logger = logging.getLogger(__name__)

PREPARED_MANIFEST = "trimtab-data.json"  # marks a directory `trimtab data prepare` wrote
GLOB_CHARS = "*?["
SHOWN = 3  # entries named in a one-line summary
BUILTIN = "builtin"  # the default corpus: the standard library's .py files
# site-packages holds third-party code that differs between machines; the corpus must not.
EXCLUDED_DIRS = {"site-packages", "dist-packages"}


def source_files(source: str | list[str], key: str, exclude: Iterable[Path] = ()) -> list[tuple[Path, bool]]:
    """The files of a source: a file, a directory (its files, recursively, hidden ones left out),
    a glob (`**` recurses) or a list of these, in a fixed order; each with whether it was named
    on its own (a named file must be readable; a directory's unreadable files are skipped).
    Nothing under `exclude` (prepare's --out) is listed."""
    out: list[tuple[Path, bool]] = []
    skip = {os.path.realpath(p) for p in exclude}
    for item in [source] if isinstance(source, str) else source:
        if item == BUILTIN:  # as training reads it (data/sources.py)
            out += [(p, False) for p in builtin_files()[1]]
            continue
        if item.startswith(f"{BUILTIN}:"):
            raise DataError(
                f"{key} '{item}' is made at start, not read from files: there is nothing to prepare; "
                f"train on it as it is (--set data.source={item})"
            )
        if any(c in item for c in GLOB_CHARS):
            matches = sorted(p for p in glob.glob(item, recursive=True) if Path(p).is_file())
            matches = [p for p in matches if not _inside(os.path.realpath(p), skip)]
            if not matches:
                raise DataError(f"{key} '{item}' matches no file; check the pattern")
            out += [(Path(p), False) for p in matches]
            continue
        path = Path(item)
        if not path.exists():
            raise DataError(f"{key} '{item}' does not exist; check the path")
        if path.is_file():
            out.append((path, True))
            continue
        if _lost_manifest(path):  # its tokenizer.json was trained on as text, its shards skipped as binary
            raise DataError(
                f"{key} '{item}' holds shards `trimtab data prepare` wrote, but not its {PREPARED_MANIFEST}, which "
                "lists them (deleted, or not copied with them); run `trimtab data prepare` on the same sources "
                f"with --out {item} again to rebuild it, or point {key} at the raw text"
            )
        files = _walk(path, key, skip)
        out += [(p, False) for p in sorted(files, key=lambda p: p.relative_to(path).as_posix())]
    return out


def builtin_files() -> tuple[Path, list[Path]]:
    """The stdlib's .py files in a fixed order that interleaves packages (hash of the relative path),
    so that a small max_bytes still samples the whole tree rather than its first directories."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return root, [root / name for name in _stdlib_names(root)]


@functools.cache  # the stdlib does not change under a running process; walking it cost every run 0.04 s of CPU
def _stdlib_names(root: Path) -> tuple[str, ...]:
    """The relative posix paths of the .py files under root, in builtin_files' order."""
    names = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]  # prune: site-packages can be huge
        rel = Path(folder).relative_to(root)
        names += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    names.sort(key=lambda name: hashlib.blake2b(name.encode(), digest_size=8).digest())
    return tuple(names)


def _inside(real: str, dirs: set[str]) -> bool:
    return any(real == d or real.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)


def _walk(root: Path, key: str, skip: set[str]) -> list[Path]:
    """The files under root, hidden ones left out; symlinked directories are followed, each real
    directory once (a link loop ends there). trimtab's own outputs are not text to train on: a
    prepared dataset or a run directory inside the tree is skipped, with a warning. What the walk
    cannot read (a broken symlink, a directory without permission) or reads once already (a link
    loop, a second link to a directory) is said in one line."""
    seen, files, passed = set(skip), [], []
    through: dict[str, Path] = {}  # a directory's real path -> the link it was read through

    def unreadable(exc: OSError) -> None:
        passed.append(f"{exc.filename} ({exc.strerror or exc})")

    for folder, dirs, names in os.walk(root, followlinks=True, onerror=unreadable):
        seen.add(os.path.realpath(folder))
        kept = []
        for name in sorted(dirs):
            sub = Path(folder) / name
            real = os.path.realpath(sub)
            if name.startswith(".") or _inside(real, skip):
                continue
            if real in seen:
                if sub.is_symlink() or real not in through:
                    passed.append(f"{sub} (a link to {real}, read already)")
                else:  # the real directory, met after a link to it
                    passed.append(f"{sub} (the directory read already through the link {through[real]})")
                continue
            if why := _own_output(sub):
                _warn_skipped(key, str(root), str(sub), why)
                continue
            seen.add(real)
            if sub.is_symlink():
                through[real] = sub
            kept.append(name)
        dirs[:] = kept
        for name in sorted(names):
            path = Path(folder) / name
            if name.startswith("."):
                continue
            if path.is_file():
                files.append(path)
            else:  # a broken symlink or a link loop: is_file follows the link
                passed.append(f"{path} ({'a broken symlink' if path.is_symlink() else 'not a regular file'})")
    if passed:
        _warn_passed(key, str(root), tuple(passed))
    return files


def _own_output(folder: Path) -> str:
    """Why `folder` is trimtab's own output, not a corpus ('' when it is not)."""
    if (folder / PREPARED_MANIFEST).is_file():
        return f"prepared data (it holds {PREPARED_MANIFEST}); name it as a source of its own to train on it"
    if _lost_manifest(folder):
        return f"prepared data whose {PREPARED_MANIFEST} is missing (its shards are token ids, not text)"
    if (folder / CONFIG).is_file() and ((folder / "checkpoints").is_dir() or (folder / METRICS_FILE).is_file()):
        return f"a training run's directory (it holds {CONFIG} and its checkpoints or {METRICS_FILE})"
    return ""


def _lost_manifest(folder: Path) -> bool:
    """A prepared directory without its manifest: shards/ holding a shard's index, no manifest."""
    shards = folder / "shards"
    return not (folder / PREPARED_MANIFEST).is_file() and shards.is_dir() and any(shards.glob("*.idx.npz"))


@functools.cache  # the files of a source are listed several times in a run: warn once
def _warn_skipped(key: str, source: str, folder: str, why: str) -> None:
    logger.warning("%s '%s': skipped %s, %s", key, source, folder, why)


@functools.cache
def _warn_passed(key: str, source: str, passed: tuple[str, ...]) -> None:
    logger.warning("%s '%s': left out %s", key, source, shown(passed, "entr", "y", "ies"))


def shown(items: tuple[str, ...] | list[str], stem: str, one: str, many: str) -> str:
    """'N <stem><one|many>: the first SHOWN, ...' for a one-line summary."""
    more = ", ..." if len(items) > SHOWN else ""
    return f"{len(items):,} {stem}{one if len(items) == 1 else many}: {', '.join(items[:SHOWN])}{more}"


class SameBytes:
    """Files with the bytes of one met before them. A file is hashed only once another of its size
    comes, so a corpus of distinct sizes is never hashed (the in-memory reader reads as far as
    data.max_bytes only), and each is hashed once, however many share its size."""

    def __init__(self) -> None:
        self._alone: dict[int, Path | None] = {}  # size -> the one file met of it, not hashed (None: hashed)
        self._first: dict[tuple[int, str], Path] = {}  # (size, sha256) -> the first file met with them

    def earlier(self, path: Path) -> Path | None:
        """The first file met with path's bytes (None: there is none; path is remembered)."""
        size = path.stat().st_size
        if size not in self._alone:
            self._alone[size] = path
            return None
        if (alone := self._alone[size]) is not None:
            self._first[(size, sha256_file(alone))] = alone
            self._alone[size] = None
        key = (size, sha256_file(path))
        if key in self._first:
            return self._first[key]
        self._first[key] = path
        return None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()
