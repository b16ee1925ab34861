"""Token rows, train/eval splits and the step/micro-batch loader.

Shapes: R rows, L = seq_len, B rows in a micro-batch, T = its longest row.
A row of n input positions stores n+1 tokens: inputs are tokens[:-1], targets tokens[1:].
"""

from __future__ import annotations

import hashlib
import logging
import os
import zipfile
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from trimtab.config import DataConfig
from trimtab.data import quality
from trimtab.data.prepared import rows_digest
from trimtab.data.sources import Document, corpus_fingerprint
from trimtab.data.tokenizer import TextTokenizer
from trimtab.errors import DataError

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # cross_entropy's default ignore_index
CACHE_VERSION = 1  # bump when the cached arrays' meaning changes
ENCODE_CHUNK_CHARS = 4_000_000  # bounds the memory of tokenizers' Encoding objects


@dataclass
class TokenizedDocs:
    """Documents tokenized back to back, each ending in eos."""

    tokens: np.ndarray  # int32 [N]
    mask: np.ndarray  # bool [N]: the token is a trainable target
    offsets: np.ndarray  # int64 [D+1]: document d is tokens[offsets[d]:offsets[d+1]]
    sources: list[str] | None = None  # [D]: each document's source (Document.source), when known

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def select(self, keep: np.ndarray) -> TokenizedDocs:
        """The documents where keep (bool [D]) is true, in order."""
        lengths = np.diff(self.offsets)
        kept = np.repeat(keep, lengths)  # per token
        sources = None if self.sources is None else [s for s, k in zip(self.sources, keep) if k]
        return TokenizedDocs(self.tokens[kept], self.mask[kept], _offsets(lengths[keep]), sources)

    def split_at(self, cut: int) -> tuple[TokenizedDocs, TokenizedDocs]:
        """Split a stream at token `cut` into two single-document streams."""
        head, tail = slice(0, cut), slice(cut, len(self.tokens))
        return (
            TokenizedDocs(self.tokens[head], self.mask[head], _offsets([cut]), self.sources),
            TokenizedDocs(self.tokens[tail], self.mask[tail], _offsets([len(self.tokens) - cut]), self.sources),
        )


def _offsets(lengths: np.ndarray | list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def tokenize_documents(
    docs: list[Document], tok: TextTokenizer, cfg: DataConfig, cache_dir: Path | None = None
) -> TokenizedDocs:
    """Tokenize docs ([bos] + each + eos), cached in cache_dir by (corpus, tokenizer).

    cfg is accepted for API stability: none of its fields changes per-document tokenization
    (seq_len / pack / eval_fraction apply afterwards), so it is not part of the cache key.
    """
    path = None
    if cache_dir is not None:
        key = hashlib.sha256(f"{corpus_fingerprint(docs)}:{tok.fingerprint}:{CACHE_VERSION}".encode())
        path = Path(cache_dir) / f"tokens-{key.hexdigest()[:20]}.npz"
        if path.is_file() and (cached := _load_cached(path, docs)) is not None:
            return cached
    tokenized = _tokenize(docs, tok)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npz")
        np.savez(tmp, tokens=tokenized.tokens, mask=tokenized.mask, offsets=tokenized.offsets)
        os.replace(tmp, path)
    return tokenized


def _load_cached(path: Path, docs: list[Document]) -> TokenizedDocs | None:
    """The cached tokens of docs; None (a miss, rebuilt and written over) when the entry cannot be
    read: writes are atomic, so that is a disk fault or a partial copy of the cache."""
    try:
        with np.load(path) as data:  # the sources are not cached: the documents name them
            return TokenizedDocs(data["tokens"], data["mask"], data["offsets"], [d.source for d in docs])
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as exc:  # numpy and zipfile raise these
        logger.warning("token cache %s cannot be read (%s); tokenizing again and replacing it", path, exc)
        return None


def _tokenize(docs: list[Document], tok: TextTokenizer) -> TokenizedDocs:
    texts = [text for doc in docs for text, _ in doc.segments]
    encoded: list[list[int]] = []
    start = 0
    while start < len(texts):  # chunks of ~ENCODE_CHUNK_CHARS, at least one text each
        end, size = start, 0
        while end < len(texts) and (end == start or size + len(texts[end]) <= ENCODE_CHUNK_CHARS):
            size += len(texts[end])
            end += 1
        encoded.extend(tok.encode_batch(texts[start:end]))
        start = end
    pieces, flags, doc_lengths = [], [], []
    segment_ids = iter(encoded)
    for doc in docs:
        n = 0
        if tok.prepends_bos(doc.segments[0][0]):
            pieces.append([tok.bos_id])
            flags.append(False)
            n += 1
        for _, trainable in doc.segments:
            ids = next(segment_ids)
            pieces.append(ids)
            flags.append(trainable)
            n += len(ids)
        pieces.append([tok.eos_id])
        flags.append(doc.segments[-1][1])  # eos is learned only after trainable text
        doc_lengths.append(n + 1)
    lengths = [len(p) for p in pieces]
    tokens = np.fromiter(chain.from_iterable(pieces), dtype=np.int32, count=sum(lengths))
    mask = np.repeat(np.array(flags, dtype=bool), lengths)
    return TokenizedDocs(tokens, mask, _offsets(doc_lengths), [doc.source for doc in docs])


class Rows:
    """A tokenized split: row i is tokens[starts[i] : starts[i] + lengths[i] + 1]."""

    def __init__(
        self,
        tokens: np.ndarray,
        mask: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        docs: TokenizedDocs | None = None,
    ) -> None:
        self.tokens, self.mask = tokens, mask
        self.starts = starts.astype(np.int64)  # [R]
        self.lengths = lengths.astype(np.int64)  # [R] input positions, each <= seq_len
        self.n_tokens = int(self.lengths.sum())
        self.docs = docs  # the documents the rows were cut from: their sources
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """What the rows hold (their tokens, masks, starts and lengths) as a digest, for a resumed
        loader to check against its checkpoint's. Taken once, at the first loader, before fault
        injection rewrites a row in memory (`replace`): 5 ms for the built-in corpus, 0.3 s for 100M tokens."""
        if self._fingerprint is None:  # one dtype each, fresh or from the token cache
            tokens, mask = np.asarray(self.tokens, np.int32), np.asarray(self.mask, np.bool_)
            self._fingerprint = rows_digest("", tokens, mask, self.starts, self.lengths)
        return self._fingerprint

    def sources(self, i: int) -> list[str]:
        """The sources of the documents row i overlaps (a packed row can span several)."""
        if self.docs is None or self.docs.sources is None:
            return []
        start = int(self.starts[i])
        end = start + int(self.lengths[i])  # the row's last token
        first, last = np.searchsorted(self.docs.offsets, [start, end], side="right") - 1
        return self.docs.sources[first : last + 1]

    def __len__(self) -> int:
        return len(self.starts)

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int64 [n+1], trainable-target mask bool [n+1]) of row i."""
        start = int(self.starts[i])
        end = start + int(self.lengths[i]) + 1
        return self.tokens[start:end].astype(np.int64), self.mask[start:end].copy()

    def length(self, i: int) -> int:
        return int(self.lengths[i])

    def has_target(self, i: int) -> bool:
        return True  # rows without a trainable target were dropped when cut (_rows)

    def replace(self, i: int, tokens: np.ndarray) -> None:
        """Overwrite row i's tokens (fault injection: bad data, as a damaged file would hold)."""
        start = int(self.starts[i])
        self.tokens[start : start + len(tokens)] = tokens


def _rows(docs: TokenizedDocs, starts: np.ndarray, lengths: np.ndarray) -> Rows:
    """Rows without a single trainable target are dropped: they would add no loss, and a step of
    only such rows would have n_targets == 0 (e.g. chat prompts longer than seq_len)."""
    counts = np.concatenate([[0], np.cumsum(docs.mask, dtype=np.int64)])
    keep = counts[starts + lengths + 1] - counts[starts + 1] > 0
    if not keep.all():
        logger.warning(
            "dropped %d of %d rows that have no trainable target within data.seq_len", int((~keep).sum()), len(keep)
        )
    return Rows(docs.tokens, docs.mask, starts[keep], lengths[keep], docs)


def pack_rows(docs: TokenizedDocs, seq_len: int) -> Rows:
    """Row r = stream[r*L : r*L + L + 1]; the last partial row is dropped."""
    n_rows = max(0, (len(docs.tokens) - 1) // seq_len)
    starts = np.arange(n_rows, dtype=np.int64) * seq_len
    return _rows(docs, starts, np.full(n_rows, seq_len, dtype=np.int64))


def document_rows(docs: TokenizedDocs, seq_len: int) -> Rows:
    """One row per document, truncated to seq_len + 1 tokens; documents of < 2 tokens dropped."""
    lengths = np.minimum(np.diff(docs.offsets), seq_len + 1) - 1
    keep = lengths >= 1
    return _rows(docs, docs.offsets[:-1][keep], lengths[keep])


def build_splits(
    cfg: DataConfig,
    tok: TextTokenizer,
    docs: list[Document],
    eval_docs: list[Document] | None,
    seed: int,
    cache_dir: Path | None = None,
    key: str = "",
) -> tuple[Rows, Rows]:
    """(train, eval) rows; eval is eval_docs, else a held-out cfg.eval_fraction of docs. With
    `key` (the source's config key, for the console line), docs are screened for garbage first
    (cfg.garbage_filter: named, or left out before the hold-out)."""
    tokenized = tokenize_documents(docs, tok, cfg, cache_dir)
    if key and cfg.garbage_filter != "off":
        tokenized = _screen(tokenized, docs, cfg, key)
    if eval_docs is not None:
        train, held = tokenized, tokenize_documents(eval_docs, tok, cfg, cache_dir)
    else:
        train, held = _hold_out(tokenized, cfg.eval_fraction, seed)
    make_rows = pack_rows if cfg.pack else document_rows
    train_rows, eval_rows = make_rows(train, cfg.seq_len), make_rows(held, cfg.seq_len)
    if not len(train_rows):
        raise DataError(
            f"the training split has {len(train.tokens)} tokens in {len(train)} documents, "
            f"not enough for one row of data.seq_len+1={cfg.seq_len + 1} tokens with a "
            f"trainable target; add data or lower data.seq_len"
        )
    if len(held.tokens) and not len(eval_rows):
        logger.warning(
            "the eval split (%d tokens) is too small for one row of data.seq_len+1=%d; evaluation is skipped",
            len(held.tokens),
            cfg.seq_len + 1,
        )
    return train_rows, eval_rows


def _screen(tokenized: TokenizedDocs, docs: list[Document], cfg: DataConfig, key: str) -> TokenizedDocs:
    """The documents without those data/quality.py flags as garbage when cfg.garbage_filter is
    drop; all of them (named on the console) when it is warn."""
    n_bytes = np.array([sum(len(text.encode()) for text, _ in doc.segments) for doc in docs])
    found = quality.screen(n_bytes, np.diff(tokenized.offsets), cfg.garbage_sigma)
    if not found.count:
        return tokenized
    drop = cfg.garbage_filter == "drop"
    names = [doc.source or f"document {i}" for i, doc in enumerate(docs)]
    logger.warning("%s", quality.report(found, names, n_bytes, key, drop))
    return tokenized.select(~found.flagged) if drop else tokenized


def _hold_out(docs: TokenizedDocs, fraction: float, seed: int) -> tuple[TokenizedDocs, TokenizedDocs]:
    if fraction <= 0:
        return docs, docs.select(np.zeros(len(docs), dtype=bool))
    if len(docs) == 1:  # one long document: its tail is the eval set
        return docs.split_at(int(len(docs.tokens) * (1 - fraction)))
    n_eval = min(len(docs) - 1, max(1, round(fraction * len(docs))))
    held = np.zeros(len(docs), dtype=bool)
    held[np.random.default_rng(seed).permutation(len(docs))[:n_eval]] = True
    return docs.select(~held), docs.select(held)


@dataclass
class MicroBatch:
    inputs: torch.Tensor  # int64 [B, T], right-padded with pad_id
    targets: torch.Tensor  # int64 [B, T] next tokens; IGNORE_INDEX where masked or padding
    n_targets: int  # number of targets != IGNORE_INDEX
    rows: list[int]  # dataset row of each of the B rows


@dataclass
class StepBatch:
    micro: list[MicroBatch]
    n_targets: int  # sum over micro-batches: the loss is normalized by this
    n_tokens: int  # input positions in the step, padding excluded
    rows: list[int]  # dataset row indices in the step (all ranks' rows under data parallelism)
    shard: list[int] | None = None  # this rank's rows under data parallelism; None: all of `rows`


def group_rows(rows: Rows, indices: list[int], micro_batch_tokens: int) -> list[list[int]]:
    """Longest first (stable), filled greedily while n_rows * max_len <= micro_batch_tokens;
    sorting by length keeps padding low."""
    groups: list[list[int]] = []
    for i in sorted(indices, key=lambda i: -rows.length(i)):
        # the first row of a group is its longest, so it sets the padded width
        if groups and (len(groups[-1]) + 1) * rows.length(groups[-1][0]) <= micro_batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def micro_batches(rows: Rows, indices: list[int], micro_batch_tokens: int, pad_id: int) -> list[MicroBatch]:
    """`indices` of `rows` grouped (group_rows) and collated into micro-batches of the budget."""
    return [collate(rows, group, pad_id) for group in group_rows(rows, indices, micro_batch_tokens)]


def collate(rows: Rows, indices: list[int], pad_id: int) -> MicroBatch:
    width = max(rows.length(i) for i in indices)
    inputs = np.full((len(indices), width), pad_id, dtype=np.int64)
    targets = np.full((len(indices), width), IGNORE_INDEX, dtype=np.int64)
    for b, i in enumerate(indices):
        tokens, mask = rows.get(i)
        n = len(tokens) - 1
        inputs[b, :n] = tokens[:-1]
        targets[b, :n] = np.where(mask[1:], tokens[1:], IGNORE_INDEX)
    return MicroBatch(
        torch.from_numpy(inputs), torch.from_numpy(targets), int((targets != IGNORE_INDEX).sum()), list(indices)
    )


class ConcatRows:
    """Several sources' rows as one set: row j of part p is row offsets[p] + j. Steps, micro-batches
    and data-parallel shares index this one set, whatever the mixture."""

    def __init__(self, parts: list[Rows]) -> None:
        self.parts = parts
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        self.n_tokens = sum(p.n_tokens for p in parts)

    def locate(self, i: int) -> tuple[int, int]:
        part = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return part, i - int(self.offsets[part])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        part, j = self.locate(i)
        return self.parts[part].get(j)

    def length(self, i: int) -> int:
        part, j = self.locate(i)
        return self.parts[part].length(j)

    def sources(self, i: int) -> list[str]:
        part, j = self.locate(i)
        return self.parts[part].sources(j)

    def has_target(self, i: int) -> bool:
        part, j = self.locate(i)
        return self.parts[part].has_target(j)

    def replace(self, i: int, tokens: np.ndarray) -> None:
        part, j = self.locate(i)
        self.parts[part].replace(j, tokens)


class BatchLoader:
    """Steps of ~batch_tokens input positions, each source in a reproducible per-epoch shuffled
    order; with several sources (a ConcatRows and their weights), every row goes to the source
    furthest below its share of the tokens drawn so far, so each step holds the stated
    proportions to within a row, deterministically (smooth weighted round robin, by tokens)."""

    def __init__(
        self,
        rows: Rows | ConcatRows,
        batch_tokens: int,
        micro_batch_tokens: int,
        seed: int,
        pad_id: int,
        rank: int = 0,
        world: int = 1,
        weights: list[float] | None = None,
        names: list[str] | None = None,
    ) -> None:
        if not len(rows):
            raise ValueError("BatchLoader needs at least one row")
        # Every rank draws the same global step and keeps its own share of the rows (see shard_step),
        # so the global batch, the order and the resumable state do not depend on the world size.
        self.rank, self.world = rank, world
        self.rows = rows
        parts = rows.parts if isinstance(rows, ConcatRows) else [rows]
        self.sizes = [len(p) for p in parts]
        self.base = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        weights = weights or [1.0] * len(parts)
        self.weights = [w / sum(weights) for w in weights]
        self.names = names or [f"source{i}" for i in range(len(parts))]
        self.part_tokens = [p.n_tokens for p in parts]
        self.batch_tokens = batch_tokens
        self.micro_batch_tokens = micro_batch_tokens  # an OOM handler may lower it between steps
        self.seed = seed
        self.pad_id = pad_id
        self._epochs, self._cursors = [0] * len(parts), [0] * len(parts)
        self._orders = [self._permutation(p, 0) for p in range(len(parts))]
        self.drawn = [0] * len(parts)  # tokens served from each source
        self.skipped: set[int] = set()  # rows a rollback took out of training (bad data)
        # what each source's rows hold: a resume over other data with as many rows is refused (the
        # order and the rows a rollback left out would then be other rows)
        self.digests = [p.fingerprint() for p in parts]

    @property
    def epoch(self) -> int:
        """Completed passes: over the one source, or over all a mixture's tokens."""
        if len(self.sizes) == 1:
            return self._epochs[0]
        return int(sum(self.drawn) // max(sum(self.part_tokens), 1))

    def _permutation(self, part: int, epoch: int) -> np.ndarray:
        key = [self.seed, epoch] if part == 0 else [self.seed, part, epoch]  # part 0: the single-source order
        return np.random.default_rng(key).permutation(self.sizes[part])

    def _next_row(self) -> int:
        total = sum(self.drawn)
        part = max(range(len(self.sizes)), key=lambda p: self.weights[p] * total - self.drawn[p])
        while True:
            if self._cursors[part] == self.sizes[part]:
                self._epochs[part], self._cursors[part] = self._epochs[part] + 1, 0
                self._orders[part] = self._permutation(part, self._epochs[part])
            self._cursors[part] += 1
            row = int(self.base[part] + self._orders[part][self._cursors[part] - 1])
            if row not in self.skipped and self.rows.has_target(row):
                self.drawn[part] += self.rows.length(row)
                return row

    def metrics(self) -> dict[str, float]:
        """Each source's share of the tokens served so far and its passes over its own data."""
        if len(self.sizes) == 1:
            return {}
        total = max(sum(self.drawn), 1)
        out = {}
        for name, drawn, tokens in zip(self.names, self.drawn, self.part_tokens):
            out[f"data/{name}/share"] = drawn / total
            out[f"data/{name}/epochs"] = drawn / max(tokens, 1)
        return out

    def skip_rows(self, rows: list[int]) -> int:
        """Never serve these rows again (the data window behind a rollback); each source keeps a row."""
        keep = set(self.skipped)
        keep.update(int(r) for r in rows)
        for part, size in enumerate(self.sizes):
            if sum(1 for r in keep if self.base[part] <= r < self.base[part + 1]) >= size:
                raise DataError(
                    f"skipping these rows would leave no training data in {self.names[part]}; the data itself is bad"
                )
        added = len(keep) - len(self.skipped)
        self.skipped = keep
        return added

    def regroup(self, batch: StepBatch) -> StepBatch:
        """The same rows split into micro-batches of the current budget (after an OOM)."""
        return self._step(batch.rows, batch.n_tokens)

    def next_batch(self) -> StepBatch:
        indices: list[int] = []
        n_tokens = 0
        while not indices or n_tokens < self.batch_tokens:
            indices.append(self._next_row())
            n_tokens += self.rows.length(indices[-1])
        return self._step(indices, n_tokens)

    def _step(self, indices: list[int], n_tokens: int) -> StepBatch:
        if self.world > 1:
            return shard_step(self.rows, indices, n_tokens, self.micro_batch_tokens, self.pad_id, self.rank, self.world)
        micro = micro_batches(self.rows, indices, self.micro_batch_tokens, self.pad_id)
        return StepBatch(micro, sum(m.n_targets for m in micro), n_tokens, indices)

    def state_dict(self) -> dict:
        return {
            "epoch": self._epochs[0],  # the first source's position at the top level, as before mixtures
            "cursor": self._cursors[0],
            "seed": self.seed,
            "n_rows": self.sizes[0],
            "skipped": sorted(self.skipped),
            "parts": [
                {"name": n, "epoch": e, "cursor": c, "n_rows": size, "drawn": d, "digest": digest}
                for n, e, c, size, d, digest in zip(
                    self.names, self._epochs, self._cursors, self.sizes, self.drawn, self.digests
                )
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` was taken (its seed wins over the constructor's)."""
        parts = state.get("parts") or [{**state, "name": self.names[0], "drawn": 0}]
        if len(parts) != len(self.sizes):
            raise DataError(
                f"the checkpoint's data had {len(parts)} sources but the data now has {len(self.sizes)}; "
                "resume with the same data.mix"
            )
        for part, (saved, size, name) in enumerate(zip(parts, self.sizes, self.names)):
            if saved["n_rows"] != size:
                raise DataError(
                    f"the checkpoint's data loader had {saved['n_rows']} rows in {name} but the data now "
                    f"gives {size}; resume with the same data.* settings and corpus"
                )
            if saved.get("digest", self.digests[part]) != self.digests[part]:  # older checkpoints: none
                raise DataError(
                    f"the checkpoint's data loader read other data in {name} than the data now gives: as many "
                    f"rows ({size}), other tokens (the corpus, its order or a data.* setting changed); resume "
                    "with the data it was trained on, or start a new run from its weights (train.init_from)"
                )
            self._epochs[part], self._cursors[part] = int(saved["epoch"]), int(saved["cursor"])
            self.drawn[part] = int(saved["drawn"])
        self.seed = int(state["seed"])
        self._orders = [self._permutation(p, e) for p, e in enumerate(self._epochs)]
        self.skipped = set(state.get("skipped", []))


def eval_batches(rows: Rows, micro_batch_tokens: int, max_tokens: int, pad_id: int) -> list[MicroBatch]:
    """Rows in order while their input positions fit in max_tokens (at least one row)."""
    indices: list[int] = []
    n_tokens = 0
    for i in range(len(rows)):
        if indices and n_tokens + rows.length(i) > max_tokens:
            break
        indices.append(i)
        n_tokens += rows.length(i)
    return micro_batches(rows, indices, micro_batch_tokens, pad_id)


# ------------------------------------------------------------------------------ data parallelism


def shard_rows(rows: Rows, indices: list[int], world: int) -> list[list[int]]:
    """Split a step's rows into `world` disjoint shares of about equal tokens: the rows in the
    order one process groups them (longest first, stable), cut into contiguous runs at equal
    token counts (a row goes to the share holding its middle token). With micro_batch_tokens =
    batch_tokens / world each rank's micro-batch then holds exactly the rows of one of a single
    process's micro-batches, so even batch-dependent routing (MoE capacity and balance loss)
    matches one process. Deterministic: every rank computes every share without communicating."""
    order = sorted(indices, key=lambda i: -rows.length(i))
    total = max(sum(rows.length(i) for i in order), 1)
    shares: list[list[int]] = [[] for _ in range(world)]
    seen = 0
    for i in order:
        n = rows.length(i)
        shares[min(world - 1, int(world * (seen + n / 2) / total))].append(i)
        seen += n
    return shares


def shard_step(
    rows: Rows, indices: list[int], n_tokens: int, micro_batch_tokens: int, pad_id: int, rank: int, world: int
) -> StepBatch:
    """This rank's share of a global step, in as many micro-batches as every other rank's.

    n_targets stays the global count, so each rank's summed loss over it adds up (all-reduce sum)
    to the single-process loss and gradient. The micro-batch counts are equal because FSDP gathers
    weights in every forward: a rank with fewer forwards would leave the others waiting."""
    shares = shard_rows(rows, indices, world)
    counts = [len(group_rows(rows, share, micro_batch_tokens)) if share else 0 for share in shares]
    groups = group_rows(rows, shares[rank], micro_batch_tokens) if shares[rank] else []
    while len(groups) < max(counts):
        widest = max(range(len(groups)), key=lambda g: len(groups[g]), default=None)
        if widest is None or len(groups[widest]) == 1:
            break
        group = groups.pop(widest)  # smaller micro-batches cost speed, never the result
        groups[widest:widest] = [group[: len(group) // 2], group[len(group) // 2 :]]
    micro = [collate(rows, group, pad_id) for group in groups]
    while len(micro) < max(counts):  # fewer rows than the others have micro-batches
        micro.append(_padding(rows, indices[0], pad_id))
    n_targets = sum(int(rows.get(i)[1][1:].sum()) for i in indices)
    return StepBatch(micro, n_targets, n_tokens, list(indices), shares[rank])


def _padding(rows: Rows, row: int, pad_id: int) -> MicroBatch:
    """A micro-batch that trains nothing (every target ignored): it only keeps the forward count
    equal across ranks."""
    micro = collate(rows, [row], pad_id)
    micro.targets.fill_(IGNORE_INDEX)
    return MicroBatch(micro.inputs, micro.targets, 0, [])
