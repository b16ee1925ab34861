"""The healing benchmark's garbage_corpus scenario: a real mixed corpus and its ground truth.

The built-in corpus (the stdlib's sources, read up to data.max_bytes) cut into documents of a
web/code crawl's size at blank lines, a held-out set of clean documents for evaluation,
and ~3% garbage documents inserted at random positions (a fixed seed) in the training file:
random printable bytes, base64 blobs, hex dumps, runs of random characters from other scripts and
mojibake (UTF-8 read as latin-1 and written back as UTF-8), each as long in UTF-8 bytes as a
clean document drawn at random. Written as JSONL ({"text", "id"}), as a user would point
data.source at a crawl; the clean training file is the same file with the garbage lines left out.

Ground truth: trimtab names a JSONL document FILE:LINE, so a training row's garbage share is
read from the row's token span against the documents' offsets, rebuilt from the run's own
config.yaml and tokenizer exactly as the trainer built them.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import random
import string
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

GARBAGE_SHARE = 0.03  # of the training documents
DOC_BYTES = 1500  # a document: top-level blocks of a file joined until at least this long
EVAL_BYTES = 20_000  # clean documents held out for evaluation (~train.eval_tokens of debug)
KINDS = ("printable", "base64", "hexdump", "unicode", "mojibake")
# other scripts' letters: Cyrillic, Greek, Arabic, Devanagari, Thai, CJK, Hangul
SCRIPTS = ((0x0410, 0x044F), (0x0391, 0x03C9), (0x0621, 0x064A), (0x0905, 0x0939), (0x0E01, 0x0E30))
SCRIPTS += ((0x4E00, 0x9FFF), (0xAC00, 0xD7A3))
MIXED, CLEAN, EVAL = "mixed.jsonl", "clean.jsonl", "eval.jsonl"


def documents(text: str, name: str, size: int = DOC_BYTES) -> list[tuple[str, str]]:
    """A file cut at blank lines into documents of at least `size` bytes (a short tail joins the
    last one): (id, text) pairs, id NAME#k."""
    out, current = [], ""
    for block in text.split("\n\n"):
        current = block if not current else current + "\n\n" + block
        if len(current.encode()) >= size:
            out.append(current)
            current = ""
    if current:
        if out and len(current.encode()) < size // 2:
            out[-1] += "\n\n" + current
        else:
            out.append(current)
    return [(f"{name}#{k}", doc) for k, doc in enumerate(out) if doc.strip()]


def _fit(text: str, n_bytes: int) -> str:
    """The first n_bytes of text in UTF-8, cut back to a whole character."""
    return text.encode()[:n_bytes].decode(errors="ignore")


def garbage(kind: str, n_bytes: int, rng: random.Random) -> str:
    """One garbage document of ~n_bytes UTF-8 bytes, of the kind a web or code crawl picks up."""
    if kind == "printable":  # random printable bytes (a binary file's strings, a corrupt page)
        return "".join(rng.choice(string.printable) for _ in range(n_bytes))
    if kind == "base64":  # an embedded blob, MIME-wrapped at 76 columns
        blob = base64.b64encode(rng.randbytes(n_bytes * 3 // 4)).decode()
        return "\n".join(blob[i : i + 76] for i in range(0, len(blob), 76))[:n_bytes]
    if kind == "hexdump":  # `xxd` output of binary data
        lines, offset = [], 0
        while sum(len(line) + 1 for line in lines) < n_bytes:
            data = rng.randbytes(16)
            words = " ".join(data[i : i + 2].hex() for i in range(0, 16, 2))
            shown = "".join(chr(b) if 32 <= b < 127 else "." for b in data)
            lines.append(f"{offset:08x}: {words}  {shown}")
            offset += 16
        return "\n".join(lines)[:n_bytes]
    if kind == "unicode":  # long runs of random letters from other scripts
        return _fit(_script_words(n_bytes, rng), n_bytes)
    if kind == "mojibake":  # UTF-8 text decoded as latin-1 and written back as UTF-8
        return _fit(_script_words(n_bytes, rng).encode().decode("latin-1"), n_bytes)
    raise ValueError(f"unknown garbage kind {kind!r}")


def _script_words(n_bytes: int, rng: random.Random) -> str:
    words, size = [], 0
    while size < n_bytes:
        lo, hi = rng.choice(SCRIPTS)
        word = "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(2, 9)))
        words.append(word)
        size += len(word.encode()) + 1
    return " ".join(words)


@dataclass
class Corpus:
    mixed: Path  # the training file with the garbage in it
    clean: Path  # the same without the garbage lines
    eval: Path  # held-out clean documents, the eval set of both
    n_clean: int  # training documents
    n_garbage: int
    kinds: dict[str, int]  # garbage documents per kind


def build(out: Path, max_bytes: int, seed: int = 0, share: float = GARBAGE_SHARE) -> Corpus:
    """Write the three JSONL files into `out` from the built-in corpus up to max_bytes."""
    from trimtab.config import DataConfig
    from trimtab.data.sources import read_documents

    docs, _ = read_documents(DataConfig(max_bytes=max_bytes))
    pieces = [piece for doc in docs for piece in documents(doc.text, doc.source)]
    return write(out, pieces, seed, share)


def write(out: Path, pieces: list[tuple[str, str]], seed: int = 0, share: float = GARBAGE_SHARE) -> Corpus:
    """The files from clean (id, text) documents: EVAL_BYTES of them held out, the rest trained
    on, ~share of the mixed file's documents garbage (kinds in turn, lengths drawn from the clean
    documents'), inserted at random positions; the clean documents keep their order."""
    rng = random.Random(seed)
    held, size = set(), 0
    for i in rng.sample(range(len(pieces)), len(pieces)):
        if size >= EVAL_BYTES or len(held) >= len(pieces) // 4:
            break
        held.add(i)
        size += len(pieces[i][1].encode())
    train = [p for i, p in enumerate(pieces) if i not in held]
    n_garbage = max(len(KINDS), round(share * len(train) / (1 - share)))
    lengths = [len(text.encode()) for _, text in train]
    bad = []
    for k in range(n_garbage):
        kind = KINDS[k % len(KINDS)]
        bad.append((f"garbage/{kind}/{k // len(KINDS)}", garbage(kind, rng.choice(lengths), rng)))
    mixed = list(train)
    for at, doc in sorted(zip(rng.sample(range(len(train) + n_garbage), n_garbage), bad)):
        mixed.insert(at, doc)
    out.mkdir(parents=True, exist_ok=True)
    files = {MIXED: mixed, CLEAN: train, EVAL: [p for i, p in enumerate(pieces) if i in held]}
    for name, rows in files.items():
        with open(out / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": text, "id": doc_id}) + "\n" for doc_id, text in rows)
    kinds = {kind: sum(doc_id.split("/")[1] == kind for doc_id, _ in bad) for kind in KINDS}
    return Corpus(out / MIXED, out / CLEAN, out / EVAL, len(train), n_garbage, kinds)


def prepare(where: Path, max_bytes: int, epochs: float, preset: str, seed: int = 1) -> dict[str, Any]:
    """The corpus files in `where`, a tokenizer trained on the clean text (training and held-out
    documents, as the clean run alone would train it; shared by every run so eval losses compare
    token for token), and what the runs need: sets (the mixed run's --set items), clean_sets (the
    clean reference's), steps (`epochs` passes over the mixed training rows) and the row counts."""
    from trimtab.config import load_config
    from trimtab.data.packing import build_splits
    from trimtab.data.sources import read_documents
    from trimtab.data.tokenizer import get_tokenizer
    from trimtab.paths import cache_dir

    where = Path(where).resolve()
    corpus = build(where, max_bytes)
    cfg = load_config(preset=preset)
    data = replace(cfg.data, source=str(corpus.clean), eval_source=str(corpus.eval), max_bytes=0, tokenizer="")
    clean_docs, held = read_documents(data)[0], read_documents(data, data.eval_source)[0]
    tok = get_tokenizer(data, clean_docs + held, cache_dir())
    tok.save(where / "tokenizer.json")
    mixed = replace(data, source=str(corpus.mixed))
    rows, _ = build_splits(mixed, tok, read_documents(mixed)[0], held, seed)
    counted = shares(rows, ids_by_source(corpus.mixed))
    common = (f"data.eval_source={corpus.eval}", "data.max_bytes=0", f"data.tokenizer={where / 'tokenizer.json'}")
    per_epoch = rows.n_tokens / cfg.train.batch_tokens
    screened = screen_score(mixed, tok, cfg.data.garbage_sigma)
    return {
        "screen": screened,
        "corpus": corpus,
        "sets": (f"data.source={corpus.mixed}", *common),
        "clean_sets": (f"data.source={corpus.clean}", *common),
        "steps": math.ceil(epochs * per_epoch),
        "steps_per_epoch": per_epoch,
        "rows": counted["rows"],
        "bad": len(counted["bad"]),
        "touched": len(counted["touched"]),
        "n_eval": sum(1 for _ in open(corpus.eval, encoding="utf-8")),
    }


def screen_score(data: Any, tok: Any, sigma: float) -> dict[str, Any]:
    """The garbage screen (data/quality.py) on the mixed file's documents, as a run with
    data.garbage_filter=drop applies it: documents flagged, against the garbage ones, with
    precision and recall and the flagged share of each garbage kind."""
    import numpy as np

    from trimtab.data import quality
    from trimtab.data.sources import read_documents

    docs = read_documents(data)[0]
    ids = ids_by_source(Path(data.source))
    n_bytes = np.array([len(doc.text.encode()) for doc in docs])
    texts = [doc.text for doc in docs]  # tokens counted as trained: start token, text, end token
    n_tokens = np.array([len(t) + 1 + tok.prepends_bos(text) for t, text in zip(tok.encode_batch(texts), texts)])
    found = quality.screen(n_bytes, n_tokens, sigma)
    bad = np.array([is_garbage(ids.get(doc.source, "")) for doc in docs])
    hit = found.flagged & bad
    kinds = {k: [ids.get(d.source, "").split("/")[1] == k for d in docs] for k in KINDS}
    return {
        "flagged": found.count,
        "garbage": int(bad.sum()),
        "precision": float(hit.sum() / found.count) if found.count else None,
        "recall": float(hit.sum() / bad.sum()) if bad.any() else None,
        "threshold": found.threshold,
        "by_kind": {k: f"{int((found.flagged & np.array(m)).sum())}/{sum(m)}" for k, m in kinds.items()},
    }


def describe(prepared: dict[str, Any], max_bytes: int) -> str:
    """The setup cell of the report."""
    c: Corpus = prepared["corpus"]
    kinds = ", ".join(f"{kind} {n}" for kind, n in c.kinds.items())
    screen = prepared["screen"]
    return (
        f"{c.n_garbage} garbage documents ({kinds}) at random places among {c.n_clean} of the built-in corpus "
        f"(its first {max_bytes / 1000:g} KB cut at blank lines into ~{DOC_BYTES / 1000:g} KB documents), one JSONL "
        f"file: {prepared['bad']} of {prepared['rows']} training rows mostly garbage; "
        f"{prepared['steps']} steps ({prepared['steps'] / prepared['steps_per_epoch']:.1f} epochs); eval on "
        f"{prepared['n_eval']} held-out clean documents, one tokenizer trained on the clean text; the garbage "
        f"screen (data.garbage_filter, threshold {screen['threshold']:.2f}x the median bytes per token) flags "
        f"{screen['flagged']} documents, precision {_fraction(screen['precision'])}, recall "
        f"{_fraction(screen['recall'])} ({', '.join(f'{k} {v}' for k, v in screen['by_kind'].items())})"
    )


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def is_garbage(doc_id: str) -> bool:
    return doc_id.startswith("garbage/")


def ids_by_source(path: Path) -> dict[str, str]:
    """Each JSONL document's id under the name trimtab gives it (FILE:LINE, Document.source)."""
    with open(path, encoding="utf-8") as f:
        return {f"{path}:{n}": json.loads(line)["id"] for n, line in enumerate(f, 1) if line.strip()}


def truth(run_dir: Path) -> dict[str, Any]:
    """The run's training rows rebuilt from its config.yaml and tokenizer (build_phases, as the
    trainer built them) and each row's share of tokens from garbage documents: rows (all), bad
    (at least half garbage: what must be left out), touched (any garbage: leaving one out is no
    false alarm) and the number of training steps an epoch takes."""
    from trimtab.config import load_config
    from trimtab.training.phase_data import build_phases

    cfg = load_config(Path(run_dir) / "config.yaml")
    quiet = logging.getLogger("trimtab.data")  # the run said it already (the garbage screen's line)
    level, _ = quiet.level, quiet.setLevel(logging.ERROR)
    try:
        _, phases = build_phases(cfg, Path(run_dir) / "tokenizer.json")
    finally:
        quiet.setLevel(level)
    rows = phases[0].train_rows
    ids = ids_by_source(Path(cfg.data.source))
    return shares(rows, ids) | {"steps_per_epoch": rows.n_tokens / cfg.train.batch_tokens}


def shares(rows: Any, ids: dict[str, str]) -> dict[str, Any]:
    """bad / touched row indices of `rows` (a Rows with its documents) given the id of each
    document source."""
    import numpy as np

    docs = rows.docs
    per_token = np.repeat(np.array([is_garbage(ids.get(s, "")) for s in docs.sources]), np.diff(docs.offsets))
    counts = np.concatenate([[0], np.cumsum(per_token, dtype=np.int64)])
    # a row's targets are tokens starts+1 .. starts+lengths
    garbage_targets = counts[rows.starts + rows.lengths + 1] - counts[rows.starts + 1]
    share = garbage_targets / rows.lengths
    return {
        "rows": len(rows),
        "bad": sorted(int(i) for i in np.flatnonzero(share >= 0.5)),
        "touched": sorted(int(i) for i in np.flatnonzero(share > 0)),
    }
