"""Reading a prepared directory (data/prepare.py writes it): rows read from the token shards on
demand (pread), so a run's memory does not grow with the corpus, cut from the stream of all shards.

Shapes: K shards, D documents, S masked spans, L = seq_len.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trimtab.data.sources import PREPARED_MANIFEST
from trimtab.errors import DataError
from trimtab.rundir import write_json

MANIFEST_VERSION = 1
OPEN_SHARDS = 64  # shard files kept open at once
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: multiplicative hashing (Knuth)


def read_manifest(path: Path) -> dict[str, Any] | None:
    file = Path(path) / PREPARED_MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
    except ValueError as exc:
        raise DataError(f"{file}: unreadable ({exc}); prepare the sources into a new directory") from None
    if manifest.get("version") != MANIFEST_VERSION:
        raise DataError(f"{file}: manifest version {manifest.get('version')}, this trimtab reads {MANIFEST_VERSION}")
    return manifest


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    write_json(Path(path) / PREPARED_MANIFEST, manifest)  # a reader never sees half a manifest


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


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
            name, why = next(iter(bad.items()))
            raise DataError(
                f"{key} '{path}': shard {name} {why}; run `trimtab data prepare` on the same sources into "
                f"'{path}' again to rebuild it (the other shards are kept)"
            )
        self.manifest = manifest
        self.tokenizer_sha = manifest["tokenizer"]["sha256"]
        self.files = [f["path"] for f in manifest["files"]]
        self.dtype = np.dtype(manifest["dtype"])
        self.shards, self.offsets, self.where, masked = [], [], [], []
        self._fds: OrderedDict[int, int] = OrderedDict()  # shard -> open file descriptor, newest last
        self.base = [0]  # global token position of each shard's first token
        for shard in manifest["shards"]:
            folder = self.path / "shards"
            self.shards.append(folder / f"{shard['name']}.bin")
            with np.load(folder / f"{shard['name']}.idx.npz") as idx:
                self.offsets.append(idx["offsets"] + self.base[-1])
                self.where.append(idx["where"])
                masked.append(idx["masked"] + self.base[-1])
            self.base.append(self.base[-1] + shard["tokens"])
        self.n_tokens = self.base[-1]
        self.doc_base = np.concatenate([[0], np.cumsum([len(o) - 1 for o in self.offsets])]).astype(np.int64)
        self.masked = np.concatenate(masked) if masked else np.zeros((0, 2), dtype=np.int64)  # [S, 2] global

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
            out[at - start : stop - start] = np.frombuffer(data, dtype=self.dtype)
            at, k = stop, k + 1
        return out

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

    def source(self, doc: int) -> str:
        """Where global document `doc` came from: FILE:LINE (FILE for a text file)."""
        k = int(np.searchsorted(self.doc_base, doc, side="right")) - 1
        file, line = self.where[k][doc - self.doc_base[k]]
        return f"{self.files[file]}:{line}" if line else self.files[file]


def held_out(n_docs: int, fraction: float) -> np.ndarray:
    """bool [D]: documents held out for evaluation, a fixed pseudo-random `fraction` of them
    chosen by a hash of the index (the same split whatever the training seed; at least one
    when there are two or more documents)."""
    if fraction <= 0 or n_docs < 2:
        return np.zeros(n_docs, dtype=bool)
    with np.errstate(over="ignore"):
        u = (np.arange(n_docs, dtype=np.uint64) * GOLDEN) >> np.uint64(11)
    u = u.astype(np.float64) / float(1 << 53)
    held = u < fraction
    if not held.any():
        held[int(np.argmin(u))] = True
    if held.all():
        held[int(np.argmax(u))] = False
    return held


@dataclass
class _Segments:
    """Contiguous global token ranges read back to back as one stream (a split's documents)."""

    start: np.ndarray  # int64 [G] global start of each range
    vstart: np.ndarray  # int64 [G + 1] position of each range in the joined stream, and its length

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

    def __init__(self, data: PreparedData, seq_len: int, pack: bool, split: str, fraction: float) -> None:
        self.data, self.seq_len, self.pack = data, seq_len, pack
        bounds = self._bounds = data.doc_bounds()
        keep = held_out(data.n_docs, fraction)
        if split == "train":
            keep = ~keep
        if data.n_docs == 1 and fraction > 0:  # one long document: its tail is the eval set
            cut = int(data.n_tokens * (1 - fraction))
            bounds = np.array([0, cut, data.n_tokens]) if split == "train" else np.array([cut, cut, data.n_tokens])
            keep = np.array([True, False]) if split == "train" else np.array([False, True])
        if pack:
            edges = np.diff(np.concatenate([[0], keep.astype(np.int8), [0]]))
            first, last = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # runs [first, last) of kept docs
            starts, ends = bounds[first], bounds[last]
            self._segments = _Segments(starts, np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64))
            total = int(self._segments.vstart[-1])
            self._n = max(0, (total - 1) // seq_len)
        else:
            lengths = np.diff(bounds)
            self._docs = np.flatnonzero(keep & (lengths >= 2)).astype(np.int64)
            self._starts = bounds[self._docs]
            self._lengths = np.minimum(lengths[self._docs], seq_len + 1) - 1
            self._n = len(self._docs)
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

    def sources(self, i: int) -> list[str]:
        """Where the documents row i overlaps came from (FILE:LINE)."""
        docs: list[int] = []
        for a, b in self._pieces(i):
            first, last = np.searchsorted(self._bounds, [a, b - 1], side="right") - 1
            docs += [d for d in range(int(first), int(last) + 1) if d not in docs]
        return [self.data.source(d) for d in docs]
