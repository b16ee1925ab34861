"""RL healing (issue 33, "Healing"): RL runs with real and injected faults, each once with the
orchestrator off and once in auto, against a clean run.

    python bench/rl_healing.py [--steps 16] [--out runs/bench-rl-healing] [--scenarios a,b]
    python bench/rl_healing.py --dry-run     # two scenarios, tiny: writes nothing to BENCHMARKS.md

The task: from a 2-step `debug` run, `trimtab rl` on a reward the policy can reach (a response that
begins with a space, _rl_verifiers.py), 8 prompts x 8 responses a step of 2 tokens, lr 1e-2; the
held-out prompts scored greedily at the end (`rl/held_out_reward`). Each run is a real
`python -m trimtab rl` subprocess; one that exits non-zero or leaves no summary gave up (exit 3) or crashed.
Scenarios:
    clean              no fault (auto must take no action: a false one otherwise)
    slow_verifier      a sound verifier taking 0.25 s under a 0.15 s rl.verifier_timeout_s, no
                       retries (real: every verification is killed at the timeout and scores 0;
                       the held-out prompts scored by the same check without the sleep)
    nan_loss           nan_loss@6: the objective is NaN for a step
    rollout_oom        rollout_oom@6:20: generating more than 20 rows at once runs out of memory
    sigkill            sigkill@6, relaunched once as a scheduler would (exact resume)
    stale_lr           rl.max_staleness 2 at lr 3e-2 (real: rollouts two steps behind an LR that
                       moves the policy far each step)
Per run: finished, the final held-out reward against the clean run's, the decisions. Goal: auto
finishes every scenario within 0.1 of the clean run's held-out reward and never below off.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _benchfile import publish  # bench/_benchfile.py, next to this file
from trimtab.rundir import read_decisions, read_metrics, read_summary

BENCH = Path(__file__).resolve().parent
TASK = ["--preset", "debug", "--set", "log.progress=false", "--set", "log.report=false"]
TASK += ["--set", "log.tensorboard=false", "--set", "rl.prompts_per_step=8", "--set", "rl.group_size=8"]
TASK += ["--set", "rl.max_new_tokens=2", "--set", "optim.warmup_steps=0", "--set", "optim.lr=1e-2"]
TASK += ["--set", "checkpoint.every=3", "--set", "rl.held_out=32"]
REWARD = "python:_rl_verifiers:leading_space"
SLOW = "python:_rl_verifiers:slow_leading_space"
SCENARIOS = {
    "clean": [],
    # the held-out prompts scored by the sound check: the policy's measure, not the timeout's
    "slow_verifier": [
        *("--set", f"rl.reward={SLOW}", "--set", "rl.verifier_timeout_s=0.15", "--set", "rl.verifier_retries=0"),
        *("--set", f"rl.held_out_reward={REWARD}"),
    ],
    "nan_loss": ["--inject", "nan_loss@6"],
    "rollout_oom": ["--inject", "rollout_oom@6:20"],
    "sigkill": ["--inject", "sigkill@6"],
    "stale_lr": ["--set", "rl.max_staleness=2", "--set", "optim.lr=3e-2"],
}
TOLERANCE = 0.1  # of the held-out reward, over 32 prompts


def _env() -> dict[str, str]:
    """The verifier workers import the task's rewards from bench/."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}


def _run(out: Path, base: Path, steps: int, mode: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "trimtab", "rl", *TASK, "--set", f"rl.reward={REWARD}", *extra]
    cmd += ["--set", f"train.init_from={base}", "--set", f"orchestrator.mode={mode}"]
    cmd += ["--max-steps", str(steps), "--set", f"train.eval_every={steps}", "--out", str(out)]
    t0, launches = time.perf_counter(), 0
    while True:
        done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
        launches += 1
        if done.returncode == 0 or launches == 2 or "sigkill" not in " ".join(extra):
            break  # a killed run is relaunched once, as a scheduler would
    summary = read_summary(out) or {}
    evals = [m for m in read_metrics(out) if "rl/held_out_reward" in m]
    finished = done.returncode == 0 and summary.get("status") == "completed"
    return {
        "finished": finished,
        "exit": done.returncode,
        "held_out": evals[-1]["rl/held_out_reward"] if evals and finished else None,
        "start": evals[0]["rl/held_out_reward"] if evals else None,
        "decisions": [f"{d['rule']}:{d['action']}" for d in read_decisions(out)],
        "launches": launches,
        "seconds": time.perf_counter() - t0,
        "error": "" if finished else (done.stderr.strip().splitlines() or [""])[-1][:160],
    }


def measure(args) -> dict:
    out = Path(args.out)
    base = out / "base"
    cmd = [sys.executable, "-m", "trimtab", "train", "--preset", "debug", "--max-steps", "2", "--out", str(base)]
    subprocess.run([*cmd, "--set", "log.progress=false", "--set", "log.report=false"], check=True, capture_output=True)
    runs = {}
    for name in args.scenarios:
        for mode in ("off", "auto"):
            runs[f"{name}/{mode}"] = run = _run(out / f"{name}-{mode}", base, args.steps, mode, SCENARIOS[name])
            print(f"{name}/{mode}: {json.dumps(run)}", flush=True)
    return runs


def _outcome(run: dict, clean: float) -> str:
    if not run["finished"]:  # exit 3: the run gave up, said why (an OOM with the orchestrator off); else a crash
        return f"{'gave up' if run['exit'] == 3 else 'crashed'} (exit {run['exit']})"
    return "ok" if run["held_out"] >= clean - TOLERANCE else "worse"


def report(args, runs: dict) -> str:
    clean = runs["clean/off"]["held_out"]
    lines = [
        f"From a 2-step `debug` run, {args.steps} RL steps of 8 prompts x 8 responses (2 tokens, lr 1e-2) on a "
        f"reward for a leading space; the held-out reward (32 prompts, greedy) at the end. Clean run, "
        f"orchestrator off: **{clean:.3f}** (from {runs['clean/off']['start']:.3f}). A run is ok when it "
        f"finishes within {TOLERANCE} of it.",
        "",
        "| scenario | off | auto | auto's decisions |",
        "|---|---|---|---|",
    ]
    healed, behind = [], []
    for name in args.scenarios:
        off, auto = runs[f"{name}/off"], runs[f"{name}/auto"]
        cells = []
        for run in (off, auto):
            reward = f"{run['held_out']:.3f}" if run["held_out"] is not None else "-"
            cells.append(f"{_outcome(run, clean)} ({reward}, {run['seconds']:.0f} s)")
        acted = ", ".join(sorted(set(auto["decisions"]))) or "none"
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {acted} ({len(auto['decisions'])}) |")
        healed += [name] if _outcome(auto, clean) == "ok" else []
        if auto["held_out"] is None or (off["held_out"] is not None and auto["held_out"] < off["held_out"] - TOLERANCE):
            behind.append(name)
    false = len(runs["clean/auto"]["decisions"]) if "clean/auto" in runs else 0
    lines += [
        "",
        f"- auto ok: **{len(healed)}/{len(args.scenarios)}**"
        + ("" if len(healed) == len(args.scenarios) else f" (not: {', '.join(set(args.scenarios) - set(healed))})"),
        f"- auto never worse than off: **{'met' if not behind else 'not met: ' + ', '.join(behind)}**",
        f"- false actions on the clean run: **{false}**",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--out", default="runs/bench-rl-healing")
    parser.add_argument("--dry-run", action="store_true", help="clean and rollout_oom, 8 steps: checks it runs")
    args = parser.parse_args()
    args.scenarios = args.scenarios.split(",")
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {', '.join(unknown)}; one of {', '.join(SCENARIOS)}")
    if args.dry_run:
        args.scenarios, args.steps, args.out = ["clean", "rollout_oom"], 8, tempfile.mkdtemp(prefix="bench-rl-heal-")
    runs = measure(args)
    heading = "## RL healing: faults with the orchestrator off and in auto (`bench/rl_healing.py`)"
    publish(heading, report(args, runs), precision="fp32 (CPU)", other_cpu=None, dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
