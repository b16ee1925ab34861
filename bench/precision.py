"""bf16 autocast vs fp32 on this CPU, per preset: what train.precision auto decides with.

    python bench/precision.py [--presets debug debug-moe small] [--steps 10] [--reps 5] [--dry-run]

A CPU with native bf16 (AVX512-BF16, AMX) runs large bf16 matmuls about 2x fp32's, but a training
step is more than large matmuls (training/services/cpu_precision.py). This times each preset's step
(forward, trimtab's loss, backward; a micro-batch of random tokens at the preset's shape) in fp32
and in bf16 autocast, alternating step by step in one process per repetition so both see the
same moments of the machine, and reports bf16's speed-up (fp32 step time over bf16's, paired by
repetition, median with a bootstrap 95% interval) next to what train.precision auto chose for the
preset (its probe: a shorter, cached version of this measurement). Results go to the "bf16
autocast on this CPU" section of BENCHMARKS.md (`--dry-run`: debug only, 1 rep, printed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _benchfile import publish  # bench/_benchfile.py, next to this file
from _measure import emit, paired_ratio, run_child

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## bf16 autocast on this CPU (bench/precision.py)"


def child(args: argparse.Namespace) -> None:
    """One preset, one repetition: warm-up, then steps alternating fp32 / bf16; a RESULT line."""
    import torch

    from throughput import _batches  # resolves the vocabulary from the built-in data
    from trimtab.config import load_config
    from trimtab.hardware import choose_precision
    from trimtab.model import build_model
    from trimtab.training.services.cpu_precision import _step_seconds, refine_cpu_precision

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(preset=args.preset, overrides={"out": out}, sets=["train.precision=auto"])
        cfg, _ = _batches(cfg, 0)  # the tokenizer's vocabulary
        torch.manual_seed(0)
        model = build_model(cfg.model).train()
        chosen = refine_cpu_precision(choose_precision(torch.device("cpu"), "auto"), cfg, model)
        rows = max(1, cfg.train.micro_budget // cfg.data.seq_len)
        tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.data.seq_len + 1))
        times: dict[str, list[float]] = {"fp32": [], "bf16": []}
        for i in range(1 + args.steps):  # the first round warms up
            for name in ("fp32", "bf16") if i % 2 else ("bf16", "fp32"):
                seconds = _step_seconds(model, tokens, torch.bfloat16 if name == "bf16" else None)
                times[name] += [seconds] if i else []
    result = {name: statistics.median(t) for name, t in times.items()}
    emit({**result, "tokens": tokens[:, 1:].numel(), "chosen": chosen.name})


def _run_child(args: argparse.Namespace, preset: str) -> dict:
    return run_child([sys.executable, __file__, "--child", preset, "--steps", str(args.steps)], preset, ROOT)


def parent(args: argparse.Namespace) -> None:
    from trimtab.hardware import cpu_has_native_bf16

    if not cpu_has_native_bf16():
        sys.exit("this CPU has no native bf16 (emulated: far slower); train.precision auto picks fp32 here")
    runs: dict[str, list[dict]] = {p: [] for p in args.presets}
    for rep in range(args.reps):
        for preset in args.presets:
            runs[preset].append(r := _run_child(args, preset))
            print(f"rep {rep} {preset:10s} fp32 {r['fp32'] * 1e3:8.1f} ms  bf16 {r['bf16'] * 1e3:8.1f} ms", flush=True)
    lines = [
        f"One micro-batch per step (forward, loss, backward), {args.steps} timed steps of each precision "
        f"alternating in one process, after a warm-up of each; {args.reps} repetitions (a process each). "
        "Speed-up: fp32 step time over bf16's, paired by repetition, median with a bootstrap 95% interval; "
        "train.precision auto keeps bf16 at >= 1.1x (its probe's verdict, cached per shape, in the last column).",
        "",
        "| preset | tokens a step | fp32 ms (median) | bf16 ms (median) | bf16 speed-up | auto chose | "
        "other processes' CPU share |",
        "|---|---|---|---|---|---|---|",
    ]
    for preset, rs in runs.items():
        ratio = paired_ratio([r["fp32"] for r in rs], [r["bf16"] for r in rs])
        fp32, bf16 = (statistics.median(r[k] for r in rs) * 1e3 for k in ("fp32", "bf16"))
        loads = ", ".join(f"{r['other_cpu']:.0%}" for r in rs)
        verdict = ratio.verdict(1.1)
        lines.append(
            f"| {preset} | {rs[0]['tokens']:,} | {fp32:,.1f} | {bf16:,.1f} | {ratio} (>= 1.1x: {verdict}) | "
            f"{rs[0]['chosen']} | {loads} |"
        )
    other = [r["other_cpu"] for rs in runs.values() for r in rs]
    publish(HEADING, "\n".join(lines), precision="fp32 and bf16 autocast", other_cpu=other, dry_run=args.dry_run)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["debug", "debug-moe", "small"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true", help="debug only, 2 steps, 1 rep; print only")
    parser.add_argument("--child", dest="preset", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.dry_run:
        ns.presets, ns.steps, ns.reps = ["debug"], 2, 1
    child(ns) if ns.preset else parent(ns)
