"""`trimtab eval PATH --data FILE`: perplexity and bits per byte of a file's text, no lm-eval needed.

perplexity     exp(total NLL / tokens): depends on the tokenizer
bits per byte  total NLL / (ln 2 * UTF-8 bytes): comparable across tokenizers (Gao et al.
               2020, The Pile, section 3.1; lm-evaluation-harness's bits_per_byte)

The file is read as training reads a source file (data/sources.py): plain text (one document, a
BOM dropped), JSONL and tables (each record's data.text_field a document: the run's own), gzip /
zstd compressed; a pipe (`--data <(...)`) is plain text. Each document is scored from the start
token, as training sees it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from trimtab.config import DataConfig
from trimtab.data import TextTokenizer
from trimtab.data.sources import _Reader
from trimtab.errors import DataError
from trimtab.evaluation.scoring import continuation_scores, rolling_windows
from trimtab.model import Transformer


def read_texts(path: str | Path, data: DataConfig | None = None) -> list[str]:
    """The file's documents' texts, read by `data`'s format, text_field and skip_bad_records (the
    run's data section: a run trained on JSONL whose text is under another field scores that file);
    DataError naming it when missing, a directory, empty, not UTF-8 text, a damaged archive or
    table, or chat records (not text to score)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(
            f"--data '{path}' is a directory; pass one file (e.g. one of its files), or a directory `trimtab data "
            "prepare` wrote (it holds trimtab-data.json; this one does not), whose rows are scored as training's"
        )
    if not path.exists():
        raise DataError(f"--data '{path}' does not exist; pass a text, JSONL, Parquet, Arrow or CSV file")
    texts = _documents(path, data or DataConfig()) if path.is_file() else [_pipe(path)]
    if not any(text.strip() for text in texts):
        raise DataError(f"--data '{path}' is empty; pass a file with text")
    return texts


def _documents(path: Path, data: DataConfig) -> list[str]:
    """A file's documents through training's reader, the whole file (no data.max_bytes cap)."""
    fix = "remove it from the file, or --set data.skip_bad_records=true"
    reader = _Reader(replace(data, max_bytes=0), "data", "--data", fix=fix)
    texts = []
    for doc in reader.documents(str(path)):
        if len(doc.segments) > 1 or not doc.segments[0][1]:  # a prompt not to learn: not text to score
            raise DataError(
                f"--data '{path}': {doc.source} is a chat or instruction record; --data scores text: pass "
                "records with a 'text' field, or plain text"
            )
        texts.append(doc.text)
    return texts


def _pipe(path: Path) -> str:
    """A pipe's bytes as plain text, read once: a pipe cannot be read again to find a bad line."""
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"--data '{path}': not UTF-8 text at line {line} ({exc.reason}); convert it to UTF-8") from None
    if "\x00" in text:
        raise DataError(f"--data '{path}': holds NUL bytes, so it is binary, not text")
    return text


def score_text(
    model: Transformer, tok: TextTokenizer, text: str | list[str], stride: int | None = None, batch_size: int = 8
) -> dict[str, Any]:
    """NLL of every token of `text` (or of each of several documents), the first one after the
    start token (bos or eos), in model.cfg.max_seq_len windows advancing by `stride` (default:
    the whole window). Special-token text in it is text, as in training's documents."""
    limit = model.cfg.max_seq_len
    stride = stride or limit
    if not 0 < stride <= limit:
        raise DataError(f"--stride {stride} must be in [1, {limit}] (the model's context)")
    texts = [text] if isinstance(text, str) else text
    start = tok.bos_id if tok.bos_id is not None else tok.eos_id
    encoded = tok.encode_batch(texts)
    pairs = [pair for ids in encoded for pair in rolling_windows(ids, start, limit, stride)]
    nll = -sum(score for score, _ in continuation_scores(model.eval(), pairs, tok.pad_id, batch_size))
    n_tokens, n_bytes = sum(map(len, encoded)), sum(len(t.encode("utf-8")) for t in texts)
    return {
        "tokens": n_tokens,
        "bytes": n_bytes,
        "documents": len(texts),
        "nll_per_token": nll / n_tokens,
        "perplexity": math.exp(nll / n_tokens),
        "bits_per_byte": nll / (math.log(2) * n_bytes),
        "context": limit,
        "stride": stride,
    }
