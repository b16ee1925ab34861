"""RL learns: held-out pass@1 on the built-in arithmetic task after RL, against two controls that
cost the same, over several seeds (issue 33, "It learns").

    python bench/rl.py [--seeds 1,2,3] [--sft-steps 1500] [--steps 300] [--out runs/bench-rl]
    python bench/rl.py --dry-run     # tiny: checks it runs, writes nothing to BENCHMARKS.md

One supervised warm start on the task's training problems (`data.source: builtin:arithmetic`),
then per seed (`train.seed`, which also draws that seed's held-out problems), each from the warm
start and for `--steps` optimizer steps:
    rl        `trimtab rl` with the exact-answer reward (dynamic sampling, lr 1e-4: README)
    sft       a supervised continuation on the same training problems, same steps and LR
    random    `trimtab rl` with a reward uncorrelated with correctness (_rl_verifiers.py)
Each is scored by greedy held-out pass@1 on the seed's `--held-out` problems with the exact
reward: `rl` by its own evaluations (step 0 is the warm start, the last its end), the controls by
a one-step `trimtab rl` from them (LR 1e-12) whose step-0 evaluation scores them on the same
problems. The claim: RL's pass@1 above each control's, pooled over the seeds (a 95% normal
interval of the difference of proportions over all held-out problems, conservative: unpaired).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from _benchfile import publish  # bench/_benchfile.py, next to this file
from _measure import run_train

BENCH = Path(__file__).resolve().parent
TASK = ["--preset", "debug", "--set", "log.progress=false", "--set", "log.tensorboard=false"]
TASK += ["--set", "log.report=false"]
RL = ["--set", "rl.max_new_tokens=6", "--set", "rl.dynamic_sampling=true"]
LR = ["--set", "optim.lr=1e-4", "--set", "optim.warmup_steps=0"]


def _env() -> dict[str, str]:
    """The verifier workers import the random reward from bench/."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}


def _passes(run: dict) -> dict[int, float]:
    return {m["step"]: m["rl/held_out_pass@1"] for m in run["metrics"] if "rl/held_out_pass@1" in m}


def _rl(args, out: Path, init: Path, seed: int, steps: int, *extra: str) -> dict:
    sets = ["--set", f"train.init_from={init}", "--set", f"train.seed={seed}", "--set", f"rl.held_out={args.held_out}"]
    sets += ["--max-steps", str(steps), "--set", f"train.eval_every={steps}", *RL, *extra]
    return run_train(sets + TASK, out, f"rl {out.name}", command="rl", env=_env())


def _score(args, model: Path, seed: int) -> float:
    """Greedy held-out pass@1 of `model` on `seed`'s held-out problems (a step-0 evaluation)."""
    exact = ["--set", "optim.lr=1e-12", "--set", "rl.reward=exact"]  # the score is taken before the one step
    return _passes(_rl(args, model.with_name(model.name + "-score"), model, seed, 1, *exact))[0]


def measure(args) -> list[dict]:
    out = Path(args.out)
    warm = out / "warm"
    sft = ["--max-steps", str(args.sft_steps), "--set", "data.source=builtin:arithmetic", *TASK]
    run_train(sft, warm, "the warm start")
    rows = []
    for seed in args.seeds:
        rl = _passes(_rl(args, out / f"rl-{seed}", warm, seed, args.steps, "--set", "rl.reward=exact", *LR))
        cont = ["--max-steps", str(args.steps), "--set", f"train.init_from={warm}", "--set", f"train.seed={seed}"]
        cont += ["--set", "data.source=builtin:arithmetic", "--set", "train.eval_every=0", *LR, *TASK]
        run_train(cont, out / f"sft-{seed}", f"sft {seed}")
        random = ["--set", "rl.reward=python:_rl_verifiers:random_reward", *LR]
        _rl(args, out / f"random-{seed}", warm, seed, args.steps, *random)
        row = {"seed": seed, "start": rl[0], "rl": rl[max(rl)]}
        row["sft"], row["random"] = _score(args, out / f"sft-{seed}", seed), _score(args, out / f"random-{seed}", seed)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _difference(a: float, b: float, n: int) -> tuple[float, float, float]:
    """a - b for proportions over n problems each, with a 95% normal interval (unpaired)."""
    se = math.sqrt(a * (1 - a) / n + b * (1 - b) / n)
    return a - b, a - b - 1.96 * se, a - b + 1.96 * se


def report(args, rows: list[dict]) -> str:
    lines = [
        f"A warm start of {args.sft_steps} supervised steps of `debug` on the task's training problems; then per "
        f"seed {args.steps} steps of each arm from it; greedy pass@1 on the seed's own {args.held_out} held-out "
        "problems (never trained on).",
        "",
        "| seed | warm start | rl | supervised continuation | random reward |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['seed']} | {r['start']:.3f} | {r['rl']:.3f} | {r['sft']:.3f} | {r['random']:.3f} |" for r in rows]
    n = args.held_out * len(rows)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("start", "rl", "sft", "random")}
    lines.append(f"| mean | {mean['start']:.3f} | {mean['rl']:.3f} | {mean['sft']:.3f} | {mean['random']:.3f} |")
    lines.append("")
    arms = (("the warm start", "start"), ("the supervised continuation", "sft"), ("the random reward", "random"))
    for name, key in arms:
        d, low, high = _difference(mean["rl"], mean[key], n)
        verdict = "resolved" if low > 0 else "not resolved"
        lines.append(f"- rl - {name}: **{d:+.3f}** (95% interval {low:+.3f} to {high:+.3f}, {n} problems): {verdict}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--sft-steps", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--out", default="runs/bench-rl")
    parser.add_argument("--dry-run", action="store_true", help="a few steps, one seed: checks it runs")
    args = parser.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    if args.dry_run:  # in a scratch directory
        args.seeds, args.sft_steps, args.steps, args.held_out = args.seeds[:1], 20, 2, 8
        args.out = tempfile.mkdtemp(prefix="bench-rl-")
    rows = measure(args)
    heading = "## RL on the built-in arithmetic task (`bench/rl.py`)"
    publish(heading, report(args, rows), precision="fp32 (CPU)", other_cpu=None, dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
