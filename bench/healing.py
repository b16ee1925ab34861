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

Beyond the faults: early_fault (before any checkpoint but the initial one), a long early stretch
of bad data, bad_rows (a quarter of a few steps' rows: the data attribution's precision and
recall against the rows the faults poisoned), a disk that stays full (relaunched once without the
fault, as after a person freed it), repeated OOM, faults in the last steps (end_nan, end_noise:
too late for the ladder to climb; the NaN weights' first step checks and rolls them back, the finite
wrecked ones only the end-of-run check sees), bad data spread thinly (thin_bad_data: a
quarter of every 8th step's rows, ~3% of the rows seen, scored like bad_rows), and fault-free auto
runs of every debug preset over several seeds, where any action the orchestrator takes is a false
one (--fp-presets, --fp-seeds). Goals: auto within 3% of clean and never worse than off, 0 false
actions, attribution precision and recall >= 0.9.

expert_collapse needs routed experts: on a preset without MoE layers it runs on debug-moe, against
that preset's own clean runs. Its runs are also scored on the load: the busiest expert's share
over the fair one (max_load), averaged over the last 20 steps, worst MoE layer; at or above
orchestrator.moe.imbalance (2.5) the run counts as "unbalanced" whatever its loss.

Real conditions, not injected (kind "real" in the JSON and the table): disk_real puts the run
directory on a real tmpfs sized from the clean run's checkpoints to hold the initial checkpoint and
2.5 full ones (checkpoint.keep=3), so saves fail for real from the third full one on and freeing
older checkpoints must make room; disk_real_full's tmpfs holds no full checkpoint (exit 4 expected
under auto), relaunched once after the tmpfs is remounted large enough, as after a person freed
space. The tmpfs is mounted by this process (root, Linux): where it cannot be, both scenarios are
reported as skipped with the reason. lr_too_high trains with optim.lr 100x the preset's, lr_30x
and lr_3x with 30x and 3x, in both modes. garbage_corpus trains on a real mixed corpus, a JSONL
file of the built-in corpus's text with
~3% garbage documents (random bytes, base64, hex dumps, other scripts, mojibake) at random places,
for 3 epochs (the orchestrator names a row on its second sighting); its reference is the same file
without the garbage lines, orchestrator off, evaluated on the same held-out clean documents with the
same tokenizer; its rows are scored like bad_rows against the training rows at least half garbage,
rebuilt from each run's config.yaml (_garbage_corpus.py). garbage_screened trains on the same corpus
with data.garbage_filter=drop (data/quality.py: documents that pack like garbage left out before
training), against the same reference; the setup cell gives the screen's precision and recall on
the documents.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import trimtab
from _benchfile import machine, precisions, publish  # bench/_benchfile.py, next to this file
from _garbage_corpus import describe, prepare, truth
from _healing_score import HEADING, attribution, judge, report, verdicts
from _measure import Contention
from trimtab.rundir import read_decisions, read_metrics, read_summary

ROOT = Path(__file__).resolve().parent.parent  # the source checkout
PREEMPTION = ("sigkill", "sigterm", "corrupt_checkpoint")  # relaunched once, as a scheduler would
FREED = ("disk_stays_full", "disk_real_full")  # relaunched once without the fault / on a larger tmpfs
FP_PRESETS = "debug,debug-moe,debug-mod,debug-hybrid"  # fault-free runs that must take no action
MOE_SCENARIOS = ("expert_collapse",)  # need a MoE model, and are judged on the load too
MOE_PRESET = "debug-moe"
BALANCE_STEPS = 20  # the load is judged over the last this many steps
# Real conditions: a run directory on a tmpfs holding the initial checkpoint and this many full ones
# (checkpoint.keep=3); a freed one holds FREED_FULLS (three kept and one being written).
REAL_DISK = {"disk_real": 2.5, "disk_real_full": 0.5}
FREED_FULLS = 5.0
# optim.lr this many times the preset's: 100x shows as a loss above its start, 30x and 3x do not
# (their updates overshoot: orchestrator/trends.py AboveStart, the gain)
LR_FACTORS = {"lr_too_high": 100, "lr_30x": 30, "lr_3x": 3}
GARBAGE = "garbage_corpus"  # a real mixed corpus: ~3% garbage documents (_garbage_corpus.py)
GARBAGE_BYTES = 300_000  # of the built-in corpus: ~2,000 training rows, ~63 steps an epoch on debug
GARBAGE_EPOCHS = 3  # seen three times: named on the second sighting, left out on the third
SCREENED = "garbage_screened"  # the same corpus with data.garbage_filter=drop
REAL = (*REAL_DISK, *LR_FACTORS, GARBAGE, SCREENED)
THIN_EVERY = 8  # thin_bad_data: bad_rows (a quarter of one step's rows) every this many steps


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
        "weights_noise": [f"weights_noise@{s}:10"],  # finite but wrecked weights, as one bad update leaves them
        "disk_full": [f"disk_full@{s}"],  # the checkpoint save at mid-run fails with ENOSPC
        "corrupt_checkpoint": [f"corrupt_checkpoint@{s}", f"sigkill@{s + steps // 12}"],
        "sigkill": [f"sigkill@{s + steps // 12}"],
        "sigterm": [f"sigterm@{s + steps // 12}"],
        "slow": [f"slow@{s}:20"],  # 20 steps each 0.25 s slower (a throttled node)
        # early: the monitor needs a window to see the collapse and one more to see the first
        # remedy fail before it resets the router (about 40 steps on debug-moe)
        "expert_collapse": [f"expert_collapse@{steps // 4}"],
        # a fault before any checkpoint but the initial one: NaN loss, then NaN weights
        "early_fault": ["nan_loss@3", "weights_nan@5"],
        # garbage in the LR's warm-up: its updates' gain looks like an LR far too high's
        "bad_data_warmup": [f"bad_batch@{max(steps // 24, 2)}:4"],
        # a long stretch of garbage early in training, while the loss still falls steeply
        "bad_data_early_long": [f"bad_batch@{steps // 8}:{steps // 8}"],
        # a quarter of the rows of 8 steps are garbage: what the row attribution must pick out
        "bad_rows": [f"bad_rows@{s}:8"],
        # every save from mid-run on fails: stop before more work is at risk, resume once freed
        "disk_stays_full": [f"disk_full@{s}:1000"],
        # out of memory twice, each at the micro-batch in use when it strikes
        "repeated_oom": [f"oom@{steps // 4}", f"oom@{steps // 2}"],
        # faults in the last steps: after them only the end-of-run check can see and undo them
        "end_nan": [f"weights_nan@{steps}"],
        "end_noise": [f"weights_noise@{steps - 1}:3"],
        # a quarter of every 8th step's rows (~3% of the rows seen), from early to late in the run
        "thin_bad_data": [f"bad_rows@{t}:1" for t in range(THIN_EVERY, steps, THIN_EVERY)],
        # real conditions, nothing injected (settings() and REAL_DISK say what they are)
        "disk_real": [],
        "disk_real_full": [],
        **{name: [] for name in LR_FACTORS},
        GARBAGE: [],
        SCREENED: [],
    }


def settings(name: str, lr: float) -> tuple[str, ...]:
    """The --set items of a scenario's runs (both modes): a real condition's configuration."""
    if name in LR_FACTORS:
        return (f"optim.lr={lr * LR_FACTORS[name]:g}",)
    if name in REAL_DISK:  # the sizes assume three kept checkpoints; no 5 MB report.html on the tmpfs
        return ("checkpoint.keep=3", "log.report=false")
    return ()


def checkpoint_sizes(run_dir: Path) -> tuple[int, int, int] | None:
    """(initial, full, other) bytes from a finished run: a full checkpoint (its largest), the
    initial one (step 0 has no optimizer moments: a full one less optim.pt) and the run's other
    files (metrics, config, tokenizer: report.html aside); None without a checkpoint."""
    found = [d for d in (run_dir / "checkpoints").glob("step_*") if d.is_dir()]
    if not found:
        return None
    sizes = [{f.name: f.stat().st_size for f in d.iterdir() if f.is_file()} for d in found]
    full = max(sizes, key=lambda s: sum(s.values()))
    other = [f for f in run_dir.iterdir() if f.is_file() and f.name != "report.html"]
    return sum(full.values()) - full.get("optim.pt", 0), sum(full.values()), sum(f.stat().st_size for f in other)


def tmpfs_bytes(initial: int, full: int, other: int, fulls: float) -> int:
    """A tmpfs for a run directory: the initial checkpoint, `fulls` full ones and the other files,
    with a page for each of ~64 small files (tmpfs rounds every file up to a page), in whole KiB."""
    return math.ceil((initial + fulls * full + other + 64 * 4096) / 1024) * 1024


class Unmountable(Exception):
    """No tmpfs can be mounted here (not root, not Linux): the scenario is skipped."""


@contextlib.contextmanager
def small_disk(where: Path, size: int) -> Iterator[Callable[[int], None]]:
    """A tmpfs of `size` bytes mounted at `where` for the duration; yields resize(bytes)."""
    if os.path.ismount(where):  # left by an interrupted benchmark
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k", "tmpfs", str(where)], capture_output=True, text=True
        )
        reason = done.stderr.strip() or f"mount exit {done.returncode}"
    except OSError as exc:
        done, reason = None, str(exc)
    if done is None or done.returncode != 0:
        where.rmdir()
        raise Unmountable(f"cannot mount a tmpfs: {reason}")

    def resize(size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size // 1024}k", str(where)], check=True, capture_output=True)

    try:
        yield resize
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
        with contextlib.suppress(OSError):
            where.rmdir()


def real_setup(name: str, sizes: tuple[int, int, int] | None, lr: float) -> tuple[tuple[int, int] | None, str]:
    """A real scenario's tmpfs (bytes, bytes once freed; None where there is none) and what the
    report says of its condition ("" for an injected one)."""
    if name in LR_FACTORS:
        return None, f"optim.lr={lr * LR_FACTORS[name]:g} ({LR_FACTORS[name]}x the preset's)"
    if name not in REAL_DISK:
        return None, ""
    if sizes is None:
        return None, "tmpfs (not sized: no clean checkpoint)"
    size, freed = tmpfs_bytes(*sizes, REAL_DISK[name]), tmpfs_bytes(*sizes, FREED_FULLS)
    mb = 2**20
    text = (
        f"tmpfs {size / mb:.1f} MiB: the initial checkpoint ({sizes[0] / mb:.1f} MiB) + {REAL_DISK[name]:g} full "
        f"({sizes[1] / mb:.1f} MiB each), checkpoint.keep=3"
    )
    return (size, freed), text + (f"; remounted {freed / mb:.1f} MiB for the relaunch" if name in FREED else "")


def skipped(mode: str, preset: str, setup: str, reason: str) -> dict[str, Any]:
    """The entry of a run that could not be made (no tmpfs here): reported, not judged."""
    return {
        "mode": mode,
        "preset": preset,
        "faults": [],
        "kind": "real",
        "setup": setup,
        "skipped": reason,
        "launches": [],
        "finished": False,
        "status": f"skipped: {reason}",
        "outcome": f"skipped: {reason}",
        "val_loss": None,
        "ratio": None,
        "decisions": [],
        "updates_skipped": 0,
        "steps_executed": 0,
        "steps_redone": None,
        "wall_s": 0.0,
        "other_cpu": 0.0,
        "run_dir": None,
        "max_load": None,
        "attribution": None,
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
    relaunch: str | None,
    timeout: float,
    preset: str | None = None,
    sets: tuple[str, ...] = (),
    disk: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """One scenario run, plus one relaunch where it applies: "same" (a scheduler after a
    preemption) or "freed" (without the faults: a person freed the disk after the run gave up).
    disk: (bytes, bytes once freed): the run directory on a tmpfs of that size, which a "freed"
    relaunch grows; copied to run_dir at the end and unmounted (Unmountable where it cannot be)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    fs = run_dir.with_name(run_dir.name + ".fs")
    with small_disk(fs, disk[0]) if disk else contextlib.nullcontext() as resize:
        freed = (lambda: resize(disk[1])) if disk else None
        where = fs / run_dir.name if disk else run_dir
        run = _launches(where, args, mode, faults, relaunch, timeout, preset or args.preset, sets, freed)
        if disk and where.is_dir():
            shutil.copytree(where, run_dir, symlinks=True)  # kept after the tmpfs is gone
    run_dir.mkdir(parents=True, exist_ok=True)
    return _scored(run, run_dir)


def finite_val(summary: dict | None) -> float | None:
    """The summary's val_loss when finite (a run that gave up on a NaN loss has none to compare)."""
    val = summary.get("val_loss") if summary else None
    return val if isinstance(val, (int, float)) and math.isfinite(val) else None


def _launches(
    run_dir: Path,
    args: argparse.Namespace,
    mode: str,
    faults: list[str],
    relaunch: str | None,
    timeout: float,
    preset: str,
    sets: tuple[str, ...],
    freed: Callable[[], None] | None,
) -> dict[str, Any]:
    """The launches of one run in `run_dir`; freed() grows its tmpfs before a "freed" relaunch."""
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
    base = cmd + [word for item in sets for word in ("--set", item)]
    injected = [word for spec in faults for word in ("--inject", spec)]
    launches, executed, reached, wall, other = [], 0, 0, 0.0, []
    for launch in range(2 if relaunch else 1):
        cmd = base if launch and relaunch == "freed" else base + injected
        if launch and relaunch == "freed" and freed:
            freed()
        (run_dir / "summary.json").unlink(missing_ok=True)
        t0 = time.monotonic()
        with Contention() as busy:
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                rc, err = proc.returncode, proc.stderr
            except subprocess.TimeoutExpired as exc:
                rc, err = None, exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        wall += time.monotonic() - t0
        other.append(busy.other)
        # Steps executed, counted from the per-step progress lines (train.log_every=1): metrics.jsonl
        # cannot count them, since a resume drops the lines a killed launch wrote past its checkpoint.
        steps = [int(s) for s in re.findall(r"^step (\d+)/\d+ ", err, re.M)]
        executed, reached = executed + len(steps), max([reached, *steps])
        # a run that gave up (exit 3 / 4) still writes its summary (a NaN loss as the string "NaN": read_summary reads
        # it back as a float, where json.loads left a str that math.isfinite refused); a crash leaves none
        summary = read_summary(run_dir)
        launches.append({"rc": rc, "status": summary["status"] if summary else _failure(rc, err)})
        precision = summary.get("precision") if summary else None
        if summary is not None and summary["status"] == "completed":
            break
    return {
        "mode": mode,
        "preset": preset,
        "faults": faults,
        "launches": launches,
        "finished": bool(summary) and summary["status"] == "completed",
        "status": launches[-1]["status"],
        "val_loss": finite_val(summary),
        "steps_executed": executed,
        "steps_redone": executed - reached if executed else None,
        "wall_s": round(wall, 1),
        "other_cpu": round(max(other), 3),
        "precision": precision,
    }


def _scored(run: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The run's decisions, skipped updates, load and attribution, read from its directory."""
    decisions = read_decisions(run_dir, abandoned=True)
    # Per-step lines (train.log_every=1). Updates withheld count on abandoned steps too (the
    # orchestrator acted there); the load is judged on the kept trajectory only.
    skipped = sum(m.get("skipped_steps", 0) for m in read_metrics(run_dir, abandoned=True))
    kept = [m for m in read_metrics(run_dir) if "loss" in m]
    return {
        **run,
        "decisions": [
            {k: d.get(k) for k in ("step", "rule", "action", "params", "mode", "applied")} for d in decisions
        ],
        "updates_skipped": skipped,
        "run_dir": str(run_dir),
        "max_load": max_load(kept[-BALANCE_STEPS:]),
        "attribution": attribution(run_dir, decisions),
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


PARTIAL = ("preset", "steps", "fp_presets", "fp_seeds")  # set otherwise, the table is another one


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="trimtab bench healing", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", default="runs/bench-healing", help="parent of the run directories")
    parser.add_argument("--scenarios", help="comma-separated subset (default: all)")
    parser.add_argument("--fp-presets", default=FP_PRESETS, help="presets of the fault-free auto runs ('' for none)")
    parser.add_argument("--fp-seeds", default="1,2", help="train.seed values of the fault-free auto runs")
    parser.add_argument("--json", help="results JSON (default OUT/healing.json)")
    parser.add_argument(
        "--markdown",
        help="markdown file to write the section into (default: the checkout's BENCHMARKS.md for the whole "
        "table, none for a part of it; '-' for none)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=0,
        help="seconds per launch before a run counts as stalled (default: 10x the clean run, at least 900)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="12 steps, the nan_loss scenario, no fault-free runs; the section printed, not written",
    )
    args = parser.parse_args(argv)
    if args.markdown is None:  # the section is the whole table: a part of it written there dropped every other row
        whole = not args.scenarios and all(getattr(args, k) == parser.get_default(k) for k in PARTIAL)
        args.markdown = str(ROOT / "BENCHMARKS.md") if whole or args.dry_run else "-"
        if args.markdown == "-":
            print("BENCHMARKS.md is not written for a part of the table (--markdown FILE writes this run's section)")
    if args.dry_run:
        args.steps, args.scenarios, args.fp_presets = 12, args.scenarios or "nan_loss", ""
        if args.out == parser.get_default("out"):  # a dry run's runs go where nothing is kept
            with tempfile.TemporaryDirectory(prefix="trimtab-bench-healing-") as tmp:
                args.out = tmp
                return _main(args, parser)
    return _main(args, parser)


def _main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # stopped (timeout, a scheduler): unwind, so a real-disk scenario's tmpfs is unmounted
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
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
    start, runs, code, garbage = time.monotonic(), {}, _code_version(), None
    presets = {name: preset_for(name, args.preset) for name in names}
    clean_key = {p: "clean" if p == args.preset else f"clean@{p}" for p in (args.preset, *presets.values())}
    for preset, key in clean_key.items():  # each preset's fault-free reference
        for mode in ("off", "auto"):
            runs[f"{key}/{mode}"] = run = run_training(
                out / f"{key.replace('@', '-')}-{mode}", args, mode, [], None, 3600, preset
            )
            print(f"{key} {mode}: {run['status']}, val_loss {run['val_loss']}, {run['wall_s']:.0f}s", flush=True)
    clean = runs["clean/off"]["val_loss"]
    timeout = args.timeout or max(900.0, 10 * runs["clean/off"]["wall_s"])  # contention slows runs 10x
    sizes = checkpoint_sizes(Path(runs["clean/off"]["run_dir"]))
    for name in names:
        key = clean_key[presets[name]]
        cfg = load_config(preset=presets[name])
        limit = cfg.orchestrator.moe.imbalance if name in MOE_SCENARIOS else None
        disk, setup = real_setup(name, sizes, cfg.optim.lr)
        sets, scenario_args, reference = settings(name, cfg.optim.lr), args, runs[f"{key}/off"]
        if name in (GARBAGE, SCREENED):  # its own corpus, run length and clean reference
            garbage = garbage or prepare(out / GARBAGE, GARBAGE_BYTES, GARBAGE_EPOCHS, presets[name], cfg.train.seed)
            setup, sets = describe(garbage, GARBAGE_BYTES), garbage["sets"]
            sets += ("data.garbage_filter=drop",) if name == SCREENED else ("data.garbage_filter=warn",)
            scenario_args = argparse.Namespace(**{**vars(args), "steps": garbage["steps"]})
            if f"{GARBAGE}/clean" not in runs:
                reference = run_training(
                    out / f"{GARBAGE}-clean",
                    scenario_args,
                    "off",
                    [],
                    None,
                    timeout,
                    presets[name],
                    garbage["clean_sets"],
                )
                runs[f"{GARBAGE}/clean"] = reference | {"kind": "real", "setup": "the same corpus without the garbage"}
                print(f"{GARBAGE} clean off: {reference['status']}, val_loss {reference['val_loss']}", flush=True)
            reference = runs[f"{GARBAGE}/clean"]
        for mode in ("off", "auto"):
            try:
                if name in REAL_DISK and disk is None:
                    raise Unmountable("the clean run left no checkpoint to size the tmpfs from")
                run = run_training(
                    out / f"{name}-{mode}",
                    scenario_args,
                    mode,
                    table[name],
                    "same" if name in PREEMPTION else "freed" if name in FREED else None,
                    max(timeout, 10 * reference["wall_s"]),
                    presets[name],
                    sets,
                    disk,
                )
            except Unmountable as exc:
                runs.update({f"{name}/{m}": skipped(m, presets[name], setup, str(exc)) for m in ("off", "auto")})
                print(f"{name:18s} skipped: {exc}", flush=True)
                break
            run |= {"kind": "real" if name in REAL else "injected", "setup": setup}
            if name in (GARBAGE, SCREENED):  # judged against its own corpus's clean run
                run["reference"] = f"{GARBAGE}/clean"
            if name in (GARBAGE, SCREENED) and (Path(run["run_dir"]) / "config.yaml").is_file():
                # the garbage rows of the run's own training rows, rebuilt from its config
                rows = truth(Path(run["run_dir"]))
                bad, touched = set(rows["bad"]), set(rows["touched"])
                run["attribution"] = attribution(run["run_dir"], run["decisions"], bad, touched)
                run["garbage_rows"] = {k: rows[k] if k == "rows" else len(rows[k]) for k in ("rows", "bad", "touched")}
            judge(run, reference["val_loss"], limit)
            runs[f"{name}/{mode}"] = run
            print(
                f"{name:18s} {mode:4s} {run['outcome'][:60]:60s} val_loss {run['val_loss']} "
                f"decisions {len(run['decisions'])} redone {run['steps_redone']} {run['wall_s']:.0f}s "
                f"(other CPU {run['other_cpu']:.0%})",
                flush=True,
            )
    for key in clean_key.values():
        judge(runs[f"{key}/auto"], runs[f"{key}/off"]["val_loss"])
    false_positives = _fault_free_runs(args, out, timeout)
    shares = [r["other_cpu"] for r in runs.values() if not r.get("skipped")]
    code_end = _code_version()
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "code": code if code == code_end else f"{code}..{code_end} (changed during the runs)",
        "machine": machine(),
        "preset": args.preset,
        "steps": args.steps,
        "checkpoint_every": max(1, args.steps // 6),
        "scenarios": names,
        "clean_val_loss": clean,
        "runtime_s": round(time.monotonic() - start),
        "other_cpu": f"{min(shares):.0%}-{max(shares):.0%} (median {sorted(shares)[len(shares) // 2]:.0%})",
        "runs": runs,
        "false_positives": false_positives,
    }
    results["verdicts"] = verdicts(results)
    json_path = Path(args.json) if args.json else out / "healing.json"
    json_path.write_text(json.dumps(results, indent=1))
    measured = {key: r["precision"] for key, r in runs.items() if r.get("precision")}
    publish(
        HEADING,
        report(results),
        precision=precisions(measured) if measured else "not recorded (no run finished)",
        other_cpu=shares,
        dry_run=args.dry_run,
        markdown=args.markdown,
        date=results["date"],
        on=results["machine"],
        torch_version=results["torch"],
    )
    print(f"wrote {json_path}" + ("" if args.dry_run or args.markdown == "-" else f" and {args.markdown}"))
    return 0


def _fault_free_runs(args: argparse.Namespace, out: Path, timeout: float) -> dict[str, dict[str, Any]]:
    """Clean runs in auto on every debug preset and several seeds: every action the orchestrator
    takes there is a false one (goal: none)."""
    runs = {}
    seeds = [s for s in args.fp_seeds.split(",") if s]
    for preset in [p for p in args.fp_presets.split(",") if p]:
        for seed in seeds:
            run = run_training(
                out / f"fp-{preset}-{seed}", args, "auto", [], None, timeout, preset, sets=(f"train.seed={seed}",)
            )
            runs[f"{preset}/{seed}"] = run
            print(f"fault-free {preset} seed {seed}: {run['status']}, {len(run['decisions'])} decisions", flush=True)
    return runs


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
        return _source_digest()
    return commit.stdout.strip() + (" with local changes" if dirty.stdout.strip() else "")


def _source_digest() -> str:
    """Without git (a release tarball, a copied tree), the package version and a digest of its
    source files: two tables that read the same digest measured the same policy."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "src" / "trimtab").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return f"trimtab {trimtab.__version__}, source sha256 {digest.hexdigest()[:12]} (no git)"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
