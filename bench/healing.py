"""Fault healing: every injected fault, once with the orchestrator off and once in auto.

    trimtab bench healing [--preset debug] [--steps 120] [--out runs/bench-healing]
                          [--scenarios nan_loss,oom] [--json PATH] [--markdown PATH|-]
    (or: python bench/healing.py ...)

Each run is a real `python -m trimtab train` subprocess in a fresh run directory, same preset and
seed, faults passed with --inject (faults.py). A run that exits non-zero, or leaves no summary,
crashed; one past the time limit stalled. Preemption scenarios (sigkill, sigterm, a corrupt
checkpoint before a kill) are relaunched once on the same directory, as a job scheduler would.
Per run: finished, final eval loss vs the clean fault-free run (mode off), the orchestrator's
decisions, steps re-done (steps executed, counted from the per-step log lines on stderr, minus
the furthest step reached) and wall time. Target: every scenario finishes under auto within 3%
of the clean eval loss; under off most crash, stall or end measurably worse. Writes a table to
stdout, JSON (--json, default OUT/healing.json) and a section of BENCHMARKS.md (--markdown).

expert_collapse needs routed experts: on a preset without MoE layers it runs on debug-moe, against
that preset's own clean runs. Its runs are also scored on the load: the busiest expert's share
over the fair one (max_load), averaged over the last 20 steps, worst MoE layer; at or above
orchestrator.moe.imbalance (2.5) the run counts as "unbalanced" whatever its loss.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _benchfile import replace_section  # bench/_benchfile.py, next to this file
from trimtab.metrics import read_metrics
from trimtab.orchestrator.journal import read_decisions

ROOT = Path(__file__).resolve().parent.parent  # the source checkout
HEADING = "## Fault healing (`trimtab bench healing`)"
TOLERANCE = 0.03  # final eval loss within 3% of the clean run
PREEMPTION = ("sigkill", "sigterm", "corrupt_checkpoint")  # relaunched once, as a scheduler would
MOE_SCENARIOS = ("expert_collapse",)  # need a MoE model, and are judged on the load too
MOE_PRESET = "debug-moe"
BALANCE_STEPS = 20  # the load is judged over the last this many steps


def scenarios(steps: int, micro_batch_tokens: int) -> dict[str, list[str]]:
    """Fault specs relative to the run length: most fire at mid-run, after the monitors have
    their min_samples and a good checkpoint exists (checkpoints every steps // 6)."""
    s = steps // 2
    return {
        "nan_loss": [f"nan_loss@{s}"],
        "inf_grad": [f"inf_grad@{s}"],
        "grad_spike": [f"grad_spike@{s}:1e6"],
        "bad_batch": [f"bad_batch@{s}:4"],  # 4 consecutive steps of garbage rows (and their recurrences)
        "lr_spike": [f"lr_spike@{s}:30"],  # persistent: 30x the schedule from mid-run on
        "oom": [f"oom@{steps // 4}:{micro_batch_tokens // 2}"],  # only half the micro-batch fits
        "weights_nan": [f"weights_nan@{s}"],
        "disk_full": [f"disk_full@{s}"],  # the checkpoint save at mid-run fails with ENOSPC
        "corrupt_checkpoint": [f"corrupt_checkpoint@{s}", f"sigkill@{s + steps // 12}"],
        "sigkill": [f"sigkill@{s + steps // 12}"],
        "sigterm": [f"sigterm@{s + steps // 12}"],
        "slow": [f"slow@{s}:20"],  # 20 steps each 0.25 s slower (a throttled node)
        # early: the monitor needs a window to see the collapse and one more to see the first
        # remedy fail before it resets the router (about 40 steps on debug-moe)
        "expert_collapse": [f"expert_collapse@{steps // 4}"],
    }


def preset_for(name: str, preset: str) -> str:
    """The preset a scenario runs on: the chosen one, or debug-moe where it needs experts."""
    if name not in MOE_SCENARIOS:
        return preset
    from trimtab.config import load_config

    return preset if "moe" in load_config(preset=preset).model.layer_pattern else MOE_PRESET


def run_training(
    run_dir: Path,
    args: argparse.Namespace,
    mode: str,
    faults: list[str],
    relaunch: bool,
    timeout: float,
    preset: str | None = None,
) -> dict[str, Any]:
    """One scenario run (plus the scheduler's one relaunch where it applies)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    preset = preset or args.preset
    cmd = [
        sys.executable,
        "-m",
        "trimtab",
        "train",
        "--preset",
        preset,
        "--out",
        str(run_dir),
        "--max-steps",
        str(args.steps),
        "--orchestrator",
        mode,
        "--set",
        "log.progress=false",
        "--set",
        "log.tensorboard=false",
        "--set",
        "train.log_every=1",
        "--set",
        "train.eval_every=0",
        "--set",
        f"checkpoint.every={max(1, args.steps // 6)}",
    ]
    for spec in faults:
        cmd += ["--inject", spec]
    launches, executed, reached, wall, other = [], 0, 0, 0.0, []
    for _ in range(2 if relaunch else 1):
        (run_dir / "summary.json").unlink(missing_ok=True)
        before = _cpu_seconds()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, err = None, exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        (w, busy, ours) = (x - y for x, y in zip(_cpu_seconds(), before))
        wall += w
        other.append(max(0.0, busy - ours) / (max(w, 1e-9) * (os.cpu_count() or 1)))
        steps = [int(s) for s in re.findall(r"^step (\d+)/\d+ ", err, re.M)]
        executed, reached = executed + len(steps), max([reached, *steps])
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if rc == 0 and summary_path.is_file() else None
        launches.append({"rc": rc, "status": summary["status"] if summary else _failure(rc, err)})
        if summary is not None and summary["status"] == "completed":
            break
    val = summary.get("val_loss") if summary else None
    decisions = read_decisions(run_dir)
    # Per-step lines (train.log_every=1). Updates withheld count on abandoned steps too (the
    # orchestrator acted there); the load is judged on the kept trajectory only.
    skipped = sum(m.get("skipped_steps", 0) for m in read_metrics(run_dir, abandoned=True))
    kept = [m for m in read_metrics(run_dir) if "loss" in m]
    return {
        "mode": mode,
        "preset": preset,
        "faults": faults,
        "launches": launches,
        "finished": bool(summary) and summary["status"] == "completed",
        "status": launches[-1]["status"],
        "val_loss": None if val is None or not math.isfinite(val) else val,
        "decisions": [
            {k: d.get(k) for k in ("step", "rule", "action", "params", "mode", "applied")} for d in decisions
        ],
        "updates_skipped": skipped,
        "steps_executed": executed,
        "steps_redone": executed - reached if executed else None,
        "wall_s": round(wall, 1),
        "other_cpu": round(max(other), 3),
        "run_dir": str(run_dir),
        "max_load": max_load(kept[-BALANCE_STEPS:]),
    }


def max_load(lines: list[dict[str, Any]]) -> float | None:
    """The worst MoE layer's busiest-expert load over the fair share, averaged over `lines`
    (1 is perfectly balanced, E / top_k a collapse); None without MoE layers."""
    keys = {k for m in lines for k in m if k.startswith("moe/") and k.endswith("/max_load")}
    means = [sum(m[k] for m in lines if k in m) / sum(k in m for m in lines) for k in keys]
    return round(max(means), 3) if means else None


def _failure(rc: int | None, stderr: str) -> str:
    if rc is None:
        return "stalled (time limit)"
    if rc < 0:
        return f"killed ({signal.Signals(-rc).name if -rc in signal.valid_signals() else -rc})"
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    last = lines[-1][:200] if lines else f"exit {rc}"  # a traceback ends with "module.Error: message"
    kind = last.split(":")[0].rsplit(".", 1)[-1] if re.match(r"^[\w.]+(Error|Exception)\b", last) else None
    return f"crashed ({kind}): {last}" if kind else f"crashed: {last}"


def _cpu_seconds() -> tuple[float, float, float]:
    """(wall clock, CPU seconds the machine was busy, CPU seconds of our finished children): over a
    run, busy minus ours is what other processes took, as bench/throughput.py measures it (a busy
    second core slows two-thread torch 3-10x)."""
    try:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    except OSError:
        busy = 0.0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), busy, usage.ru_utime + usage.ru_stime


def judge(run: dict[str, Any], clean: float | None, balance_limit: float | None = None) -> None:
    """Adds ratio and outcome: ok (finished within 3%), worse, ruined (NaN), or the failure;
    with balance_limit, a finished run whose max_load is at or above it is "unbalanced"."""
    run["ratio"] = run["val_loss"] / clean if run["val_loss"] is not None and clean else None
    if not run["finished"]:
        run["outcome"] = run["status"]
    elif run["ratio"] is None:
        run["outcome"] = "ruined (eval loss NaN)"
    elif balance_limit and (run["max_load"] is None or run["max_load"] >= balance_limit):
        run["outcome"] = "unbalanced"
    else:
        run["outcome"] = "ok" if run["ratio"] <= 1 + TOLERANCE else "worse"


def _cell(run: dict[str, Any]) -> str:
    if run["ratio"] is not None and run["finished"]:
        mark = "" if run["outcome"] == "ok" else f" **{run['outcome']}**"
        load = f", max load {run['max_load']:.2f}x" if run.get("max_load") is not None else ""
        return f"{run['val_loss']:.4f} ({run['ratio'] - 1:+.1%}){load}{mark}"
    text = run["outcome"].split(":")[0].replace("|", "/")  # the whole message is in the JSON
    return text + ")" * (text.count("(") - text.count(")"))


def _reference(run: dict[str, Any]) -> str:
    if run["val_loss"] is None:
        return run["status"].split(":")[0]
    load = f", max load {run['max_load']:.2f}x" if run.get("max_load") is not None else ""
    return f"{run['val_loss']:.4f}{load}"


def _actions(run: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for d in run["decisions"]:
        name = d["action"] if d["action"] != "none" else f"log ({d['rule']})"
        name += "" if d["mode"] in ("auto", "manual") else f" [{d['mode']}]"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{a} x{n}" if n > 1 else a for a, n in counts.items()) or "-"


def report(results: dict[str, Any]) -> str:
    runs, clean = results["runs"], results["clean_val_loss"]
    reference = f"eval loss **{clean:.4f}**" if clean else f"**{runs['clean/off']['status']}**"
    lines = [
        HEADING,
        "",
        f"{results['date']}, {results['machine']}, torch {results['torch']}, "
        f"code {results['code']}; preset "
        f"{results['preset']}, {results['steps']} steps, checkpoint every {results['checkpoint_every']}; "
        f"each run a `trimtab train` subprocess, one after another (total {results['runtime_s'] / 60:.1f} "
        f"min); other processes' CPU share during the runs {results['other_cpu']}. Clean run (no fault, "
        f"orchestrator off): {reference}. Steps re-done: steps executed minus the furthest step "
        "reached (rollbacks, restarts). Preemption (sigkill, sigterm, corrupt_checkpoint: relaunched once) "
        "is survived by the trainer's resume from verified checkpoints in both modes; `slow` has nothing "
        "to heal (the throughput rule only logs).",
        "",
        "| scenario | injected | off | auto | auto decisions | auto updates skipped | steps re-done "
        "off / auto | wall s off / auto | auto within 3% |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in results["scenarios"]:
        off, auto = runs[f"{name}/off"], runs[f"{name}/auto"]
        clean_off = runs.get(f"clean@{auto['preset']}/off")  # a scenario on a preset of its own
        where = f" on {auto['preset']} (clean: {_reference(clean_off)})" if clean_off else ""
        lines.append(
            f"| {name} | `{' '.join(auto['faults'])}`{where} | {_cell(off)} | {_cell(auto)} | "
            f"{len(auto['decisions'])}: {_actions(auto)} | {auto['updates_skipped']} | "
            f"{off['steps_redone']} / {auto['steps_redone']} "
            f"| {off['wall_s']:.0f} / {auto['wall_s']:.0f} | {'yes' if auto['outcome'] == 'ok' else '**no**'} |"
        )
    lines += ["", *(f"- {v}" for v in results["verdicts"]), ""]
    return "\n".join(lines)


def verdicts(results: dict[str, Any]) -> list[str]:
    runs, names = results["runs"], results["scenarios"]
    healed = [n for n in names if runs[f"{n}/auto"]["outcome"] == "ok"]
    hurt = [n for n in names if runs[f"{n}/off"]["outcome"] != "ok"]
    missed = [n for n in names if n not in healed]
    clean_auto = runs.get("clean/auto")
    out = [
        f"auto finishes within 3% of the clean run: **{len(healed)}/{len(names)}** "
        f"({'met' if not missed else 'not met: ' + ', '.join(missed)})",
        f"off crashes, stalls, ends >3% worse or unbalanced (MoE): **{len(hurt)}/{len(names)}** "
        f"({'met' if len(hurt) * 2 > len(names) else 'not met'}; within 3% without it: "
        f"{', '.join(n for n in names if n not in hurt) or 'none'})",
    ]
    if clean_auto is not None:
        out.append(
            f"no fault, auto: {_cell(clean_auto)} with {len(clean_auto['decisions'])} decisions "
            f"({_actions(clean_auto)})"
        )
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="trimtab bench healing", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", default="runs/bench-healing", help="parent of the run directories")
    parser.add_argument("--scenarios", help="comma-separated subset (default: all)")
    parser.add_argument("--json", help="results JSON (default OUT/healing.json)")
    parser.add_argument(
        "--markdown",
        help="markdown file to write the section into (default: the checkout's BENCHMARKS.md; '-' for none)",
        default=str(ROOT / "BENCHMARKS.md"),
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=0,
        help="seconds per launch before a run counts as stalled (default: 10x the clean run, at least 900)",
    )
    args = parser.parse_args(argv)
    import torch

    from trimtab.config import load_config

    micro = load_config(preset=args.preset).train.micro_budget
    table = scenarios(args.steps, micro)
    names = args.scenarios.split(",") if args.scenarios else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; one of {', '.join(table)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, runs, code = time.monotonic(), {}, _code_version()
    presets = {name: preset_for(name, args.preset) for name in names}
    clean_key = {p: "clean" if p == args.preset else f"clean@{p}" for p in (args.preset, *presets.values())}
    for preset, key in clean_key.items():  # each preset's fault-free reference
        for mode in ("off", "auto"):
            runs[f"{key}/{mode}"] = run = run_training(
                out / f"{key.replace('@', '-')}-{mode}", args, mode, [], False, 3600, preset
            )
            print(f"{key} {mode}: {run['status']}, val_loss {run['val_loss']}, {run['wall_s']:.0f}s", flush=True)
    clean = runs["clean/off"]["val_loss"]
    timeout = args.timeout or max(900.0, 10 * runs["clean/off"]["wall_s"])  # contention slows runs 10x
    for name in names:
        key = clean_key[presets[name]]
        limit = load_config(preset=presets[name]).orchestrator.moe.imbalance if name in MOE_SCENARIOS else None
        for mode in ("off", "auto"):
            run = run_training(
                out / f"{name}-{mode}",
                args,
                mode,
                table[name],
                name in PREEMPTION,
                max(timeout, 10 * runs[f"{key}/off"]["wall_s"]),
                presets[name],
            )
            judge(run, runs[f"{key}/off"]["val_loss"], limit)
            runs[f"{name}/{mode}"] = run
            print(
                f"{name:18s} {mode:4s} {run['outcome'][:60]:60s} val_loss {run['val_loss']} "
                f"decisions {len(run['decisions'])} redone {run['steps_redone']} {run['wall_s']:.0f}s "
                f"(other CPU {run['other_cpu']:.0%})",
                flush=True,
            )
    for key in clean_key.values():
        judge(runs[f"{key}/auto"], runs[f"{key}/off"]["val_loss"])
    shares = [r["other_cpu"] for r in runs.values()]
    code_end = _code_version()
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "code": code if code == code_end else f"{code}..{code_end} (changed during the runs)",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "preset": args.preset,
        "steps": args.steps,
        "checkpoint_every": max(1, args.steps // 6),
        "scenarios": names,
        "clean_val_loss": clean,
        "runtime_s": round(time.monotonic() - start),
        "other_cpu": f"{min(shares):.0%}-{max(shares):.0%} (median {sorted(shares)[len(shares) // 2]:.0%})",
        "runs": runs,
    }
    results["verdicts"] = verdicts(results)
    section = report(results)
    print("\n" + section)
    json_path = Path(args.json) if args.json else out / "healing.json"
    json_path.write_text(json.dumps(results, indent=1))
    if args.markdown != "-":
        replace_section(Path(args.markdown), HEADING.split(" (")[0], section)
        print(f"wrote {json_path} and the '{HEADING}' section of {args.markdown}")
    return 0


def _code_version() -> str:
    """The checkout's commit (+ "with local changes" under src/), so a table says which policy it
    measured."""
    git = ["git", "-C", str(ROOT)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no", "--", "src"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit.stdout.strip() + (" with local changes" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
