"""Inside a `data prepare` worker (data/prepare.py runs the jobs): a job's files read into documents,
tokenized in batches, screened for garbage (data/quality.py) and written to shards under
temporary names, renamed when whole."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from trimtab.config import DataConfig
from trimtab.data import formats, junk, quality, stretches
from trimtab.data.prepared import sha256_file
from trimtab.data.sources import Document, record_documents
from trimtab.data.tokenizer import TextTokenizer

SHARD_TOKENS = 1 << 27  # a shard is closed at the first document end past this many tokens
BIGRAMS = "junk-bigrams.npz"  # beside the manifest: the word pairs word salad is judged against (data/junk.py)
ENCODE_CHARS = 4_000_000  # characters per tokenizers.encode_batch call: bounds its memory
PACKING = "packing"  # a flagged document's kind when only its packing flagged it (data/quality.py), no junk verdict


@dataclass
class Options:
    """How records become documents (the data.* keys of the same names)."""

    format: str = "auto"
    text_field: str = "text"
    skip_bad_records: bool = False
    garbage_filter: str = "warn"  # off | warn | drop: documents that pack like garbage (data/quality.py)
    garbage_sigma: float = 6.0

    def data_config(self) -> DataConfig:
        return DataConfig(
            format=self.format,
            text_field=self.text_field,
            skip_bad_records=self.skip_bad_records,
            garbage_filter=self.garbage_filter,
            garbage_sigma=self.garbage_sigma,
        )


# How an error tells a malformed record's fix when skip_hint is not given (the Python API); the
# CLI passes its flag.
SKIP_HINT = "pass Options(skip_bad_records=True)"
SKIPPED_SHOWN = 5  # skipped records named on the console (all are counted in the manifest)


Item = tuple[int, str, bool, "formats.Span | None"]  # (file number, path, named on its own, piece or whole)


def run_job(
    job: list[Item],
    out: str,
    dtype: str,
    options: dict[str, Any],
    hint: str = SKIP_HINT,
    scale: dict[str, float] | None = None,
    references: dict[int, str] | None = None,
    repeated: dict[int, float] | None = None,
    salad: dict[int, bool] | None = None,
) -> dict[str, Any]:
    """Prepare `job`'s files into shards under `out`; `references`: each file's junk reference, the
    file beside the manifest its source's documents are judged against (default: BIGRAMS, the shared one);
    `repeated`: each file's source's share of repeated text (default: `scale`'s, the shared sample's); `salad`:
    whether each file's source is mostly word salad (junk.mostly_salad; absent: judged per batch)."""
    tok = TextTokenizer.load(Path(out) / "tokenizer.json")
    uid = hashlib.sha256(json.dumps(job).encode()).hexdigest()[:12]
    span = job[0][3]  # a job is several whole files, or one piece of one
    writer = _Writer(Path(out) / "shards", uid, np.dtype(dtype), span[0] if span else 0)
    encoder = _Encoder(tok, writer, scale=scale, drop=options["garbage_filter"] == "drop")
    loaded: dict[str, junk.Bigrams | None] = {}
    cfg = Options(**options).data_config()
    warnings, skipped = [], []
    try:
        for n, path, named, piece in job:
            encoder.file = n
            if scale is not None:
                encoder.bigrams = _reference(Path(out), (references or {}).get(n, BIGRAMS), loaded)
                encoder.repeated_share = (repeated or {}).get(n, scale.get("repeated", 0.0))
                encoder.mostly_salad = (salad or {}).get(n)
            try:
                if not (named or piece) and _in_batches(Path(path), cfg):
                    # skipped whole, before any of it is written (a plain-text file's NUL byte too)
                    formats.check_text(Path(path), binary_nul=formats.kind_of(Path(path), cfg.format) == "text")
                for doc, first, last, line, where in _pieces(Path(path), cfg, tok, piece, hint):
                    encoder.add(doc, first, last, line)
                    if doc is None and len(skipped) < SKIPPED_SHOWN:
                        skipped.append(where)
            except formats.Unreadable as exc:
                if named or piece:  # a file named on its own must be read, and so must one read in pieces;
                    raise  # a directory's odd file is skipped
                encoder.unreadable(str(exc))
                warnings.append(f"{exc}: skipped")
                continue
            encoder.flush()
            if not any(encoder.stats[n].get(said) for said in ("documents", "skipped", "garbage")):
                warnings.append(f"{path}: empty, nothing to prepare")
        writer.close()
    except BaseException:
        writer.discard()
        raise
    return {
        "shards": writer.done,
        "files": encoder.stats,
        "chat": encoder.chat,
        "warnings": warnings,
        "span": span,
        "skipped": skipped,
        **encoder.found(),
    }


def _reference(out: Path, name: str, loaded: dict[str, junk.Bigrams | None]) -> junk.Bigrams | None:
    """The junk reference `name` beside the manifest, loaded once per job (`loaded`); None when it is
    absent (prepared before references were kept, or too little text): each batch is judged by its own."""
    if name not in loaded:
        loaded[name] = junk.Bigrams.load(out / name) if (out / name).is_file() else None
    return loaded[name]


def _in_batches(path: Path, cfg: DataConfig) -> bool:
    """Whether a directory's file may be encoded in several batches (more than ENCODE_CHARS of
    text: a compressed one may hold that much), so that a bad byte met part way would leave its
    first batches in the shard. Columnar files are read by datasets and not checked ahead."""
    big = path.stat().st_size > ENCODE_CHARS or path.suffix.lower() in formats.COMPRESSED
    return big and formats.kind_of(path, cfg.format) != "columnar"


def _pieces(
    path: Path, cfg: DataConfig, tok: TextTokenizer, span: formats.Span | None = None, hint: str = SKIP_HINT
) -> Iterator[tuple[Document | None, bool, bool, int, str]]:
    """(document or piece of one, whether it is the first piece, the last, its line or row, where
    it is in words) of a file (of `span` of it); None for a malformed record skipped
    (skip_bad_records). A long text file's records are joined where the tokenizer cannot be cut exactly
    (TextTokenizer.cuts), as the in-memory path encodes such a text whole (tokenizer.encode_documents)."""
    if formats.kind_of(path, cfg.format) == "text":
        texts = tok.cuts().joined(record.value for record in formats.records(path, cfg.format))
        held, first = next(texts), True
        for text in chain(texts, [None]):
            if held or not first:
                yield Document([(held, True)]), first, text is None, 0, str(path)
            held, first = text, False
        return
    for doc, record in record_documents(path, cfg, tok.chat, hint, span):
        if doc is None:
            yield None, False, False, record.line, record.where
        elif doc.text:
            yield doc, True, True, record.line, record.where


@dataclass
class _InPieces:
    """A long text file's document read in pieces (formats.TEXT_CHUNK_CHARS) so far: where it starts in the
    shard (_Writer.mark), its characters, those of its pieces judged junk, the first one's verdict, its bytes
    and tokens."""

    mark: tuple
    file: int = 0
    chars: int = 0
    junk_chars: int = 0
    why: junk.Verdict | None = None
    n_bytes: int = 0
    n_tokens: int = 0
    written: int = 0  # tokens written so far (a junk stretch's are not, with drop): what a drop at the end takes back
    found: list[stretches.Stretch] = field(default_factory=list)  # its junk stretches (data/stretches.py)

    def add(self, text: str, n_tokens: int, why: junk.Verdict | None) -> None:
        if why is not None:
            self.found.append(stretches.Stretch(self.file, self.chars, self.chars + len(text), str(why)))
        self.chars += len(text)
        self.n_bytes += len(text.encode())
        self.n_tokens += n_tokens
        if why is not None:
            self.junk_chars += len(text)
            self.why = self.why or why


@dataclass
class _Encoder:
    """Documents -> tokens, in batches of ENCODE_CHARS characters through encode_batch."""

    tok: TextTokenizer
    writer: _Writer
    # the garbage screen's (median, threshold); {}: too few documents for one (junk alone is judged); None: off
    scale: dict[str, float] | None = None
    drop: bool = False  # leave out what the screen flags (else count and name it only)
    # (file, line, why: junk.Verdict's words, "" for packing) of the first flagged
    garbage: list[tuple[int, int, str]] = field(default_factory=list)
    bigrams: junk.Bigrams | None = None  # the file's source's sample's word pairs (run_job); None: each batch's own
    spared: int = 0  # documents that pack like garbage, written in a language: kept (quality.language)
    spared_shown: list[tuple[int, int, str]] = field(default_factory=list)  # (file, line, language) of the first
    repeated: int = 0  # documents of repeated text, most of the sample's: kept (junk.spare_repeats)
    _repeating: bool = False  # the document read now has a part of repeated text kept (_count_repeated)
    repeated_share: float = 0.0  # the file's source's sample's share of repeated text (run_job)
    mostly_salad: bool | None = None  # whether the file's source's sample is mostly word salad (run_job)
    # flagged documents by kind: junk.KINDS' (data/junk.py's verdict), PACKING for the packing screen's alone
    kinds: dict[str, int] = field(default_factory=dict)
    file: int = 0
    stats: dict[int, dict[str, int]] = field(default_factory=dict)
    chat: bool = False
    _batch: list[tuple[Document, bool, bool, int]] = field(default_factory=list)
    _chars: int = 0
    _pieces: _InPieces | None = None  # the document read in pieces now (_in_pieces)
    # junk stretches of long text files kept (data/stretches.py): said, and left out with drop
    stretches: list[stretches.Stretch] = field(default_factory=list)

    def found(self) -> dict[str, Any]:
        """What the screen found in the job, for prepare's report (prepare._run_all)."""
        return {
            "garbage": self.garbage,
            "spared": self.spared,
            "spared_shown": self.spared_shown,
            "repeated": self.repeated,
            "kinds": self.kinds,
            "stretches": [(s.file, s.start, s.end, s.why) for s in self.stretches],
        }

    def add(self, doc: Document | None, first: bool, last: bool, line: int) -> None:
        long = doc is not None and (not (first and last) or len(doc.text) > stretches.JUDGE_CHARS)
        if long and self.scale is not None and len(doc.segments) == 1:
            # a long text file's piece, or a text file under one piece but over a stretch (900K characters, 400K of
            # them salad, was judged whole, flagged whole): judged in stretches, so junk inside text is seen
            parts = list(self.tok.cuts().joined(stretches.split(doc.text))) or [doc.text]  # cut as in memory
            for i, part in enumerate(parts):
                self._add(Document([(part, doc.segments[0][1])]), first and i == 0, last and i == len(parts) - 1, line)
            return
        self._add(doc, first, last, line)

    def _add(self, doc: Document | None, first: bool, last: bool, line: int) -> None:
        stats = self.stats.setdefault(self.file, {"documents": 0, "tokens": 0, "skipped": 0})
        if doc is None:
            stats["skipped"] += 1
            return
        self._batch.append((doc, first, last, line))
        self._chars += sum(len(t) for t, _ in doc.segments)
        self.chat = self.chat or any(not trainable for _, trainable in doc.segments)
        if self._chars >= ENCODE_CHARS:
            self.flush()

    def _encoded(self) -> list[list[list[int]]]:
        """The batch's documents' segments' ids; a piece after a document's first (a long text file's record,
        a stretch) without what the tokenizer puts before a text: the pieces hold the whole text's ids, as in
        memory (Llama-2-style, 8K tokens: a "▁" a record or stretch more, 2.4M characters in 454,559 tokens,
        454,533 now)."""
        return self.tok.encode_documents([doc for doc, *_ in self._batch], later=[not f for _, f, *_ in self._batch])

    def unreadable(self, why: str) -> None:
        self._batch, self._chars, self._repeating = [], 0, False
        self.stats[self.file] = {"documents": 0, "tokens": 0, "skipped": 0, "unreadable": why}

    def flush(self) -> None:
        self.stats.setdefault(self.file, {"documents": 0, "tokens": 0, "skipped": 0})
        encoded = self._encoded()
        packing, verdicts = self._screen(encoded)
        for (doc, first, last, line), pieces, packed, why in zip(self._batch, encoded, packing, verdicts):
            tokens, mask = [], []
            head = int(first and self.tok.prepends_bos(doc.text))
            if head:
                tokens.append(self.tok.bos_id)  # as data/packing.py: each document starts with it once
                mask.append(False)
            for piece, (_, trainable) in zip(pieces, doc.segments):
                tokens += piece
                mask += [trainable] * len(piece)
            if last:
                tokens.append(self.tok.eos_id)
                mask.append(doc.segments[-1][1] if doc.segments else True)
            if not (first and last):  # a piece of a long text file: its document judged at its end (_InPieces)
                stretch, (packed, why) = why, self._in_pieces(doc, first, last, len(tokens), why)
                if self.drop and stretch is not None and np.isnan(packed):  # junk inside text: its ends only
                    end = len(tokens) - int(last)
                    tokens, mask = tokens[:head] + tokens[end:], mask[:head] + mask[end:]
            if not np.isnan(packed):
                self.stats[self.file]["garbage"] = self.stats[self.file].get("garbage", 0) + 1
                kind = why.kind if why else PACKING
                self.kinds[kind] = self.kinds.get(kind, 0) + 1
                if len(self.garbage) < quality.SHOWN:
                    self.garbage.append((self.file, line, str(why or "")))
                if self.drop:
                    if not first:  # its pieces before this one are written: taken back
                        self.writer.rewind(self._pieces.mark)
                        self.stats[self.file]["tokens"] -= self._pieces.written
                    continue
            tokens_mask = np.array(tokens, dtype=np.int64), np.array(mask, dtype=bool)
            self.writer.add(*tokens_mask, last, self.file, line, packed, why)
            stats = self.stats[self.file]
            stats["tokens"] += len(tokens)
            stats["documents"] += int(last)
            if not (first and last):
                self._pieces.written += len(tokens)
        self._batch, self._chars = [], 0

    def _in_pieces(
        self, doc: Document, first: bool, last: bool, n_tokens: int, why: junk.Verdict | None
    ) -> tuple[float, junk.Verdict | None]:
        """(bytes per token, verdict) of a long text file's document, read in pieces of formats.TEXT_CHUNK_CHARS,
        at its last piece when its pieces judged junk (junk.kinds, as training judges it: a piece of 2 x
        junk.PIECE_WORDS words in pieces of its own) hold at least half its characters (training's verdict is the
        mean over its pieces); (NaN, None) else. Judged whole documents only, a 1.2 MB line of word salad, flagged
        in training, passed here."""
        if first:
            self._pieces = _InPieces(self.writer.mark(), self.file)
        self._pieces.add(doc.text, n_tokens, why if self.scale is not None else None)
        if not last or self._pieces.why is None or self._pieces.junk_chars < 0.5 * self._pieces.chars:
            if last:  # kept: its junk stretches said (and, with drop, left out: flush)
                self.stretches += stretches.merged(self._pieces.found)
            return math.nan, None
        return float(quality.packed(self._pieces.n_bytes, self._pieces.n_tokens)), self._pieces.why

    def _count_repeated(self, spared: list[bool]) -> None:
        """Counts the batch's documents of repeated text kept (`spared`, per entry), each once: a long text
        file's pieces and their stretches are one document (a 50 MB line, 500 stretches, was "500 documents")."""
        for (*_, last, _), kept in zip(self._batch, spared):
            self._repeating = self._repeating or kept
            if last:
                self.repeated += self._repeating
                self._repeating = False

    def _reference(self, texts: list[str], whole: np.ndarray) -> junk.Bigrams | None:
        """What a batch's word salad is judged against: the source's sample's word pairs (self.bigrams), but a batch
        of a long text file's stretches (stretches.py) holding junk.CORPUS_WORDS is judged against itself, each
        stretch against the others (None), as training judges a long document's pieces (junk.alone). The sample
        holds the stretches' own pairs (a file under its share is sampled whole, one member) and they are not left
        out of it: 400K characters of word salad in a 3 MB file scored 5.8 bits against it (real text: 6.5-7.3),
        0.3 against the file's other stretches (real text 1.6, not prose; the bar 1.5)."""
        if not whole.any() and junk.holds_words(texts, junk.CORPUS_WORDS):
            return None
        return self.bigrams

    def _screen(self, encoded: list[list[list[int]]]) -> tuple[np.ndarray, list[junk.Verdict | None]]:
        """float [batch]: the bytes per token of each whole document (not a piece of a text file)
        the screen flags; NaN for the others."""
        whole = np.array([first and last for _, first, last, _ in self._batch], dtype=bool)
        if self.scale is None:
            return np.full(len(self._batch), np.nan), [None] * len(self._batch)
        n_bytes = np.array([len(doc.text.encode()) for doc, *_ in self._batch])
        # counted as trained, as the in-memory screen counts them: start token, text, end token
        n_tokens = np.array(
            [
                sum(map(len, pieces)) + 1 + self.tok.prepends_bos(doc.text)
                for (doc, *_), pieces in zip(self._batch, encoded)
            ]
        )
        median, text_of = self.scale.get("median"), lambda i: self._batch[i][0].text
        flagged = np.zeros(len(self._batch), dtype=bool)
        if median:  # else too few documents to measure packing by: junk.kinds still judges each document alone
            flagged = quality.flags(n_bytes, n_tokens, median, self.scale["threshold"])
            flagged = whole & flagged
            flagged, spared = quality.spare_scripts(flagged, text_of)
            self.spared += len(spared)  # a minority language: kept, said once at the end (prepare.py)
            room = quality.SHOWN - len(self.spared_shown)
            self.spared_shown += [(self.file, self._batch[i][3], said) for i, said in list(spared.items())[:room]]
        # junk that packs like text (mojibake, random letters; word salad against the sample's word pairs)
        texts = [doc.text for doc, *_ in self._batch]
        ref = self._reference(texts, whole)  # the source's rule, but for a file's stretches judged by themselves
        source_rule = self.bigrams is not None and ref is self.bigrams
        verdicts = junk.kinds(texts, ref, self.mostly_salad if source_rule else None)
        # a sample mostly of repeated text (a toy corpus): kept, said once at the end (prepare.py)
        kept, _ = junk.spare_repeats(texts, verdicts, self.repeated_share)
        self._count_repeated([v is not None and k is None for v, k in zip(verdicts, kept)])
        verdicts = kept
        flagged |= whole & np.array([verdict is not None for verdict in verdicts], dtype=bool)
        # a piece's verdict is its document's evidence (_in_pieces), its packing none: NaN
        return np.where(flagged, quality.packed(n_bytes, n_tokens), np.nan), verdicts


def save_bigrams(out: Path, bigrams: junk.Bigrams, name: str = BIGRAMS) -> None:
    """`bigrams` as out/`name`, whole or not at all (a temp file and a rename, as a shard)."""
    tmp = out / f".tmp-{name}"
    with open(tmp, "wb") as fh:  # np.savez would add .npz to a name without it
        bigrams.save(fh)
    os.replace(tmp, out / name)


class _Writer:
    """Appends tokens to the open shard; closes it at a document end past SHARD_TOKENS."""

    def __init__(self, folder: Path, uid: str, dtype: np.dtype, start: int = 0) -> None:
        self.folder, self.uid, self.dtype = folder, uid, dtype
        self.start = start  # the byte of the file its piece starts at: orders shards of one file
        self.done: list[dict[str, Any]] = []
        self._fh = None

    def _open(self) -> None:
        self.name = f"{self.uid}-{len(self.done):04d}"
        self._fh = open(self.folder / f".tmp-{self.name}.bin", "wb")
        self._hash, self._n = hashlib.sha256(), 0
        self._ends: list[int] = []
        self._where: list[tuple[int, int]] = []
        self._masked: list[tuple[int, int]] = []
        self._files: set[int] = set()
        # (document, bytes per token, junk.Verdict.row) of each the screen flagged and kept
        self._garbage: list[tuple[float, ...]] = []

    def add(
        self,
        tokens: np.ndarray,
        mask: np.ndarray,
        doc_end: bool,
        file: int,
        line: int,
        packed: float = math.nan,
        why: junk.Verdict | None = None,
    ) -> None:
        """Append a document or a piece of one (doc_end: its last); `packed`: a flagged whole
        document's bytes per token (NaN: not flagged); `why`: the junk it is, if any (data/junk.py)."""
        if self._fh is None:
            self._open()
        data = tokens.astype(self.dtype).tobytes()
        self._fh.write(data)
        self._hash.update(data)
        for start, end in _false_runs(mask):
            self._masked.append((self._n + start, self._n + end))
        self._n += len(tokens)
        self._files.add(file)
        if doc_end:
            if not math.isnan(packed):
                self._garbage.append((len(self._ends), packed, *junk.Verdict.row(why)))
            self._ends.append(self._n)
            self._where.append((file, line))
            if self._n >= SHARD_TOKENS:
                self.close()

    def mark(self) -> tuple:
        """Where the next document starts: what `rewind` puts back (a document read in pieces, dropped whole at its
        end, its first pieces written)."""
        if self._fh is None:
            return ()
        return self._n, len(self._masked), self._hash.copy(), set(self._files)

    def rewind(self, mark: tuple) -> None:
        """Tokens written since `mark` taken back: the shard stays open at the document's start (a shard
        closes only at a document end)."""
        if not mark:  # the document opened the shard: none of it stays
            self.discard()
            return
        n, masked, hashed, files = mark
        self._fh.truncate(n * self.dtype.itemsize)
        self._fh.seek(n * self.dtype.itemsize)
        self._n, self._masked, self._hash, self._files = n, self._masked[:masked], hashed, files

    def close(self) -> None:
        if self._fh is None or not self._ends:
            return self.discard()
        self._fh.close()
        self._fh = None
        tmp = self.folder / f".tmp-{self.name}.idx.npz"
        np.savez(
            tmp,
            offsets=np.array([0] + self._ends, dtype=np.int64),
            where=np.array(self._where, dtype=np.int64).reshape(-1, 2),
            masked=np.array(self._masked, dtype=np.int64).reshape(-1, 2),
            garbage=np.array(self._garbage, dtype=np.float64).reshape(-1, 7),  # read by prepared.PreparedData
        )
        for suffix in (".idx.npz", ".bin"):  # the tokens last: a shard is whole once its .bin exists
            os.replace(self.folder / f".tmp-{self.name}{suffix}", self.folder / f"{self.name}{suffix}")
        self.done.append(
            {
                "name": self.name,
                "tokens": self._ends[-1],
                "documents": len(self._ends),
                "files": sorted(self._files),
                "start": self.start,
                "sha256": {"bin": self._hash.hexdigest(), "idx": sha256_file(self.folder / f"{self.name}.idx.npz")},
            }
        )

    def discard(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        for path in self.folder.glob(f".tmp-{self.uid}-*"):
            path.unlink()


def _false_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of False in a bool array."""
    if mask.all():
        return []
    edges = np.diff(np.concatenate([[1], mask.astype(np.int8), [1]]))
    return list(zip(np.flatnonzero(edges == -1).tolist(), np.flatnonzero(edges == 1).tolist()))
