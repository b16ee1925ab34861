"""Export and import speed and memory of a 1B-class model, against transformers' own.

    python bench/interop.py [--preset dense-1b] [--reps 3] [--work DIR]

A run directory holding a random `dense-1b`-shaped checkpoint (fp32, 1.1B parameters, 4.4 GB)
is made once. Then, each in a fresh process (so peak RSS is that operation's alone) and
interleaved `--reps` times:

    trimtab export       trimtab.hf.export_run(run, out): checkpoint -> LlamaForCausalLM directory
    trimtab import       trimtab.hf.load_model(out): that directory -> a trimtab model
    transformers load    AutoModelForCausalLM.from_pretrained(out)
    transformers save    the loaded model's save_pretrained(dir) (load time subtracted)

Wall time is the operation's alone (the process start-up and imports are not counted); peak RSS
is the process's maximum resident set, reported beside the model's bytes (goal: <= 1.2x). The
CPU share other processes took is recorded per operation. Results go to the "Hugging Face export
and import" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _benchfile import replace_section, scratch  # noqa: E402  bench/_benchfile.py, next to this file
from _measure import Contention  # noqa: E402

HEADING = "## Hugging Face export and import (bench/interop.py)"
OPS = ("trimtab export", "trimtab import", "transformers load", "transformers save")

# Each child times its own operation and reports (seconds, peak RSS bytes) as its last line.
CHILD = """
import json, resource, sys, time, warnings
sys.path.insert(0, {src!r})
op, run, out, tmp = {op!r}, {run!r}, {out!r}, {tmp!r}
warnings.simplefilter("ignore")
if op.startswith("transformers"):
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
else:
    from trimtab import hf
t0 = time.perf_counter()
if op == "trimtab export":
    hf.export_run(run, out)
elif op == "trimtab import":
    hf.load_model(out)
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    if op == "transformers save":
        t0 = time.perf_counter()
        model.save_pretrained(tmp)
seconds = time.perf_counter() - t0
print(json.dumps([seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))
"""


def make_run(preset: str, work: Path) -> tuple[Path, int]:
    """A run directory with one random checkpoint of `preset`'s model; returns it and the weights' bytes."""
    import torch

    from trimtab.checkpoint import save_checkpoint
    from trimtab.config import dump_config, load_config
    from trimtab.data.sources import Document
    from trimtab.data.tokenizer import TextTokenizer, _train_bpe
    from trimtab.model.catalog import uninitialised

    cfg = load_config(preset=preset, overrides={"out": str(work / "run")})
    cfg.model.vocab_size = cfg.model.vocab_size or cfg.data.bpe_vocab_size
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


def measure(op: str, run: Path, out: Path, tmp: Path) -> dict:
    code = CHILD.format(src=str(ROOT / "src"), op=op, run=str(run), out=str(out), tmp=str(tmp))
    with Contention() as busy:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{op} failed:\n{proc.stderr[-3000:]}")
    seconds, rss = json.loads(proc.stdout.strip().splitlines()[-1])
    shutil.rmtree(tmp, ignore_errors=True)
    return {"op": op, "seconds": seconds, "rss": rss, "other_cpu": busy.other}


def report(rows: list[dict], size: int, preset: str, reps: int) -> str:
    lines = [
        HEADING,
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, `{preset}` shape, fp32 weights of {size / 1e9:.2f} GB, {reps} reps "
        "interleaved, each operation in a fresh process (its wall time excludes start-up and imports).",
        "",
        "| operation | median s | min-max s | peak RSS GB | RSS / model bytes | other CPU |",
        "|---|---|---|---|---|---|",
    ]
    for op in OPS:
        mine = [r for r in rows if r["op"] == op]
        secs = [r["seconds"] for r in mine]
        rss = max(r["rss"] for r in mine)
        other = statistics.median(r["other_cpu"] for r in mine)
        lines.append(
            f"| {op} | {statistics.median(secs):.1f} | {min(secs):.1f}-{max(secs):.1f} | {rss / 1e9:.2f} | "
            f"{rss / size:.2f}x | {other:.0%} |"
        )
    ratios = {
        "export vs transformers save": ("trimtab export", "transformers save"),
        "import vs transformers load": ("trimtab import", "transformers load"),
    }
    lines.append("")
    for name, (a, b) in ratios.items():
        pairs = [x["seconds"] / y["seconds"] for x, y in zip(_of(rows, a), _of(rows, b))]
        lines.append(
            f"- {name}: time ratio median {statistics.median(pairs):.2f} (per rep {min(pairs):.2f}-{max(pairs):.2f}); "
            "below 1 is faster than transformers"
        )
    return "\n".join(lines) + "\n"


def _of(rows: list[dict], op: str) -> list[dict]:
    return [r for r in rows if r["op"] == op]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="dense-1b")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work", help="scratch directory (default: a temp dir, removed after)")
    args = parser.parse_args()
    with scratch(args.work, "trimtab-interop-") as work:
        run, size = make_run(args.preset, work)
        out, tmp = work / "hf", work / "saved"
        rows = []
        for rep in range(args.reps):
            for op in OPS:
                rows.append(measure(op, run, out, tmp))
                print(f"rep {rep}: {op} {rows[-1]['seconds']:.1f}s rss {rows[-1]['rss'] / 1e9:.2f} GB", flush=True)
        section = report(rows, size, args.preset, args.reps)
        print(section)
        replace_section(ROOT / "BENCHMARKS.md", HEADING, section)


if __name__ == "__main__":
    main()
