"""`trimtab eval PATH --data FILE`: perplexity and bits per byte of a text file, no lm-eval needed.

perplexity     exp(total NLL / tokens): depends on the tokenizer
bits per byte  total NLL / (ln 2 * UTF-8 bytes): comparable across tokenizers (Gao et al.
               2020, The Pile, section 3.1; lm-evaluation-harness's bits_per_byte)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trimtab.data import TextTokenizer
from trimtab.errors import DataError
from trimtab.evaluation.scoring import continuation_scores, rolling_windows
from trimtab.model import Transformer


def read_text(path: str | Path) -> str:
    """The file's text; DataError naming it when missing, a directory, empty or not UTF-8 text."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"--data '{path}' is a directory; pass one text file (e.g. one of its files)")
    if not path.is_file():
        raise DataError(f"--data '{path}' does not exist; pass a text file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"--data '{path}': not UTF-8 text (byte {exc.start}); convert it to UTF-8") from None
    if "\x00" in text:
        raise DataError(f"--data '{path}': holds NUL bytes, so it is binary, not text")
    if not text.strip():
        raise DataError(f"--data '{path}' is empty; pass a file with text")
    return text


def score_text(
    model: Transformer, tok: TextTokenizer, text: str, stride: int | None = None, batch_size: int = 8
) -> dict[str, Any]:
    """NLL of every token of `text` (the first one after the start token, bos or eos), in
    model.cfg.max_seq_len windows advancing by `stride` (default: the whole window)."""
    limit = model.cfg.max_seq_len
    stride = stride or limit
    if not 0 < stride <= limit:
        raise DataError(f"--stride {stride} must be in [1, {limit}] (the model's context)")
    ids = tok.encode(text)
    start = tok.bos_id if tok.bos_id is not None else tok.eos_id
    pairs = rolling_windows(ids, start, limit, stride)
    nll = -sum(score for score, _ in continuation_scores(model.eval(), pairs, tok.pad_id, batch_size))
    n_bytes = len(text.encode("utf-8"))
    return {
        "tokens": len(ids),
        "bytes": n_bytes,
        "nll_per_token": nll / len(ids),
        "perplexity": math.exp(nll / len(ids)),
        "bits_per_byte": nll / (math.log(2) * n_bytes),
        "context": limit,
        "stride": stride,
    }
