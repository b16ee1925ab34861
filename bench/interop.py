"""Export and import speed and memory of a 1B-class model, against transformers' own.

    python bench/interop.py [--preset dense-1b] [--reps 10] [--rss-reps 1] [--work DIR] [--dry-run]

A run directory holding a random `dense-1b`-shaped checkpoint (fp32, 1.1B parameters, 4.4 GB)
is made once. Four operations:

    trimtab export       trimtab.hf.export_run(run, out): checkpoint -> LlamaForCausalLM directory
    trimtab import       trimtab.hf.import_model(out): that directory -> a trimtab model
    transformers load    AutoModelForCausalLM.from_pretrained(out)
    transformers save    the loaded model's save_pretrained(dir)

A load ends when every weight has been read once (a sum over each parameter): transformers 5
maps safetensors files lazily, so its from_pretrained alone returns in 0.05 s and the reading
falls into whatever touches the weights first (its save, a forward).

Time: all four in this one process, `--reps` rounds, each round the four in turn (the order of
each trimtab / transformers pair alternating between rounds), so a ratio pairs operations run
at the same moments of the machine; on this shared 2-core host one operation swings up to 1.8x
between processes. Memory: each operation in a fresh process `--rss-reps` times (its peak RSS
is then its own), beside the model's bytes (goal: <= 1.2x); it repeats to a few MB. Results go
to the "Hugging Face export and import" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _benchfile import publish, scratch  # noqa: E402  bench/_benchfile.py, next to this file
from _measure import Contention, paired_ratio, run_python  # noqa: E402

HEADING = "## Hugging Face export and import (bench/interop.py)"
OPS = ("trimtab export", "trimtab import", "transformers load", "transformers save")

# Each child runs one operation and emits its peak RSS in bytes (bench/ is on its path: run_python).
CHILD = """
import warnings
warnings.simplefilter("ignore")
from _measure import emit
from interop import one_operation
from trimtab.training.runtime import peak_rss_mb
one_operation({op!r}, {run!r}, {out!r}, {tmp!r})
emit({{"peak_rss": peak_rss_mb() * 2**20}})
"""


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _touched(model):
    """`model` after reading every weight once (the module docstring: a lazily mapped file is read here)."""
    for p in model.parameters():
        p.sum()
    return model


def hf_load(out: Path):
    return _touched(_transformers().AutoModelForCausalLM.from_pretrained(out))


def trimtab_load(out: Path):
    from trimtab import hf

    return _touched(hf.import_model(out)[0])


def one_operation(op: str, run: Path, out: Path, tmp: Path) -> None:
    from trimtab import hf

    if op == "trimtab export":
        hf.export_run(run, out)
    elif op == "trimtab import":
        trimtab_load(out)
    elif op == "transformers load":
        hf_load(out)
    else:
        hf_load(out).save_pretrained(tmp)


def make_run(preset: str, work: Path) -> tuple[Path, int]:
    """A run directory with one random checkpoint of `preset`'s model; returns it and the weights' bytes."""
    import torch

    from trimtab.checkpoint import save_checkpoint
    from trimtab.config import derive, dump_config, load_config
    from trimtab.data.sources import Document
    from trimtab.data.tokenizer import TextTokenizer, _train_bpe
    from trimtab.model.catalog import uninitialised

    cfg = load_config(preset=preset, overrides={"out": str(work / "run")})
    cfg = derive(cfg, {"model": {"vocab_size": cfg.model.vocab_size or cfg.data.bpe_vocab_size}})
    model = uninitialised(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    run = Path(cfg.out)
    run.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run / "config.yaml")
    docs = [Document([(f"def f{i}(x):\n    return x * {i}\n", True)]) for i in range(200)]
    TextTokenizer(_train_bpe(docs, 300)).save(run / "tokenizer.json")
    save_checkpoint(run, 0, model.state_dict(), {}, {"moe": {}, "mod": {}, "tokens": 0}, keep=1)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return run, size


def peak_rss(op: str, run: Path, out: Path, tmp: Path, fresh: bool = True) -> float:
    """Peak RSS in bytes of `op` run alone in a fresh process (fresh=False, a dry run: the child's
    code run in this process, whose peak it reports: checked that it runs, not measured)."""
    code = CHILD.format(op=op, run=str(run), out=str(out), tmp=str(tmp))
    result = run_python(code, op, fresh=fresh)
    shutil.rmtree(tmp, ignore_errors=True)
    return result["peak_rss"]


def time_rounds(run: Path, out: Path, tmp: Path, reps: int) -> tuple[dict[str, list[float]], float]:
    """Seconds of each operation over `reps` rounds in this process, and the CPU share other
    processes took meanwhile."""
    import gc

    from trimtab import hf

    secs: dict[str, list[float]] = {op: [] for op in OPS}

    def timed(op, f):
        t0 = time.perf_counter()
        kept = f()
        secs[op].append(time.perf_counter() - t0)
        return kept

    def save_pair():
        hf_model = timed("transformers load", lambda: hf_load(out))
        timed("transformers save", lambda: hf_model.save_pretrained(tmp))
        shutil.rmtree(tmp, ignore_errors=True)

    def export():
        shutil.rmtree(out, ignore_errors=True)
        timed("trimtab export", lambda: hf.export_run(run, out))

    hf.export_run(run, out)  # a directory for the first load, and a warm-up
    with Contention() as busy:
        for rep in range(reps):
            for step in (export, save_pair) if rep % 2 == 0 else (save_pair, export):
                step()
                gc.collect()
            timed("trimtab import", lambda: trimtab_load(out))
            gc.collect()
            print(f"round {rep}: " + ", ".join(f"{op} {v[-1]:.1f}s" for op, v in secs.items()), flush=True)
    return secs, busy.other


def report(secs: dict[str, list[float]], rss: dict[str, float], size: int, preset: str) -> str:
    reps = len(secs[OPS[0]])
    lines = [
        f"`{preset}` shape, fp32 weights of {size / 1e9:.2f} GB. Time: {reps} rounds of the four operations in "
        "one process (the header's CPU share: other processes' meanwhile); peak RSS: each operation in a fresh "
        "process.",
        "",
        "| operation | median s | min-max s | peak RSS GB | RSS / model bytes |",
        "|---|---|---|---|---|",
    ]
    for op in OPS:
        s = secs[op]
        lines.append(
            f"| {op} | {statistics.median(s):.2f} | {min(s):.2f}-{max(s):.2f} | {rss[op] / 1e9:.2f} | "
            f"{rss[op] / size:.2f}x |"
        )
    lines.append("")
    for name, (a, b) in {
        "trimtab export / transformers save": ("trimtab export", "transformers save"),
        "trimtab import / transformers load": ("trimtab import", "transformers load"),
    }.items():
        ratio = paired_ratio(secs[a], secs[b])  # seconds: below 1 is faster than transformers
        lines.append(f"- {name}, time: **{ratio}**; as parity: {ratio.within(0.05)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="dense-1b")
    parser.add_argument("--reps", type=int, default=10, help="rounds of the four operations, timed in one process")
    parser.add_argument("--rss-reps", type=int, default=1, help="fresh processes per operation for its peak RSS")
    parser.add_argument("--work", help="scratch directory (default: a temp dir, removed after)")
    parser.add_argument("--dry-run", action="store_true", help="the debug preset, 2 rounds, nothing written")
    args = parser.parse_args()
    if args.dry_run:
        args.preset, args.reps, args.rss_reps = "debug", 2, 1
    with scratch(args.work, "trimtab-interop-") as work:
        run, size = make_run(args.preset, work)
        out, tmp = work / "hf", work / "saved"
        secs, other = time_rounds(run, out, tmp, args.reps)
        fresh = not args.dry_run
        rss = {op: max(peak_rss(op, run, out, tmp, fresh) for _ in range(args.rss_reps)) for op in OPS}
        body = report(secs, rss, size, args.preset)
        publish(HEADING, body, precision="fp32 weights", other_cpu=other, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
