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
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _benchfile import replace_section  # bench/_benchfile.py, next to this file
from trimtab.rundir import read_metrics

sys.path.insert(0, str(Path(__file__).parent))
from _measure import Contention  # noqa: E402  (bench/ is a folder of scripts, not a package)

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
        cmd = [
            *launcher,
            "-m",
            "trimtab",
            "train",
            "--preset",
            preset,
            "--out",
            f"{tmp}/run",
            "--max-steps",
            str(steps),
            *[a for s in sets for a in ("--set", s)],
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with Contention() as busy:
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if done.returncode:
            sys.exit(f"{preset} {nproc} {strategy} failed:\n{done.stderr[-4000:]}")
        steps_ = [m for m in read_metrics(f"{tmp}/run") if "tokens_per_s" in m and m["step"] > warmup]
        return {
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in steps_),
            "loss": steps_[-1]["loss"],
            "other_cpu": busy.other,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["debug", "small"])
    parser.add_argument("--steps", nargs="+", type=int, default=[30, 10])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
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
        HEADING,
        "",
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, gloo over loopback; one torch thread per process (so 2 processes use both "
        f"cores); median of the steps after {args.warmup} warm-up steps, median of {args.reps} interleaved "
        "repetitions. Same global batch in every variant (the preset's train.batch_tokens).",
        "",
    ]
    for preset, steps in zip(args.presets, args.steps):
        lines += [
            f"**{preset}** ({steps} steps)",
            "",
            "| variant | tokens/s (median) | all reps | vs 1 process | final loss | other processes' CPU share |",
            "|---|---|---|---|---|---|",
        ]
        base = statistics.median(r["tokens_per_s"] for r in results[preset]["1 process"])
        for variant, reps in results[preset].items():
            tps = statistics.median(r["tokens_per_s"] for r in reps)
            each = ", ".join(format(r["tokens_per_s"], ",.0f") for r in reps)
            other = ", ".join(format(r["other_cpu"], ".0%") for r in reps)
            lines.append(f"| {variant} | {tps:,.0f} | {each} | {tps / base:.2f}x | {reps[-1]['loss']:.4f} | {other} |")
        lines.append("")
    lines += [
        "Two processes on two cores cannot exceed 2x. The rest is communication over loopback TCP: DDP "
        "all-reduces the gradients once per step; FSDP2 gathers each block's weights in the forward and "
        "again in the backward and reduce-scatters its gradients, a dozen collectives per step, which "
        "on `debug` (a 0.2 s step, 0.5M parameters) eat about all the second core gives. Equal final "
        "losses: the variants train the same model.",
        "",
    ]
    replace_section(ROOT / "BENCHMARKS.md", HEADING, "\n".join(lines))


if __name__ == "__main__":
    main()
