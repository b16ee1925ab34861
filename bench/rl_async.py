"""Asynchronous against synchronous RL (issue 33, "Async vs sync"): training seconds to the same
held-out pass@1 on the built-in arithmetic task.

    python bench/rl_async.py [--seeds 1,2,3] [--sft-steps 600] [--steps 120] [--staleness 1,2]
    python bench/rl_async.py --dry-run     # tiny: checks it runs, writes nothing to BENCHMARKS.md

One supervised warm start on the task (as bench/rl.py's); then per seed, from it, `trimtab rl`
with rl.max_staleness 0 (synchronous) and each --staleness, for --steps steps, the held-out
problems scored greedily every --eval-every steps. The arms of a seed run back to back, their
order turned at each seed, so the host's load falls on them alike. Per arm: the training
seconds a step (the logged step_time: rollouts, scoring and the update, evaluations excluded),
each asynchronous arm's paired ratio to the synchronous one; and the pass@1 course, averaged
over the seeds, with the seconds each arm took to first reach the target pass@1 (the warm start's
plus --target of the synchronous arm's final gain).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _benchfile import publish  # bench/_benchfile.py, next to this file
from _measure import paired_ratio, run_train
from rl import LR, TASK, _env
from trimtab.rundir import read_decisions

RL = ["--set", "rl.max_new_tokens=6", "--set", "rl.dynamic_sampling=true", "--set", "rl.reward=exact", *LR]


def _arm(args, out: Path, warm: Path, seed: int, staleness: int) -> dict:
    sets = ["--set", f"train.init_from={warm}", "--set", f"train.seed={seed}", "--set", f"rl.held_out={args.held_out}"]
    sets += ["--max-steps", str(args.steps), "--set", f"train.eval_every={args.eval_every}"]
    sets += ["--set", "train.log_every=1"]
    sets += ["--set", f"rl.max_staleness={staleness}", "--set", "checkpoint.every=0", *RL, *TASK]
    run = run_train(sets, out, f"rl {out.name}", command="rl", env=_env())
    steps = [m for m in run["metrics"] if "step_time" in m]
    passes = {m["step"]: m["rl/held_out_pass@1"] for m in run["metrics"] if "rl/held_out_pass@1" in m}
    seconds, elapsed = {0: 0.0}, 0.0
    for m in steps:
        elapsed += m["step_time"]
        seconds[m["step"]] = elapsed
    step_s = statistics.median(m["step_time"] for m in steps[2:])  # past the first steps' start-up
    acted = sum(d["rule"] == "rl_ratio" for d in read_decisions(out))  # staleness lowered (docs/rl.md)
    return {"passes": passes, "seconds": seconds, "step_s": step_s, "other_cpu": run["other_cpu"], "acted": acted}


def measure(args) -> dict[int, list[dict]]:
    out = Path(args.out)
    warm = out / "warm"
    sft = ["--max-steps", str(args.sft_steps), "--set", "data.source=builtin:arithmetic", *TASK]
    run_train(sft, warm, "warm start")
    arms: dict[int, list[dict]] = {eta: [] for eta in [0, *args.staleness]}
    for i, seed in enumerate(args.seeds):
        order = list(arms) if i % 2 == 0 else list(arms)[::-1]
        for eta in order:
            arms[eta].append(_arm(args, out / f"eta{eta}-seed{seed}", warm, seed, eta))
            print(f"seed {seed} staleness {eta}: {arms[eta][-1]['step_s']:.3f} s a step", flush=True)
    return arms


def _course(runs: list[dict]) -> dict[int, float]:
    """The mean pass@1 at each evaluated step, over the seeds."""
    steps = sorted(set.intersection(*(set(r["passes"]) for r in runs)))
    return {s: statistics.mean(r["passes"][s] for r in runs) for s in steps}


def _reached(runs: list[dict], course: dict[int, float], target: float) -> tuple[int, float] | None:
    step = next((s for s, p in course.items() if p >= target), None)
    if step is None:
        return None
    return step, statistics.mean(r["seconds"][step] for r in runs)


def report(args, arms: dict[int, list[dict]]) -> str:
    sync = arms[0]
    courses = {eta: _course(runs) for eta, runs in arms.items()}
    start, end = courses[0][0], courses[0][max(courses[0])]
    target = start + args.target * (end - start)
    lines = [
        f"A warm start of {args.sft_steps} supervised steps of `debug` on the task; then per seed ({len(args.seeds)}) "
        f"{args.steps} RL steps of each arm from it (as bench/rl.py's: 8 prompts x 8 responses a step, 6 new tokens, "
        "dynamic sampling, lr 1e-4), "
        f"greedy pass@1 on the seed's {args.held_out} held-out problems every {args.eval_every} steps. Target: "
        f"{target:.3f}, the warm start's {start:.3f} plus {args.target:.0%} of the synchronous arm's gain "
        f"to {end:.3f}.",
        "",
        "| rl.max_staleness | seconds a step (median over seeds) | step time vs synchronous | final pass@1 | "
        "steps to target | training seconds to target | rl_ratio decisions |",
        "|---|---|---|---|---|---|---|",
    ]
    for eta, runs in arms.items():
        ratio = "1" if eta == 0 else str(paired_ratio([r["step_s"] for r in runs], [r["step_s"] for r in sync]))
        hit = _reached(runs, courses[eta], target)
        reach = ("not reached", "-") if hit is None else (str(hit[0]), f"{hit[1]:.1f}")
        step_s = statistics.median(r["step_s"] for r in runs)
        final = courses[eta][max(courses[eta])]
        acted = sum(r["acted"] for r in runs)
        lines.append(f"| {eta} | {step_s:.3f} | {ratio} | {final:.3f} | {reach[0]} | {reach[1]} | {acted} |")
    lines += ["", "pass@1 course (mean over seeds), by step:", ""]
    steps = sorted(courses[0])
    lines += ["| step | " + " | ".join(f"staleness {eta}" for eta in arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for s in steps:
        lines.append(f"| {s} | " + " | ".join(f"{courses[eta].get(s, float('nan')):.3f}" for eta in arms) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--held-out", type=int, default=100)
    parser.add_argument("--staleness", default="1,2")
    parser.add_argument("--target", type=float, default=0.8, help="the share of the synchronous arm's gain")
    parser.add_argument("--out", default="runs/bench-rl-async")
    parser.add_argument("--dry-run", action="store_true", help="a few steps, one seed: checks it runs")
    args = parser.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.staleness = [int(s) for s in args.staleness.split(",")]
    if args.dry_run:  # in a scratch directory
        args.seeds, args.sft_steps, args.steps, args.eval_every, args.held_out = args.seeds[:1], 10, 4, 2, 8
        args.out = tempfile.mkdtemp(prefix="bench-rl-async-")
    arms = measure(args)
    other = [r["other_cpu"] for runs in arms.values() for r in runs]
    heading = "## Asynchronous against synchronous RL (`bench/rl_async.py`)"
    publish(heading, report(args, arms), precision="fp32 (CPU)", other_cpu=other, dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
