"""The orchestrator's cost: the same fault-free run with orchestrator.mode=off and =auto.

    python bench/overhead.py [--preset debug] [--steps 60] [--warmup 5] [--reps 3]

Each run trains in its own subprocess (trimtab.train, per-step metrics, no evaluation or
checkpoints inside the timed steps); the modes alternate off, auto, off, auto, ... `--reps` times
each. Two measurements:

    end to end   median per-step `step_time` (metrics.jsonl) after `--warmup` steps, auto vs off;
                 includes everything (the update gate's device ops, the gated optimizer path)
                 but also the machine's noise, which the spread between repetitions of one
                 mode shows
    in process   wall time spent inside the orchestrator's hook methods (update_gate,
                 on_step_end, ... timed by wrapping them) per step, over the median step time:
                 its direct cost, free of run-to-run noise

Contention (other processes' CPU share during each run) is recorded as in bench/throughput.py.
Results go to the `## Orchestrator overhead` section of BENCHMARKS.md. Target: < 1% of step time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from throughput import ROOT, Contention, _replace_section  # bench/throughput.py, next to this file

HOOK_METHODS = ("on_train_start", "on_step_start", "update_gate", "on_step_end", "on_log", "on_train_end",
                "healthy", "state_dict", "on_checkpoint", "on_save_start")


def child(args: argparse.Namespace) -> None:
    import trimtab
    from trimtab.config import load_config
    from trimtab.orchestrator import Orchestrator

    spent = {"seconds": 0.0, "calls": 0}

    def timed(method):
        @functools.wraps(method)
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return method(*a, **kw)
            finally:
                spent["seconds"] += time.perf_counter() - t0
                spent["calls"] += 1
        return wrapper

    for name in HOOK_METHODS:  # inherited no-ops are timed too: they are part of the hook's cost
        setattr(Orchestrator, name, timed(getattr(Orchestrator, name)))
    with tempfile.TemporaryDirectory() as out:
        sets = ["log.progress=false", "log.tensorboard=false", "train.log_every=1", "train.eval_every=0",
                "checkpoint.every=0"]  # (mode through overrides: YAML reads a bare `off` as false)
        overrides = {"out": out, "train": {"max_steps": args.steps}, "orchestrator": {"mode": args.mode}}
        cfg = load_config(preset=args.preset, overrides=overrides, sets=sets)
        summary = trimtab.train(cfg)
        lines = [json.loads(ln) for ln in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    timed_steps = [m for m in lines if "step_time" in m and m["step"] > args.warmup]
    result = {"step_time": statistics.median(m["step_time"] for m in timed_steps), "steps": len(timed_steps),
              "tokens_per_s": statistics.median(m["tokens_per_s"] for m in timed_steps),
              "hook_s": spent["seconds"], "hook_calls": spent["calls"], "decisions": summary.get("decisions", 0)}
    print("RESULT " + json.dumps(result))


def parent(args: argparse.Namespace) -> None:
    runs: dict[str, list[dict]] = {"off": [], "auto": []}
    for rep in range(args.reps):
        for mode in ("off", "auto") if rep % 2 == 0 else ("auto", "off"):  # ABBA: drift cancels
            result = measure(args, mode)
            runs[mode].append(result)
            print(f"rep {rep} {mode:4s} step {result['step_time'] * 1e3:8.2f} ms  orchestrator hooks "
                  f"{result['hook_s'] / args.steps * 1e3:.3f} ms/step  other processes {busy.other:.0%} "
                  "of the CPUs", flush=True)
    write_report(args, runs)


def measure(args: argparse.Namespace, mode: str) -> dict:
    """One run in its own process; repeated (up to --retries times, after a pause) while other
    processes took more than --max-other of the CPUs: a busy core slows torch several-fold."""
    cmd = [sys.executable, __file__, "--child", mode, "--preset", args.preset,
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    for attempt in range(args.retries + 1):
        with Contention() as busy:
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
        if busy.other <= args.max_other or attempt == args.retries:
            return {**json.loads(line[7:]), "other_cpu": busy.other, "attempts": attempt + 1}
        print(f"  {mode}: other processes used {busy.other:.0%} of the CPUs; measuring again in 30 s", flush=True)
        time.sleep(30)
    raise AssertionError("unreachable")


def write_report(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    med = {m: statistics.median(r["step_time"] for r in rs) for m, rs in runs.items()}
    spread = {m: (max(r["step_time"] for r in rs) - min(r["step_time"] for r in rs)) / med[m] for m, rs in runs.items()}
    hook = {m: statistics.median(r["hook_s"] / args.steps for r in rs) for m, rs in runs.items()}
    end_to_end = med["auto"] / med["off"] - 1
    direct = hook["auto"] / med["auto"]  # all of it, not net of what mode off still spends
    lines = ["## Orchestrator overhead (`bench/overhead.py`)", "",
             f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"torch {__import__('torch').__version__}; preset {args.preset}, fault-free, {args.steps} steps per "
             f"run (median step time after {args.warmup} warm-up steps), {args.reps} runs per mode alternating "
             "(off, auto, auto, off, ...), each in its own process; a run during which other processes took more "
             f"than {args.max_other:.0%} of the CPUs is measured again (up to {args.retries} times).", "",
             "| mode | step time ms (median) | each run | spread | orchestrator hooks ms/step | decisions "
             "| other processes' CPU share |", "|---|---|---|---|---|---|---|"]
    for m, rs in runs.items():
        each = ", ".join(f"{r['step_time'] * 1e3:.1f}" for r in rs)
        loads = ", ".join(f"{r['other_cpu']:.0%}" for r in rs)
        lines.append(f"| {m} | {med[m] * 1e3:.2f} | {each} | {spread[m]:.1%} | {hook[m] * 1e3:.3f} | "
                     f"{sum(r['decisions'] for r in rs)} | {loads} |")
    noise = max(spread.values())
    lines += ["", f"- in process, time inside the orchestrator's hooks in auto: **{direct:.3%}** of the step "
              f"time (target < 1%: {'met' if direct < 0.01 else 'not met'}); in off "
              f"{hook['off'] / med['off']:.3%} (it still polls for `trimtab ctl` commands)",
              f"- end to end, median step time auto / off: **{end_to_end:+.2%}** "
              f"({'within' if abs(end_to_end) <= noise else 'outside'} the run-to-run spread of {noise:.1%}"
              f"{'' if noise < 0.01 else ', so this figure cannot resolve 1%'})", ""]
    section = "\n".join(lines)
    print("\n" + section)
    _replace_section(ROOT / "BENCHMARKS.md", "## Orchestrator overhead", section)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-other", type=float, default=0.1, help="CPU share of other processes "
                        "above which a run is measured again (default 0.1)")
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--child", dest="mode", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    child(ns) if ns.mode else parent(ns)
