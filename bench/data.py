"""Data at scale: prepare throughput, memory over corpus size, and the loader's share of a step.

    python bench/data.py [--small 10e6] [--large 100e6] [--prepare-reps 12] [--reps 3] [--steps 30] [--work DIR]

1. `trimtab data prepare` against `datasets.map` (batched, num_proc = cores) with the same fast
   tokenizer (transformers' PreTrainedTokenizerFast over the same tokenizer.json), on the same
   JSONL files; both write their output to disk (shards / Arrow cache). `--prepare-reps`
   repetitions, each one of both back to back (which goes first alternates); tokens per second,
   and the paired ratio with its 95% interval and a parity verdict (the same within 5%?).
2. Peak RSS of `trimtab train --preset small` on a prepared corpus of `--small` and `--large`
   tokens (fresh processes, the metrics' peak_rss_mb): memory must not grow with the corpus.
3. The loader's time per step (BatchLoader.next_batch on the large prepared corpus) against the
   step time of those runs.

The corpus is Python's standard library (the built-in training data) copied with a numbered
header per copy until it holds the wanted tokens. Results go to the "Data at scale" section of
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _benchfile import publish  # noqa: E402  bench/_benchfile.py, next to this file
from _measure import Contention, paired_ratio, run_python, run_train  # noqa: E402
from trimtab.config import DataConfig  # noqa: E402
from trimtab.data.batches import BatchLoader  # noqa: E402
from trimtab.data.prepare import prepare  # noqa: E402
from trimtab.data.prepared import PreparedData, ShardedRows  # noqa: E402
from trimtab.data.sources import read_documents  # noqa: E402

HEADING = "## Data at scale (bench/data.py)"
PRECISIONS: set[str] = set()  # what train.precision auto resolved to in the training runs
BYTES_PER_TOKEN = 3.3  # measured for the stdlib with the 4096-token BPE (refined from the first prepare)


def make_corpus(folder: Path, tokens: float) -> None:
    """JSONL files of ~64 MB: the stdlib's documents, each copy under its own header line."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = [d.text for d in read_documents(DataConfig(max_bytes=0))[0]]
    target, written, copy, part = tokens * BYTES_PER_TOKEN, 0, 0, 0
    fh = open(folder / f"part-{part:03d}.jsonl", "w")
    while written < target:
        for text in docs:
            line = json.dumps({"text": f"# copy {copy}\n{text}"}) + "\n"
            fh.write(line)
            written += len(line)
            if fh.tell() > 64 << 20:
                fh.close()
                part += 1
                fh = open(folder / f"part-{part:03d}.jsonl", "w")
            if written >= target:
                break
        copy += 1
    fh.close()


def time_prepare(src: Path, out: Path, tokenizer: Path | None) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    manifest = prepare([str(src)], out, tokenizer=str(tokenizer) if tokenizer else None)
    return time.perf_counter() - start, manifest["tokens"]


def time_datasets(src: Path, tokenizer: Path, cache: Path) -> tuple[float, int]:
    """datasets.map with the fast tokenizer, in a fresh process (its imports and cache count)."""
    shutil.rmtree(cache, ignore_errors=True)
    code = f"""
import os, time, datasets
from transformers import PreTrainedTokenizerFast
from _measure import emit
start = time.perf_counter()
tok = PreTrainedTokenizerFast(tokenizer_file={str(tokenizer)!r})
ds = datasets.load_dataset("json", data_files={str(src / "*.jsonl")!r}, split="train", cache_dir={str(cache)!r})
ids = ds.map(lambda b: tok(b["text"]), batched=True, num_proc=os.cpu_count(), remove_columns=["text"])
n = sum(len(x) for x in ids.with_format("numpy")["input_ids"])
emit({{"seconds": time.perf_counter() - start, "tokens": int(n)}})
"""
    done = run_python(code, "datasets.map")
    return done["seconds"], done["tokens"]


def train_rss(data: Path, out: Path, steps: int) -> tuple[float, float]:
    """(peak RSS MB, median step seconds) of `trimtab train --preset small` on a prepared corpus."""
    shutil.rmtree(out, ignore_errors=True)
    sets = [f"data.source={data}", "log.progress=false", "log.tensorboard=false", "train.eval_every=0"]
    sets += ["checkpoint.every=0", "train.log_every=5"]
    args = ["--preset", "small", "--max-steps", str(steps), *[x for s in sets for x in ("--set", s)]]
    done = run_train(args, out, f"trimtab train on {data.name}")
    PRECISIONS.add(done["summary"]["precision"])
    logged = [m for m in done["metrics"] if "peak_rss_mb" in m]
    return max(m["peak_rss_mb"] for m in logged), statistics.median(m["step_time"] for m in logged[1:])


def loader_seconds(data: Path, steps: int = 200) -> float:
    """Median seconds of BatchLoader.next_batch for `small`'s step (8192 tokens of 256)."""
    rows = ShardedRows(PreparedData(data, verify=False), 256, True, "train", 0.02)
    loader = BatchLoader(rows, 8192, 8192, seed=0, pad_id=0)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loader.next_batch()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", type=float, default=10e6)
    p.add_argument("--large", type=float, default=100e6)
    p.add_argument("--prepare-reps", type=int, default=12, help="repetitions of the prepare comparison")
    p.add_argument("--reps", type=int, default=3, help="training runs per corpus size (peak RSS)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--work", type=Path)
    p.add_argument("--dry-run", action="store_true", help="2e5 / 1e6 tokens, 1 rep of each part, 11 steps; print only")
    args = p.parse_args()
    if args.dry_run:
        args.small, args.large, args.prepare_reps, args.reps, args.steps = 2e5, 1e6, 2, 1, 11
    work = args.work or Path(tempfile.mkdtemp(prefix="trimtab-bench-data-"))
    with Contention() as busy:
        section = measure(args, work)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    precision = ", ".join(sorted(PRECISIONS)) + " (training runs)"
    publish(HEADING, section, precision=precision, other_cpu=busy.other, dry_run=args.dry_run)


def measure(args: argparse.Namespace, work: Path) -> str:
    """The three measurements; the section's body."""
    small_src, large_src = work / "src-small", work / "src-large"
    for folder, tokens in ((small_src, args.small), (large_src, args.large)):
        if not folder.exists():
            make_corpus(folder, tokens)
    _, n_large = time_prepare(large_src, work / "large", None)  # trains the BPE; the large corpus for 2 and 3
    tokenizer = work / "large" / "tokenizer.json"
    ours, theirs = [], []
    for rep in range(args.prepare_reps):
        for ours_now in (True, False) if rep % 2 == 0 else (False, True):
            if ours_now:
                seconds, n = time_prepare(small_src, work / "small", tokenizer)
                ours.append(n / seconds)
            else:
                seconds_ds, n_ds = time_datasets(small_src, tokenizer, work / "ds-cache")
                theirs.append(n_ds / seconds_ds)
    ratio = paired_ratio(ours, theirs)  # tokens/s: above 1 is faster than datasets.map
    rss = {"small": [], "large": []}
    step_times = []
    for _ in range(args.reps):
        for name in ("small", "large"):
            peak, step = train_rss(work / name, work / f"run-{name}", args.steps)
            rss[name].append(peak)
            step_times.append(step)
    loader = loader_seconds(work / "large")
    step = statistics.median(step_times)
    growth = statistics.median(rss["large"]) / statistics.median(rss["small"]) - 1
    cores = os.cpu_count()
    command = f"python bench/data.py --small {args.small:.0e} --large {args.large:.0e}"
    command += f" --prepare-reps {args.prepare_reps} --reps {args.reps}"
    return f"""`{command}`. Corpus: the standard library copied under numbered headers,
JSONL; tokenizer: the 4096-token BPE prepare trained on it. {n_large:,} tokens in the large corpus.

Prepare throughput on the small corpus ({n:,} tokens), tokens/s, median (min-max) of {args.prepare_reps} repetitions,
each one of both back to back (which went first alternating):

| | tokens/s |
|---|---|
| `trimtab data prepare` (shards + manifest) | {spread(ours)} |
| `datasets.map(tok, batched=True, num_proc={cores})` (Arrow cache) | {spread(theirs)} |

- prepare / datasets.map, tokens/s: **{ratio}**; as parity: {ratio.within(0.05)}

Peak RSS of `trimtab train --preset small --max-steps {args.steps}` on prepared data ({args.reps} runs
each, interleaved): {args.small:.0e} tokens {", ".join(f"{v:.0f}" for v in rss["small"])} MB; {args.large:.0e} tokens
{", ".join(f"{v:.0f}" for v in rss["large"])} MB: **{growth:+.1%}** for {args.large / args.small:.0f}x the corpus
(goal within 5%).

Loader: `BatchLoader.next_batch` on the large corpus {loader * 1e3:.2f} ms per step (median of 200)
against a step of {step:.2f} s: **{loader / step:.2%}** of the step (goal under 2%).
"""


if __name__ == "__main__":
    main()
