"""Data parallelism on CPU: one process vs two gloo processes (DDP, FSDP2) under torchrun.

    python bench/distributed.py [--presets debug small] [--steps 30 10] [--warmup 2] [--reps 3]

Every variant runs `trimtab train` on the same global batch (the preset's train.batch_tokens) with
one torch thread per process, so one process uses one core and two processes use two: the ratio
is the data-parallel speed-up on this machine, communication (gloo over loopback) included.
Tokens/s is the median over the steps after `--warmup`, from metrics.jsonl (step time only: no
evaluation, no checkpoint). Variants run interleaved, `--reps` times; the median rep is reported
with the CPU share other processes took meanwhile (the machine is shared). Results go to the
"Data parallelism" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _benchfile import precisions, publish  # bench/_benchfile.py, next to this file
from _measure import paired_ratio, run_train  # bench/_measure.py

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"1 process": (1, "ddp"), "2 processes, DDP": (2, "ddp"), "2 processes, FSDP2": (2, "fsdp")}
HEADING = "## Data parallelism on CPU (`bench/distributed.py`)"


def run(preset: str, nproc: int, strategy: str, steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        launcher = (
            [sys.executable]
            if nproc == 1
            else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        )
        sets = [
            "log.progress=false",
            "log.tensorboard=false",
            "train.eval_every=0",
            "checkpoint.every=0",
            "train.log_every=1",
            f"distributed.strategy={strategy}",
        ]
        args = ["--preset", preset, "--max-steps", str(steps), *[a for s in sets for a in ("--set", s)]]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = run_train(args, f"{tmp}/run", f"{preset} {nproc} {strategy}", launcher, ROOT, env)
        steps_ = [m for m in done["metrics"] if "tokens_per_s" in m and m["step"] > warmup]
        return {
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in steps_),
            "loss": steps_[-1]["loss"],
            "other_cpu": done["other_cpu"],
            "precision": done["summary"]["precision"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["debug", "small"])
    parser.add_argument("--steps", nargs="+", type=int, default=[30, 10])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="debug, 4 steps, 1 rep; print only")
    args = parser.parse_args()
    if args.dry_run:
        args.presets, args.steps, args.warmup, args.reps = ["debug"], [4], 1, 1
    results: dict[str, dict[str, list[dict]]] = {p: {v: [] for v in VARIANTS} for p in args.presets}
    for rep in range(args.reps):
        for preset, steps in zip(args.presets, args.steps):
            for variant, (nproc, strategy) in VARIANTS.items():
                r = run(preset, nproc, strategy, steps, args.warmup)
                results[preset][variant].append(r)
                print(
                    f"rep {rep} {preset:6s} {variant:20s} {r['tokens_per_s']:8.0f} tok/s  loss {r['loss']:.4f}  "
                    f"other processes {r['other_cpu']:.0%}",
                    flush=True,
                )
    write_report(args, results)


def write_report(args: argparse.Namespace, results: dict[str, dict[str, list[dict]]]) -> None:
    lines = [
        "Gloo over loopback; one torch thread per process (so 2 processes use both "
        f"cores); median of the steps after {args.warmup} warm-up steps, median of {args.reps} interleaved "
        "repetitions. Same global batch in every variant (the preset's train.batch_tokens). vs 1 process: "
        "tokens/s over the same repetition's single process, median with a bootstrap 95% interval.",
        "",
    ]
    for preset, steps in zip(args.presets, args.steps):
        lines += [
            f"**{preset}** ({steps} steps)",
            "",
            "| variant | tokens/s (median) | all reps | vs 1 process | final loss | other processes' CPU share |",
            "|---|---|---|---|---|---|",
        ]
        base = [r["tokens_per_s"] for r in results[preset]["1 process"]]
        for variant, reps in results[preset].items():
            tps = statistics.median(r["tokens_per_s"] for r in reps)
            each = ", ".join(format(r["tokens_per_s"], ",.0f") for r in reps)
            other = ", ".join(format(r["other_cpu"], ".0%") for r in reps)
            vs = paired_ratio([r["tokens_per_s"] for r in reps], base)
            vs_text = f"{vs.value:.2f}x ({vs.low:.2f}-{vs.high:.2f})"
            lines.append(f"| {variant} | {tps:,.0f} | {each} | {vs_text} | {reps[-1]['loss']:.4f} | {other} |")
        lines.append("")
    lines += [
        "Two processes on two cores cannot exceed 2x. The rest is communication over loopback TCP: DDP "
        "all-reduces the gradients once per step; FSDP2 gathers each block's weights in the forward and "
        "again in the backward and reduce-scatters its gradients, a dozen collectives per step, which "
        "on `debug` (a 0.2 s step, 0.5M parameters) eat about all the second core gives. Equal final "
        "losses: the variants train the same model.",
    ]
    runs = [r for by_variant in results.values() for reps in by_variant.values() for r in reps]
    precision = precisions({f"{v}": r["precision"] for by_v in results.values() for v, rs in by_v.items() for r in rs})
    other = [r["other_cpu"] for r in runs]
    publish(HEADING, "\n".join(lines), precision=precision, other_cpu=other, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
