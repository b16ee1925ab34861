"""One large document (a log, a book dump: one .txt file) through the data path: its peak memory against its size.

    python bench/bigdoc.py [--sizes 10e6 50e6] [--work DIR] [--dry-run]

Each size is one plain-text file of English (docstring paragraphs of a few standard modules, each repeated with a
few of its words swapped by a seeded RNG, a blank line between: the junk screen judges it as real text), read in a
fresh process each way:
- training's in-memory path (data.max_bytes=0): read, a BPE trained on it (data.bpe_vocab_size), tokenized and
  screened for garbage and junk, held out and cut into rows (data/packing.py build_splits), as `trimtab train`;
- `trimtab data prepare` of the file with that BPE (--tokenizer), one worker.
Peak RSS (VmHWM, Linux) and what it grew by over the process's start (its imports), as a multiple of the file's bytes,
and the CPU seconds. Results go to the "One large document" section of BENCHMARKS.md (`--dry-run`: 1 MB, printed
only).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _benchfile import publish  # noqa: E402  bench/_benchfile.py, next to this file
from _measure import run_python  # noqa: E402

HEADING = "## One large document (bench/bigdoc.py)"
CHILD = """
import logging, shutil, time
from pathlib import Path
from _measure import emit

def rss_mb(field="VmHWM"):  # this process's own peak (ru_maxrss keeps the parent's across exec) or now (VmRSS)
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024

from trimtab.config import DataConfig
from trimtab.data.packing import build_splits
from trimtab.data.prepare import prepare
from trimtab.data.sources import read_documents
from trimtab.data.tokenizer import TextTokenizer, train_tokenizer
logging.disable(logging.WARNING)
start, cpu = rss_mb("VmRSS"), time.process_time()
path, tok = Path({path!r}), Path({tok!r})
if {way!r} == "train":
    cfg = DataConfig(source=str(path), max_bytes=0)
    docs, _ = read_documents(cfg)
    tokenizer = train_tokenizer(docs, cfg.bpe_vocab_size)
    tokenizer.save(tok)
    build_splits(cfg, tokenizer, docs, None, 0, None, "data.source", True, str(path))
else:
    out = path.parent / "prepared"
    shutil.rmtree(out, ignore_errors=True)
    prepare([str(path)], out, str(tok), workers=1)
emit({{"peak": rss_mb(), "start": start, "cpu": time.process_time() - cpu}})
"""


def make_text(size: int, seed: int = 0) -> str:
    """About `size` characters of English: docstring paragraphs of a few standard modules, each repeated with a few
    of its words swapped, a blank line between (as tests/test_big_document.py makes it)."""
    import collections
    import json
    import logging
    import os
    import random
    import re
    import subprocess

    docs = [getattr(m, n).__doc__ for m in (os, re, json, subprocess, collections, logging) for n in dir(m)]
    paragraphs = sorted({" ".join(p.split()) for d in docs if isinstance(d, str) for p in d.split("\n\n")})
    paragraphs = [p for p in paragraphs if len(p) > 200 and sum(c.isalpha() or c == " " for c in p) > 0.9 * len(p)]
    rng, parts, total = random.Random(seed), [], 0
    while total < size:
        words = rng.choice(paragraphs).split(" ")
        for _ in range(rng.randint(1, 5)):
            words[rng.randrange(len(words))] = rng.choice(words)
        parts.append(" ".join(words) + "\n\n")
        total += len(parts[-1])
    return "".join(parts)[:size]


def measure(work: Path, size: int) -> list[dict]:
    path, tok = work / f"doc-{size}.txt", work / "tokenizer.json"
    path.write_text(make_text(size))
    rows = []
    for way in ("train", "prepare"):  # prepare reads the BPE the training path trained
        result = run_python(CHILD.format(path=str(path), tok=str(tok), way=way), f"bigdoc {way} {size}")
        rows.append({"way": way, "size": size, **result})
    return rows


def report(rows: list[dict]) -> str:
    lines = [
        "| document | path | peak RSS (MB) | over its start (MB) | x the document | CPU (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        grown = r["peak"] - r["start"]
        way = "in memory (a run)" if r["way"] == "train" else "data prepare"
        lines.append(
            f"| {r['size'] / 1e6:g} MB | {way} | {r['peak']:.0f} | {grown:.0f} | "
            f"{grown * 2**20 / r['size']:.1f} | {r['cpu']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[10e6, 50e6])
    parser.add_argument("--work", type=Path, default=None, help="where the files go (default: a temporary folder)")
    parser.add_argument("--dry-run", action="store_true", help="1 MB; print only")
    args = parser.parse_args()
    sizes = [1_000_000] if args.dry_run else [int(s) for s in args.sizes]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = [row for size in sizes for row in measure(work, size)]
    other = [r["other_cpu"] for r in rows]
    publish(HEADING, report(rows), precision="n/a (no model)", other_cpu=other, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
