"""Token rows and the train/eval splits (the steps and micro-batches cut from them: data/batches.py).

Shapes: R rows, L = seq_len, B rows in a micro-batch, T = its longest row.
A row of n input positions stores n+1 tokens: inputs are tokens[:-1], targets tokens[1:].
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from trimtab.config import DataConfig
from trimtab.data import junk, junk_cache, quality, stretches
from trimtab.data.prepared import ShardedRows, hold_out, rows_digest
from trimtab.data.sources import Document, corpus_fingerprint
from trimtab.data.tokenizer import TextTokenizer, cache_not_written
from trimtab.errors import DataError
from trimtab.words import all_of, counted

logger = logging.getLogger(__name__)

CACHE_VERSION = 2  # bump when the cached arrays' meaning changes (2: special-token text in documents is text)


@dataclass
class TokenizedDocs:
    """Documents tokenized back to back, each ending in eos."""

    tokens: np.ndarray  # int32 [N]
    mask: np.ndarray  # bool [N]: the token is a trainable target
    offsets: np.ndarray  # int64 [D+1]: document d is tokens[offsets[d]:offsets[d+1]]
    sources: list[str] | None = None  # [D]: each document's source (Document.source), when known
    # [D]: a document the garbage screen flagged and kept (data.garbage_filter=warn): its bytes per
    # token over the source's median; NaN for the others. None: not screened
    garbage: np.ndarray | None = None
    scale: quality.Scale | None = None  # what `garbage` was judged by
    why: np.ndarray | None = None  # str [D]: a flagged junk document's verdict (data/junk.py); "": none

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def select(self, keep: np.ndarray) -> TokenizedDocs:
        """The documents where keep (bool [D]) is true, in order."""
        return self.parts(self.offsets[:-1], np.diff(self.offsets), keep)

    def split(self, keep: np.ndarray) -> tuple[TokenizedDocs, TokenizedDocs]:
        """(the first keep[d] tokens of each document d, the rest of each): pieces of none left out."""
        starts, lengths = self.offsets[:-1], np.diff(self.offsets)
        return self.parts(starts, keep, keep > 0), self.parts(starts + keep, lengths - keep, lengths > keep)

    def parts(self, starts: np.ndarray, lengths: np.ndarray, which: np.ndarray) -> TokenizedDocs:
        """Token ranges [starts, starts + lengths) of the documents where `which` (bool [D]) is true,
        each as a document of its own, in order."""
        starts, lengths = starts[which], lengths[which]
        taken = _ranges(len(self.tokens), starts, lengths)
        sources = None if self.sources is None else [s for s, k in zip(self.sources, which) if k]
        garbage = None if self.garbage is None else self.garbage[which]
        why = None if self.why is None else self.why[which]
        return TokenizedDocs(self.tokens[taken], self.mask[taken], _offsets(lengths), sources, garbage, self.scale, why)

    def flagged(self, starts: np.ndarray, ends: np.ndarray) -> list[quality.Flagged]:
        """The flagged documents kept here, with the token ranges [starts, ends) (rows) at least
        half theirs (indices into starts); [] when there are none."""
        if self.garbage is None or self.scale is None or np.isnan(self.garbage).all():
            return []
        flagged = ~np.isnan(self.garbage)
        rows = np.flatnonzero(quality.mostly_flagged(self.offsets, flagged, starts, ends)).astype(np.int64)
        first = np.flatnonzero(flagged)[: quality.SHOWN]
        names = tuple((self.sources[i] if self.sources else "") or f"document {i}" for i in first)
        packing = tuple(float(self.garbage[i]) for i in first)
        why = () if self.why is None else tuple(str(self.why[i]) for i in first)
        return [quality.Flagged(self.scale, int(flagged.sum()), names, packing, rows, why)]


def _ranges(n: int, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """bool [n]: the positions in the ranges [starts, starts + lengths), in order and apart: 3 bytes a token, where an
    int64 index of them held 24 (a 50 MB document's held-out split: 0.3 GB)."""
    edges = np.zeros(n + 1, dtype=np.int8)
    np.add.at(edges, starts, 1)
    np.add.at(edges, starts + lengths, -1)
    return np.cumsum(edges[:-1], dtype=np.int8).astype(bool)


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
        try:
            np.savez(tmp, tokens=tokenized.tokens, mask=tokenized.mask, offsets=tokenized.offsets)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)  # a partial copy would hold the space it failed for
            cache_not_written(path, exc)
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
    # calls of a bounded size (tokenizer.ENCODE_CALL_CHARS), each call's ids int32 (as Python ints: 36 bytes an id)
    encoded = tok.encode_documents(docs, arrays=True)
    pieces: list[np.ndarray] = []
    flags, doc_lengths = [], []
    bos, eos = (np.array([t], dtype=np.int32) for t in (tok.bos_id or 0, tok.eos_id))
    for doc, segment_ids in zip(docs, encoded):
        n = 0
        if tok.prepends_bos(doc.segments[0][0]):
            pieces.append(bos)
            flags.append(False)
            n += 1
        for ids, (_, trainable) in zip(segment_ids, doc.segments):
            pieces.append(ids)
            flags.append(trainable)
            n += len(ids)
        pieces.append(eos)
        flags.append(doc.segments[-1][1])  # eos is learned only after trainable text
        doc_lengths.append(n + 1)
    lengths = [len(p) for p in pieces]
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
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
        # row -> the tokens fault injection put there (`replace`); kept apart from `tokens`, see replace
        self._replaced: dict[int, np.ndarray] = {}

    def fingerprint(self) -> str:
        """What the rows hold (their tokens, masks, starts and lengths) as a digest, for a resumed
        loader to check against its checkpoint's. Taken once, at the first loader; fault injection's
        rows (`replace`) are held apart and never enter it: 5 ms for the built-in corpus, 0.3 s for 100M tokens."""
        if self._fingerprint is None:  # one dtype each, fresh or from the token cache
            tokens, mask = np.asarray(self.tokens, np.int32), np.asarray(self.mask, np.bool_)
            self._fingerprint = rows_digest("", tokens, mask, self.starts, self.lengths)
        return self._fingerprint

    def flagged_rows(self) -> list[quality.Flagged]:
        """The documents the garbage screen flagged and kept, with the rows at least half theirs."""
        return [] if self.docs is None else self.docs.flagged(self.starts, self.starts + self.lengths + 1)

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
        tokens = self._replaced.get(i)
        if tokens is None:
            tokens = self.tokens[start:end]
        return tokens.astype(np.int64), self.mask[start:end].copy()

    def length(self, i: int) -> int:
        return int(self.lengths[i])

    def has_target(self, i: int) -> bool:
        return True  # rows without a trainable target were dropped when cut (_rows)

    def replace(self, i: int, tokens: np.ndarray) -> None:
        """Serve `tokens` as row i from now on (fault injection: bad data, as a damaged file would
        hold). Held apart rather than written into `tokens`: a row's last token is the next row's
        first there, so two neighbouring rows replaced in another order held other tokens, and a
        resumed run (which replaces its poisoned rows sorted, at its start) trained on other data
        than the uninterrupted run (debug-moe, bad_batch@20:2, sigkill@60: apart from step 111 on);
        as on prepared data (data/prepared.py), a row's garbage no longer spills into its neighbour."""
        start = int(self.starts[i])
        row = self.tokens[start : start + int(self.lengths[i]) + 1].astype(np.int64)  # a copy
        tokens = np.asarray(tokens, dtype=np.int64)[: len(row)]
        row[: len(tokens)] = tokens
        self._replaced[i] = row


def _rows(docs: TokenizedDocs, starts: np.ndarray, lengths: np.ndarray) -> Rows:
    """Rows without a single trainable target are dropped: they would add no loss, and a step of
    only such rows would have n_targets == 0 (e.g. chat prompts longer than seq_len)."""
    # targets counted in int32 where they fit: int64, with its copy, held 16 bytes a token
    counts = np.zeros(len(docs.mask) + 1, dtype=np.int32 if len(docs.mask) < 2**31 else np.int64)
    np.cumsum(docs.mask, dtype=counts.dtype, out=counts[1:])
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
    screen: bool = False,
    where: str = "",
) -> tuple[Rows, Rows]:
    """(train, eval) rows; eval is eval_docs, else a held-out cfg.eval_fraction of docs. `key`
    (the source's config key) names the source on the console, and `where` (its path) in an error
    too; with `screen`, docs are screened for garbage first (cfg.garbage_filter: named, or left out
    before the hold-out)."""
    tokenized = tokenize_documents(docs, tok, cfg, cache_dir)
    if screen and cfg.garbage_filter != "off":
        tokenized = _screen(tokenized, docs, cfg, key, cache_dir, tok)
        if docs and all_junk(tokenized):
            raise JunkSource(key, where or key, len(docs))
    if eval_docs is not None:
        train, held = tokenized, tokenize_documents(eval_docs, tok, cfg, cache_dir)
    else:
        train, held = _hold_out(tokenized, cfg.eval_fraction, seed)
    del tokenized  # the split copied its tokens: one long document's twice while its rows were cut
    make_rows = pack_rows if cfg.pack else document_rows
    train_rows, eval_rows = make_rows(train, cfg.seq_len), make_rows(held, cfg.seq_len)
    if not len(train_rows):
        after = f" once data.eval_fraction={cfg.eval_fraction:g} is held out" if len(held) else ""
        named = (f"{key} '{where}'" if where else key) or "the training split"
        raise DataError(
            f"{named} has {counted(len(train.tokens), 'token')} in {counted(len(train), 'document')}{after}, "
            f"not enough for one row of data.seq_len+1={cfg.seq_len + 1} tokens with a "
            f"trainable target; add data or lower data.seq_len"
        )
    if len(held.tokens) and not len(eval_rows):
        logger.warning(
            "%sthe eval split (%d tokens) is too small for one row of data.seq_len+1=%d; evaluation is skipped",
            f"{key}: " if key else "",
            len(held.tokens),
            cfg.seq_len + 1,
        )
    return train_rows, eval_rows


class JunkSource(DataError):
    """Every document of a source was flagged by the garbage screen (data.garbage_filter warn or drop):
    a mixture leaves the source out (data/dataset.py build_phase_data); alone, it is refused."""

    def __init__(self, key: str, where: str, n_docs: int) -> None:
        self.key, self.where, self.n_docs = key, where, n_docs
        section = key.split(".mix[")[0].removesuffix(".source") or "data"  # data, finetune.data
        super().__init__(
            f"{key or 'the training data'} '{where}': {all_of(n_docs, 'document')} is flagged as junk by the "
            f"data screen; replace its data, or set {section}.garbage_filter=off to train on it as it is"
        )


def all_junk(tokenized: TokenizedDocs) -> bool:
    """Every document screened out: none left (drop), or every one flagged (warn)."""
    return not len(tokenized) or every_flagged(tokenized.garbage)


def every_flagged(garbage: np.ndarray | None) -> bool:
    """Whether the garbage screen flagged every one of some documents, by their `garbage` scores (NaN: not
    flagged; None or none: nothing screened): a source of junk alone (training, a prepared directory, the plan)."""
    return garbage is not None and len(garbage) > 0 and not np.isnan(garbage).any()


def _screen(
    tokenized: TokenizedDocs, docs: list[Document], cfg: DataConfig, key: str, cache: Path | None, tok: TextTokenizer
) -> TokenizedDocs:
    """The documents without those data/quality.py flags as garbage, and without their junk stretches
    (data/stretches.py), when cfg.garbage_filter is drop; all of them (named on the console, the flagged ones marked
    for the orchestrator) when it is warn."""
    n_bytes = np.array([sum(len(text.encode()) for text, _ in doc.segments) for doc in docs])
    found = quality.screen(n_bytes, np.diff(tokenized.offsets), cfg.garbage_sigma)
    flagged, spared = quality.spare_scripts(found.flagged, lambda i: docs[i].text)
    if spared:
        shown = [f"{docs[i].source or f'document {i}'} ({said})" for i, said in list(spared.items())[: quality.SHOWN]]
        logger.warning("%s", quality.spared_line(len(spared), key, shown))
        found = replace(found, flagged=flagged)
    # junk that packs like text, and random characters by each document alone: the packing cannot see them
    texts = [doc.text for doc in docs]
    verdicts, repeated = junk.spare_repeats(texts, junk_cache.kinds(texts, cache))
    if repeated:  # a source repeated on purpose: left out, it would leave no training row
        logger.warning("%s", junk.repeats_line(repeated, len(docs), key or "the training data"))
    if not junk.holds_words(texts, junk.SMALL_WORDS):  # its own reference: too small to judge word order by
        logger.warning("%s", junk.unjudged_line([key or "the training data"]))
    junky = np.array([verdict is not None for verdict in verdicts], dtype=bool)
    names = [doc.source or f"document {i}" for i, doc in enumerate(docs)]
    drop = cfg.garbage_filter == "drop"
    # a long document judged junk whole whose junk stretches hold under half of it is mostly text, as prepare judges
    # a long file: one of 630K characters of docstrings, 43% salad in the middle, was judged salad whole (1.28 bits)
    # and the run refused (its only document), its 57% of prose with it
    one = np.array([len(doc.segments) == 1 for doc in docs], dtype=bool)
    long = stretches.found_in(texts, found.flagged | ~one)
    for i in stretches.mostly_text(texts, long) & set(np.flatnonzero(junky).tolist()):
        junky[i], verdicts[i] = False, None
    if inside := [s for s in long if not junky[s.file]]:
        logger.warning("%s", stretches.line([(names[s.file], s.start, s.end, s.why) for s in inside], drop, True))
        if drop:
            tokenized = _cut(tokenized, docs, inside, tok)
    extra = junky & ~found.flagged
    if not found.count and not extra.any():
        return tokenized
    if found.count:
        logger.warning("%s", quality.report(found, names, n_bytes, key, drop))
    if extra.any():
        logger.warning("%s", junk.report(verdicts, extra, names, n_bytes, key, drop))
    flagged = found.flagged | extra
    if drop:
        return tokenized.select(~flagged)
    # no scale (too few documents to judge packing): junk documents are judged against all documents' median
    median = found.median if math.isfinite(found.median) else float(np.median(found.packing))
    garbage = np.where(flagged, found.packing / median, np.nan)
    why = np.array([str(v) if v is not None and extra[i] else "" for i, v in enumerate(verdicts)], dtype=object)
    return replace(tokenized, garbage=garbage, scale=quality.Scale(key, median, found.threshold), why=why)


def _cut(
    tokenized: TokenizedDocs, docs: list[Document], found: list[stretches.Stretch], tok: TextTokenizer
) -> TokenizedDocs:
    """`tokenized` with the documents holding junk stretches (`found`) tokenized again without them
    (data.garbage_filter=drop): the rest of each trained on, as prepare's drop keeps it."""
    by_doc: dict[int, list[stretches.Stretch]] = {}
    for s in found:
        by_doc.setdefault(s.file, []).append(s)
    cut = [
        replace(docs[i], segments=[(stretches.left_out(docs[i].text, f), docs[i].segments[0][1])])
        for i, f in by_doc.items()
    ]
    again, which = _tokenize(cut, tok), {i: j for j, i in enumerate(by_doc)}
    spans = [(again, which[i]) if i in which else (tokenized, i) for i in range(len(tokenized))]
    tokens = [src.tokens[src.offsets[j] : src.offsets[j + 1]] for src, j in spans]
    mask = np.concatenate([src.mask[src.offsets[j] : src.offsets[j + 1]] for src, j in spans])
    return replace(tokenized, tokens=np.concatenate(tokens), mask=mask, offsets=_offsets([len(t) for t in tokens]))


def _hold_out(docs: TokenizedDocs, fraction: float, seed: int) -> tuple[TokenizedDocs, TokenizedDocs]:
    """(train, held out): round(fraction x documents) of them chosen by the seed (at least one; not
    all), each held out whole or, a large one, its tail (prepared.hold_out, as a prepared
    directory's)."""
    if fraction <= 0:
        return docs, docs.select(np.zeros(len(docs), dtype=bool))
    return docs.split(train_lengths(np.diff(docs.offsets), fraction, seed))


def train_lengths(lengths: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """int64 [D]: the leading tokens of each document (`lengths`: their tokens) that _hold_out
    leaves to training; `trimtab plan` counts a corpus's training tokens by it (plan/chinchilla.py)."""
    keep = np.asarray(lengths, dtype=np.int64).copy()
    if fraction <= 0 or not len(keep):
        return keep
    n_eval = max(1, round(fraction * len(keep)))
    if len(keep) > 1:
        n_eval = min(len(keep) - 1, n_eval)
    chosen = np.random.default_rng(seed).permutation(len(keep))[:n_eval]
    keep[chosen] = hold_out(keep[chosen], int(keep.sum()), fraction)
    return keep


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

    def flagged_rows(self) -> list[quality.Flagged]:
        """Each source's flagged documents, their rows numbered in this one set."""
        return [f.shifted(int(self.offsets[p])) for p, part in enumerate(self.parts) for f in part.flagged_rows()]

    def sources(self, i: int) -> list[str]:
        part, j = self.locate(i)
        return self.parts[part].sources(j)

    def has_target(self, i: int) -> bool:
        part, j = self.locate(i)
        return self.parts[part].has_target(j)

    def replace(self, i: int, tokens: np.ndarray) -> None:
        part, j = self.locate(i)
        self.parts[part].replace(j, tokens)


def unigram_entropy(rows: Rows | ConcatRows | ShardedRows, sample_rows: int = 2048) -> tuple[float, float] | None:
    """(unigram entropy, held-out bigram cross-entropy) in nats of the training targets: the loss
    of a model that predicts every token from no context, and of one that sees the token before.
    Read from up to `sample_rows` rows evenly spread over the set (the same rows on every rank).
    The entropy takes the Miller-Madow correction of the plug-in estimate's bias, (K - 1) / 2N for
    K distinct tokens among N (Miller 1955; Paninski 2003, Neural Computation 15(6)); the bigram
    is fitted on every other row and scored on the rest, interpolated with the add-one unigram
    (weight c(a) / (c(a) + 5) on the bigram after token a, Witten-Bell-like): where the data holds
    no context (random digits) it scores about the entropy, on text well under it. None for rows
    without a target."""
    picks = np.unique(np.linspace(0, len(rows) - 1, min(sample_rows, len(rows))).astype(np.int64)) if len(rows) else []
    pairs: list[list[np.ndarray]] = [[], []]  # [fit, scored] halves: (previous token, target) per row
    for n, i in enumerate(picks):
        tokens, mask = rows.get(int(i))
        keep = mask[1:]
        pairs[n % 2].append(np.stack([tokens[:-1][keep], tokens[1:][keep]]))
    both = [np.concatenate(half, axis=1) if half else np.zeros((2, 0), np.int64) for half in pairs]
    targets = np.concatenate([both[0][1], both[1][1]])
    if len(targets) == 0:
        return None
    counts = np.bincount(targets)
    p = counts[counts > 0] / len(targets)
    entropy = float(-(p * np.log(p)).sum() + (len(p) - 1) / (2 * len(targets)))
    return entropy, _bigram_cross_entropy(*both) if both[1].shape[1] and both[0].shape[1] else entropy


def _bigram_cross_entropy(fit: np.ndarray, scored: np.ndarray) -> float:
    """Mean -log p(b | a) over `scored`'s (a, b) pairs [2, M] of an interpolated bigram fitted on `fit`'s [2, N]."""
    vocab = int(max(fit.max(), scored.max())) + 1
    unigram = (np.bincount(fit[1], minlength=vocab) + 1) / (fit.shape[1] + vocab)
    ids, pair_counts = np.unique(fit[0] * vocab + fit[1], return_counts=True)
    context = np.bincount(fit[0], minlength=vocab)[scored[0]]
    wanted = scored[0] * vocab + scored[1]
    at = np.minimum(np.searchsorted(ids, wanted), len(ids) - 1)
    seen = np.where(ids[at] == wanted, pair_counts[at], 0)
    weight = context / (context + 5.0)
    p = weight * seen / np.maximum(context, 1) + (1 - weight) * unigram[scored[1]]
    return float(-np.log(p).mean())
