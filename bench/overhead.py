"""The orchestrator's cost: fault-free training with orchestrator.mode=off vs auto.

    python bench/overhead.py [--preset debug] [--steps 480] [--block 10] [--warmup 60] [--reps 3]

Separate runs differ in speed on their own by more than the 1% to resolve (three debug runs of
one mode, each in its own process, spread 5-20% on this machine). So each of `--reps` processes
alternates the mode itself, in blocks of `--block` steps (off, auto, off, auto, ...; the
orchestrator reads its mode at every step, as `trimtab ctl RUN_DIR mode off` switches it), and
the modes are compared inside one process. A step's time is the whole loop iteration (the step,
every hook, control, the next batch), from one step start to the next. Two figures:

    end to end   iteration time in auto / in off - 1: per pair of adjacent blocks (off, then
                 auto) the ratio of their median iteration times, so slow drift cancels; the
                 median over all pairs of all processes, with a bootstrap 95% interval (the
                 update gate's device ops and the gated optimizer step included)
    direct       time inside the orchestrator's hook methods (wrapped with timers) per auto
                 step, over the median auto iteration time: its own cost, free of noise

The first `--warmup` steps are left out (the spike and grad monitors arm the gate's ceilings
after min_samples readings). Contention (other processes' CPU share) is recorded as
bench/throughput.py does; a run during which it passed --max-other is measured again. Results
go to the `## Orchestrator overhead` section of BENCHMARKS.md. Target: < 1% of step time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from _benchfile import publish  # bench/_benchfile.py, next to this file
from _measure import emit, median_ratio, run_child  # bench/_measure.py, next to this file
from throughput import ROOT  # bench/throughput.py, next to this file

HEADING = "## Orchestrator overhead (`bench/overhead.py`)"
HOOK_METHODS = (
    "on_train_start",
    "on_step_start",
    "update_gate",
    "on_step_end",
    "on_log",
    "on_eval",
    "on_train_end",
    "healthy",
    "state_dict",
    "on_save_start",
    "on_checkpoint",
)


def child(args: argparse.Namespace) -> None:
    from trimtab.config import load_config
    from trimtab.orchestrator import Orchestrator
    from trimtab.training.hooks import Hook
    from trimtab.training.setup import setup
    from trimtab.training.trainer import Trainer

    class Clock(Hook):
        """At each step start: close the previous iteration's record and set this step's mode."""

        def __init__(self, orch: Orchestrator):
            self.orch, self.t, self.mode, self.inside = orch, None, None, 0.0
            self.steps: list[tuple[int, str, float, float]] = []  # step, mode, seconds, inside the orchestrator

        def on_step_start(self, run, batch) -> None:
            now = time.perf_counter()
            if self.t is not None:
                self.steps.append((run.step, self.mode, now - self.t, self.inside))
            self.mode = self.orch.mode = "auto" if (run.step + 1) // args.block % 2 else "off"
            self.t, self.inside = now, 0.0

    def timed(method):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return method(*a, **kw)
            finally:
                clock.inside += time.perf_counter() - t0

        return wrapper

    with tempfile.TemporaryDirectory() as out:
        sets = ["log.progress=false", "log.tensorboard=false", "train.eval_every=0", "checkpoint.every=0"]
        cfg = load_config(preset=args.preset, overrides={"out": out, "train": {"max_steps": args.steps}}, sets=sets)
        orch = Orchestrator(cfg.orchestrator, cfg.run_dir)  # what trimtab.train builds, minus fault injection
        clock = Clock(orch)
        for name in HOOK_METHODS:  # on the instance: inherited no-ops are part of the hook's cost too
            setattr(orch, name, timed(getattr(orch, name)))
        ready = setup(cfg)
        Trainer(ready, hooks=[orch, clock]).fit()
    result = {"decisions": len(orch.journal.decisions), "pairs": [], "precision": ready.precision.name}
    blocks: dict[int, list[float]] = {}
    for step, _, seconds, _ in clock.steps:  # block b holds the steps s with s // block == b: odd = auto
        if step > args.warmup and step // args.block > args.warmup // args.block:
            blocks.setdefault(step // args.block, []).append(seconds)
    for b in sorted(blocks):
        if b % 2 == 0 and b + 1 in blocks:
            result["pairs"].append(statistics.median(blocks[b + 1]) / statistics.median(blocks[b]))
    for mode in ("off", "auto"):
        steps = [s for s in clock.steps if s[1] == mode and s[0] > args.warmup]
        result[mode] = {
            "steps": len(steps),
            "iteration_s": statistics.median(s[2] for s in steps),
            "inside_s": sum(s[3] for s in steps) / len(steps),
        }
    emit(result)


def parent(args: argparse.Namespace) -> None:
    runs = []
    for rep in range(args.reps):
        r = measure(args)
        runs.append(r)
        print(
            f"run {rep}: off {r['off']['iteration_s'] * 1e3:.2f} ms, auto {r['auto']['iteration_s'] * 1e3:.2f} ms "
            f"(block pairs: {statistics.median(r['pairs']) - 1:+.2%}); inside the orchestrator "
            f"{r['auto']['inside_s'] * 1e3:.3f} ms per auto step; other processes {r['other_cpu']:.0%} of the CPUs",
            flush=True,
        )
    write_report(args, runs)


def measure(args: argparse.Namespace) -> dict:
    """One process; measured again (up to --retries times, after a pause) while other processes
    took more than --max-other of the CPUs: a busy core slows two-thread torch several-fold."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--preset",
        args.preset,
        "--steps",
        str(args.steps),
        "--block",
        str(args.block),
        "--warmup",
        str(args.warmup),
    ]
    for attempt in range(args.retries + 1):
        result = run_child(cmd, "the benchmark process", ROOT)
        if result["other_cpu"] <= args.max_other or attempt == args.retries:
            return {**result, "attempts": attempt + 1}
        print(f"  other processes used {result['other_cpu']:.0%} of the CPUs; measuring again in 30 s", flush=True)
        time.sleep(30)
    raise AssertionError("unreachable")


def write_report(args: argparse.Namespace, runs: list[dict]) -> None:
    ratios = [statistics.median(r["pairs"]) - 1 for r in runs]
    pairs = median_ratio([x for r in runs for x in r["pairs"]])  # auto / off, block by block
    direct = [r["auto"]["inside_s"] / r["auto"]["iteration_s"] for r in runs]
    lines = [
        f"Preset {args.preset}, fault-free, {args.steps} steps per "
        f"process, the mode alternating off / auto every {args.block} steps inside each process (runs in "
        f"separate processes differ by more than 1% on their own); the first {args.warmup} steps left out; "
        f"median loop-iteration time per mode; {args.reps} processes.",
        "",
        "| process | off ms/step | auto ms/step | auto / off (median of its block pairs) "
        "| inside the orchestrator, ms per auto step | share of the auto step | decisions "
        "| other processes' CPU share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, (r, ratio, share) in enumerate(zip(runs, ratios, direct)):
        lines.append(
            f"| {i} | {r['off']['iteration_s'] * 1e3:.2f} | {r['auto']['iteration_s'] * 1e3:.2f} | "
            f"{ratio:+.2%} | {r['auto']['inside_s'] * 1e3:.3f} (off: {r['off']['inside_s'] * 1e3:.3f}) | "
            f"{share:.3%} | {r['decisions']} | {r['other_cpu']:.0%} |"
        )
    med_direct = statistics.median(direct)
    verdict = pairs.at_most(1.01)
    lines += [
        "",
        f"- direct cost, time inside the orchestrator's hooks in auto: **{med_direct:.2%}** of the step "
        f"(median of the processes; target < 1%: {'met' if med_direct < 0.01 else 'not met'})",
        f"- end to end, auto / off iteration time: **{pairs.value - 1:+.2%}** (median of {pairs.n} block "
        f"pairs, 95% interval {pairs.low - 1:+.2%} to {pairs.high - 1:+.2%}; target < 1%: {verdict})",
    ]
    other = [r["other_cpu"] for r in runs]
    publish(HEADING, "\n".join(lines), precision=runs[0]["precision"], other_cpu=other, dry_run=args.dry_run)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--block", type=int, default=10, help="steps per mode before it switches")
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--reps", type=int, default=3, help="processes")
    parser.add_argument(
        "--max-other",
        type=float,
        default=0.1,
        help="CPU share of other processes above which a run is measured again (default 0.1)",
    )
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="40 steps in blocks of 10, 1 process; print only")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.dry_run:
        ns.steps, ns.block, ns.warmup, ns.reps, ns.retries = 40, 10, 0, 1, 0
    child(ns) if ns.child else parent(ns)
