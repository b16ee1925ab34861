"""Reading a prepared directory (data/prepare.py writes it): rows read from the token shards on
demand (pread), so a run's memory does not grow with the corpus, cut from the stream of all shards.

Shapes: K shards, D documents, S masked spans, L = seq_len.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from trimtab.data import junk, quality
from trimtab.data.listing import PREPARED_MANIFEST, sha256_file
from trimtab.errors import DataError
from trimtab.rundir import write_json

MANIFEST_VERSION = 1
OPEN_SHARDS = 64  # shard files kept open at once
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: multiplicative hashing (Knuth)
# what every reader of a manifest takes as given (prepare writes a manifest once they are set)
MANIFEST_KEYS = {"files": list, "shards": list, "tokenizer": dict, "dtype": str}
_REPREPARE = "prepare the sources into a new directory"


def read_manifest(path: Path) -> dict[str, Any] | None:
    file = Path(path) / PREPARED_MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
    except ValueError as exc:
        raise DataError(f"{file}: unreadable ({exc}); prepare the sources into a new directory") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{file}: a JSON {type(manifest).__name__}, not a manifest; {_REPREPARE}")
    if manifest.get("version") != MANIFEST_VERSION:
        raise DataError(f"{file}: manifest version {manifest.get('version')}, this trimtab reads {MANIFEST_VERSION}")
    # an edited or foreign manifest: said here, not as a KeyError where a key is first read
    if bad := [key for key, kind in MANIFEST_KEYS.items() if not isinstance(manifest.get(key), kind)]:
        raise DataError(
            f"{file}: {', '.join(map(repr, bad))} missing or not as `trimtab data prepare` writes it (an edited "
            f"manifest, or another tool's); {_REPREPARE}"
        )
    return manifest


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    write_json(Path(path) / PREPARED_MANIFEST, manifest)  # a reader never sees half a manifest


def rows_digest(head: str, *arrays: np.ndarray) -> str:
    """A short digest of `head` and the arrays' values (each as its shape and bytes): what a
    split's rows hold, for a resumed loader to check (packing.Rows, ShardedRows)."""
    digest = hashlib.sha256(head.encode())
    for a in arrays:
        a = np.ascontiguousarray(a)
        digest.update(str(a.shape).encode())
        digest.update(a.view(np.uint8))
    return digest.hexdigest()[:16]


class PreparedData:
    """A prepared directory, opened: shards read on demand, their index in memory (D + S
    entries, small beside the tokens)."""

    def __init__(self, path: str | Path, key: str = "data.source", verify: bool = True) -> None:
        self.path = Path(path)
        manifest = read_manifest(self.path)
        if manifest is None:
            raise DataError(f"{key} '{path}' is not a prepared directory (no {PREPARED_MANIFEST})")
        if bad := self.corrupt_shards(self.path, manifest, full=verify):
            self._refuse(key, *next(iter(bad.items())))
        self.manifest, self.key = manifest, key
        self.tokenizer_sha = manifest["tokenizer"]["sha256"]
        self.vocab_size = manifest["tokenizer"].get("vocab_size")  # directories from before it was kept: None
        self.files = [f["path"] for f in manifest["files"]]
        self.dtype = np.dtype(manifest["dtype"])
        self.shards, self.offsets, self.where, masked, flagged = [], [], [], [], []
        self._fds: OrderedDict[int, int] = OrderedDict()  # shard -> open file descriptor, newest last
        self.base = [0]  # global token position of each shard's first token
        for shard in manifest["shards"]:
            folder = self.path / "shards"
            self.shards.append(folder / f"{shard['name']}.bin")
            try:
                with np.load(folder / f"{shard['name']}.idx.npz") as idx:
                    self.offsets.append(idx["offsets"] + self.base[-1])
                    self.where.append(idx["where"])
                    masked.append(idx["masked"] + self.base[-1])
                    # shards prepared before the screen's documents were recorded have none
                    flagged.append(idx["garbage"] if "garbage" in idx.files else np.zeros((0, 2)))
            except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as exc:
                # its sha256 is checked only with data.verify_shards; its size never is (it varies)
                why = f"has an index that cannot be read ({folder / shard['name']}.idx.npz: {exc})"
                self._refuse(key, shard["name"], why)
            self.base.append(self.base[-1] + shard["tokens"])
        self.n_tokens = self.base[-1]
        self.doc_base = np.concatenate([[0], np.cumsum([len(o) - 1 for o in self.offsets])]).astype(np.int64)
        self.masked = np.concatenate(masked) if masked else np.zeros((0, 2), dtype=np.int64)  # [S, 2] global
        self.garbage = self._garbage(flagged)
        self.why = self._why(flagged)

    def _refuse(self, key: str, name: str, why: str) -> NoReturn:
        raise DataError(
            f"{key} '{self.path}': shard {name} {why}; run `trimtab data prepare` on the same sources into "
            f"'{self.path}' again to rebuild it (the other shards are kept)"
        )

    def _garbage(self, flagged: list[np.ndarray]) -> np.ndarray:
        """float [D]: a document the screen flagged and kept (--garbage-filter warn): its bytes per
        token over the sources' median (the manifest's scale; null, too few documents for one: its bytes per
        token, flagged as junk by itself, data/junk.py); NaN for the others."""
        out = np.full(self.n_docs, np.nan)
        median = (self.manifest.get("garbage") or {}).get("median", 1.0)
        for k, found in enumerate(flagged):
            if len(found):
                out[self.doc_base[k] + found[:, 0].astype(np.int64)] = found[:, 1] / median
        return out

    def _why(self, flagged: list[np.ndarray]) -> dict[int, str]:
        """{document: what data/junk.py found in it}, for flagged documents that pack like text (its
        kind, score and bar; a dump's byte range); shards prepared before it was recorded (2 columns) have none,
        before the range was (5 columns) no range."""
        out = {}
        for k, found in enumerate(flagged):
            if found.shape[1] == 5:
                found = np.pad(found, ((0, 0), (0, 2)), constant_values=np.nan)
            for doc, code, score, bar, start, end in found[:, [0, 2, 3, 4, 5, 6]] if found.shape[1] >= 7 else ():
                if verdict := junk.Verdict.of_row(code, score, bar, start, end):
                    out[int(self.doc_base[k] + doc)] = str(verdict)
        return out

    @staticmethod
    def corrupt_shards(path: Path, manifest: dict[str, Any], full: bool = True) -> dict[str, str]:
        """{shard: what is wrong} for shards missing, of the wrong size or (full) failing their sha256."""
        bad = {}
        itemsize = np.dtype(manifest.get("dtype") or "uint16").itemsize
        for shard in manifest["shards"]:
            name, folder = shard["name"], Path(path) / "shards"
            files = {"bin": folder / f"{name}.bin", "idx": folder / f"{name}.idx.npz"}
            if missing := [str(f) for f in files.values() if not f.is_file()]:
                bad[name] = f"is missing {', '.join(missing)}"
            elif files["bin"].stat().st_size != shard["tokens"] * itemsize:
                bad[name] = f"has {files['bin'].stat().st_size} bytes, not {shard['tokens'] * itemsize}"
            elif full and (broken := [k for k, f in files.items() if sha256_file(f) != shard["sha256"][k]]):
                bad[name] = f"fails its sha256 check ({', '.join(str(files[k]) for k in broken)}: the file is corrupt)"
        return bad

    @property
    def n_docs(self) -> int:
        return int(self.doc_base[-1])

    def doc_bounds(self) -> np.ndarray:
        """int64 [D + 1]: global token offset of each document's start, and the end."""
        return np.concatenate([o[:-1] for o in self.offsets] + [[self.n_tokens]]).astype(np.int64)

    def read(self, start: int, end: int) -> np.ndarray:
        """Global tokens [start, end) as int64, read across shard boundaries."""
        out = np.empty(end - start, dtype=np.int64)
        k = int(np.searchsorted(self.base, start, side="right")) - 1
        at, size = start, self.dtype.itemsize
        while at < end:
            stop = min(end, self.base[k + 1])
            data = os.pread(self._fd(k), (stop - at) * size, (at - self.base[k]) * size)
            out[at - start : stop - start] = self._checked(k, data, stop - at)
            at, k = stop, k + 1
        return out

    def _checked(self, k: int, data: bytes, expected: int) -> np.ndarray:
        """Shard k's tokens as read, refused when the file changed under a run (its sha256 is only
        checked at the start): shorter than the manifest says, or an id no token of the tokenizer
        has (the embedding would fail with an IndexError far from the cause)."""
        changed = f"{self.shards[k]}: changed after it was prepared (its sha256 is checked when a run starts)"
        fix = f"restore it, or prepare the sources into {self.path} again, and resume"
        if len(data) != expected * self.dtype.itemsize:
            raise DataError(f"{changed}: {len(data)} bytes read where the manifest has {expected} tokens; {fix}")
        tokens = np.frombuffer(data, dtype=self.dtype)
        if self.vocab_size and len(tokens) and int(tokens.max()) >= self.vocab_size:
            raise DataError(
                f"{changed}: token id {int(tokens.max())} is not one of the tokenizer's {self.vocab_size}; {fix}"
            )
        return tokens

    def _fd(self, k: int) -> int:
        """Shard k's file, open for reading. Rows are read with pread, not a memory map: mapped pages
        count in the process's RSS, which then grew with every row read (176 MB after 330 steps of
        `small` on 100M tokens) up to the corpus size; read pages stay in the kernel's cache."""
        if k in self._fds:
            self._fds.move_to_end(k)
            return self._fds[k]
        if len(self._fds) >= OPEN_SHARDS:
            os.close(self._fds.popitem(last=False)[1])
        self._fds[k] = os.open(self.shards[k], os.O_RDONLY)
        return self._fds[k]

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)

    def mask(self, start: int, end: int) -> np.ndarray:
        """bool [end - start]: the token is a trainable target (not inside a masked span)."""
        out = np.ones(end - start, dtype=bool)
        first = int(np.searchsorted(self.masked[:, 1], start, side="right"))
        for a, b in self.masked[first:]:
            if a >= end:
                break
            out[max(a, start) - start : min(b, end) - start] = False
        return out

    def doc_files(self) -> np.ndarray:
        """int64 [D]: each document's file, an index into self.files."""
        return np.concatenate([np.zeros(0, np.int64)] + [w[:, 0] for w in self.where]).astype(np.int64)

    def source(self, doc: int) -> str:
        """Where global document `doc` came from: FILE:LINE (FILE for a text file)."""
        k = int(np.searchsorted(self.doc_base, doc, side="right")) - 1
        file, line = self.where[k][doc - self.doc_base[k]]
        return f"{self.files[file]}:{line}" if line else self.files[file]


def held_out(n_docs: int, fraction: float) -> np.ndarray:
    """bool [D]: documents held out for evaluation, a fixed pseudo-random `fraction` of them
    chosen by a hash of the index (the same split whatever the training seed; at least one, and
    with two or more documents not all). hold_out says how much of each."""
    if fraction <= 0 or n_docs == 0:
        return np.zeros(n_docs, dtype=bool)
    with np.errstate(over="ignore"):
        u = (np.arange(n_docs, dtype=np.uint64) * GOLDEN) >> np.uint64(11)
    u = u.astype(np.float64) / float(1 << 53)
    held = u < fraction
    if not held.any():
        held[int(np.argmin(u))] = True
    if held.all() and n_docs > 1:
        held[int(np.argmax(u))] = False
    return held


def hold_out(sizes: np.ndarray, total: int, fraction: float) -> np.ndarray:
    """int64 [H]: how many leading tokens of each document chosen for evaluation (`sizes`: their
    tokens) still train. A chosen document is held out whole, unless it alone holds more than a
    quarter of the source's `total` tokens (or twice `fraction` of them, if more): then only its
    tail of the fraction's size. So a large file among small ones gives evaluation a tail of
    itself, not the whole file (three files, one of 98%: it held out 98% of the corpus), a
    one-document corpus holds out its tail, and documents of ordinary size are held out whole, as
    before. The in-memory split (data/packing.py) and a prepared directory's (split_ranges) are
    cut by this one rule.

    A quarter, not twice the fraction: documents of ordinary size stay held out whole, so the
    splits the tests and benchmarks are pinned to stand. The debug presets read 28 files
    of the built-in corpus (data.max_bytes 400 KB; Python 3.11.7's stdlib, so another Python's
    differ), one of which is held out whole: 3.1% of their tokens, under either bound (twice
    data.eval_fraction 0.02 is 4%); the whole corpus (data.max_bytes=0) holds out 35 of 1,758, 1.5%."""
    sizes = np.asarray(sizes, dtype=np.int64)
    target = total - int(total * (1 - fraction))  # the fraction, in tokens: the one-document cut's
    return np.where(sizes > max(2 * target, total // 4), sizes - target, 0).astype(np.int64)


def split_ranges(bounds: np.ndarray, fraction: float, split: str, documents: bool) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) int64: the [start, end) token ranges of a split ("train" or "eval") of the
    documents `bounds` (int64 [D + 1]) delimit, in order: each document or the part of one the
    hold-out leaves it (`documents`), else the longest runs of them. Packed, what this holds
    grows with the documents held out, not with the corpus."""
    chosen = np.flatnonzero(held_out(len(bounds) - 1, fraction))
    cuts = hold_out(bounds[chosen + 1] - bounds[chosen], int(bounds[-1]), fraction)
    tails = bounds[chosen] + cuts < bounds[chosen + 1]  # the held-out part of each, in order
    held = (bounds[chosen][tails] + cuts[tails], bounds[chosen + 1][tails])
    if split == "eval":
        return held if documents else _runs(*held)
    if documents:
        starts, ends = bounds[:-1], bounds[1:].copy()
        ends[chosen] = bounds[chosen] + cuts  # a chosen document's head, if the hold-out left it one
    else:  # the runs between the held-out ranges
        first, last = _runs(*held)
        starts, ends = np.concatenate([[0], last]), np.concatenate([first, bounds[-1:]])
    kept = ends > starts
    return starts[kept].astype(np.int64), ends[kept].astype(np.int64)


def _runs(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ordered disjoint ranges, those that touch joined."""
    new = np.ones(len(starts), dtype=bool)  # a range that does not go on from the one before
    new[1:] = starts[1:] != ends[:-1]
    return starts[new], ends[np.append(new[1:], True)[: len(new)]]


@dataclass
class _Segments:
    """Contiguous global token ranges read back to back as one stream (a split's documents)."""

    start: np.ndarray  # int64 [G] global start of each range
    vstart: np.ndarray  # int64 [G + 1] position of each range in the joined stream, and its length

    def flagged_before(self, bounds: np.ndarray, flagged: np.ndarray, v: np.ndarray) -> np.ndarray:
        """int64: the flagged documents' tokens (quality.flagged_before) before each joined-stream
        position of `v`."""
        ends = self.start + np.diff(self.vstart)
        own = quality.flagged_before(bounds, flagged, ends) - quality.flagged_before(bounds, flagged, self.start)
        before = np.concatenate([[0], np.cumsum(own)])  # in the ranges before each
        g = np.clip(np.searchsorted(self.vstart, v, side="right") - 1, 0, len(self.start) - 1)
        at = self.start[g] + np.minimum(v - self.vstart[g], ends[g] - self.start[g])
        return (
            before[g]
            + quality.flagged_before(bounds, flagged, at)
            - quality.flagged_before(bounds, flagged, self.start[g])
        )

    def pieces(self, v0: int, v1: int) -> list[tuple[int, int]]:
        """Global [a, b) ranges holding joined-stream positions [v0, v1)."""
        out, g = [], int(np.searchsorted(self.vstart, v0, side="right")) - 1
        while v0 < v1:
            stop = min(v1, int(self.vstart[g + 1]))
            a = int(self.start[g] + v0 - self.vstart[g])
            out.append((a, a + stop - v0))
            v0, g = stop, g + 1
        return out


class ShardedRows:
    """Rows of one split of a prepared directory, with the interface of data/packing.py's Rows.

    Packed (the default), row r is positions [r L, r L + L + 1) of the split's documents joined
    into one stream, so rows run across document and shard boundaries as they do in memory;
    unpacked, row r is the split's r-th document truncated to L + 1 tokens."""

    def __init__(
        self, data: PreparedData, seq_len: int, pack: bool, split: str, fraction: float, screened: bool = False
    ) -> None:
        self.data, self.seq_len, self.pack = data, seq_len, pack
        self.split, self.fraction = split, fraction
        self.screened = screened  # the flagged documents' rows are reported (data.garbage_filter=warn)
        self._bounds = data.doc_bounds()
        starts, ends = split_ranges(self._bounds, fraction, split, documents=not pack)
        if pack:
            self._segments = _Segments(starts, np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64))
            self._n = max(0, (int(self._segments.vstart[-1]) - 1) // seq_len)
        else:
            docs = ends - starts >= 2
            self._starts = starts[docs]
            self._lengths = np.minimum(ends[docs] - starts[docs], seq_len + 1) - 1
            self._n = len(self._starts)
        self.n_tokens = self._n * seq_len if pack else int(self._lengths.sum())
        self._replaced: dict[int, np.ndarray] = {}  # fault injection's bad rows (the shards are read-only)

    def __len__(self) -> int:
        return self._n

    def fingerprint(self) -> str:
        """What the rows hold as a digest (packing.Rows.fingerprint's), without reading a token:
        the tokenizer's and the shards' sha256s as the manifest holds them, and where each row
        begins and ends."""
        shards = [shard["sha256"] for shard in self.data.manifest["shards"]]
        head = json.dumps([self.data.tokenizer_sha, shards, self.seq_len, self.pack])
        bounds = (self._segments.start, self._segments.vstart) if self.pack else (self._starts, self._lengths)
        return rows_digest(head, *(np.asarray(a, dtype=np.int64) for a in bounds))

    def length(self, i: int) -> int:
        return self.seq_len if self.pack else int(self._lengths[i])

    def _pieces(self, i: int) -> list[tuple[int, int]]:
        if self.pack:
            return self._segments.pieces(i * self.seq_len, (i + 1) * self.seq_len + 1)
        start = int(self._starts[i])
        return [(start, start + int(self._lengths[i]) + 1)]

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int64 [n+1], trainable-target mask bool [n+1]) of row i."""
        pieces = self._pieces(i)
        tokens = self._replaced.get(i)
        if tokens is None:
            tokens = np.concatenate([self.data.read(a, b) for a, b in pieces])
        return tokens.astype(np.int64), np.concatenate([self.data.mask(a, b) for a, b in pieces])

    def replace(self, i: int, tokens: np.ndarray) -> None:
        """Serve `tokens` as row i from now on (fault injection: bad data)."""
        self._replaced[i] = np.asarray(tokens, dtype=np.int64)

    def has_target(self, i: int) -> bool:
        """Whether row i has a trainable target (a chat prompt longer than a row has none)."""
        pieces = self._pieces(i)
        mask = np.concatenate([self.data.mask(a, b) for a, b in pieces])
        return bool(mask[1:].any())

    def flagged_rows(self) -> list[quality.Flagged]:
        """The documents `data prepare` flagged and kept that reach this split, with the rows at
        least half theirs (packed rows through the split's joined stream)."""
        flagged = ~np.isnan(self.data.garbage)
        # null: too few documents for a packing scale, only junk judged alone was flagged (median 0: none)
        scale = self.data.manifest.get("garbage") or {"median": 0.0, "threshold": 0.0}
        if not (self.screened and flagged.any()):
            return []
        bounds = self._bounds
        if self.pack:  # row r: joined-stream positions [r L, r L + L + 1)
            starts = np.arange(self._n, dtype=np.int64) * self.seq_len
            ends = self._segments.flagged_before(bounds, flagged, starts + self.seq_len + 1)
            count = ends - self._segments.flagged_before(bounds, flagged, starts)
            rows = np.flatnonzero(2 * count >= self.seq_len + 1)
        else:
            ends = self._starts + self._lengths + 1
            rows = np.flatnonzero(quality.mostly_flagged(bounds, flagged, self._starts, ends))
        heads, _ = split_ranges(bounds, self.fraction, self.split, documents=True)
        docs = np.flatnonzero(flagged)
        docs = docs[np.isin(bounds[docs], heads)]  # those with tokens in this split (a head starts a document)
        first = docs[: quality.SHOWN]
        found = quality.Flagged(
            quality.Scale(self.data.key, float(scale["median"]), float(scale["threshold"])),
            len(docs),
            tuple(self.data.source(int(d)) for d in first),
            tuple(float(self.data.garbage[d]) for d in first),
            rows.astype(np.int64),
            tuple(self.data.why.get(int(d), "") for d in first),
        )
        return [found]

    def target_docs(self, i: int) -> np.ndarray:
        """int64 [n]: the document of each of row i's n targets (its tokens after the first)."""
        positions = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self._pieces(i)])[1:]
        return np.searchsorted(self._bounds, positions, side="right") - 1

    def sources(self, i: int) -> list[str]:
        """Where the documents row i overlaps came from (FILE:LINE)."""
        docs: list[int] = []
        for a, b in self._pieces(i):
            first, last = np.searchsorted(self._bounds, [a, b - 1], side="right") - 1
            docs += [d for d in range(int(first), int(last) + 1) if d not in docs]
        return [self.data.source(d) for d in docs]
