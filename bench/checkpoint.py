"""Checkpoint stall: what a save costs training, synchronous vs in the background (checkpoint.asynchronous).

    python bench/checkpoint.py [--presets small,dense-25m] [--reps 10] [--dry-run]

One process per preset builds the run, trains one step (so AdamW's moments exist) and then saves
`--reps` pairs back to back, alternating: a synchronous save (written, fsynced and committed
before training may go on) and a background one, whose stall is the host copy of weights,
moments and RNG (DCP's stager; its buffers reused from save to save) and whose write is timed
separately until finish_save returns. The first background save allocates the copy's buffers:
reported on its own, left out of the pairs. The ratio is paired (sync_i / async_i, adjacent), its
interval a bootstrap of the median. On a GPU the copy is device -> pinned host memory; here it is
a host memcpy, and the disk is whatever holds --work (the run directory).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

from _benchfile import publish, scratch  # bench/_benchfile.py, next to this file
from _measure import emit, median_ci, paired_ratio, run_child, run_here  # bench/_measure.py, next to this file

HEADING = "## Checkpoint stall: synchronous vs background saves (`bench/checkpoint.py`)"


def child(preset: str, reps: int, out: str) -> None:
    import torch

    from trimtab.config import load_config
    from trimtab.training.setup import setup
    from trimtab.training.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(
        None,
        overrides={
            "preset": preset,
            "out": out,
            "train": {"max_steps": 1, "eval_every": 0},
            "checkpoint": {"every": 0, "keep": 2, "asynchronous": True},
            "log": {"progress": False, "tensorboard": False, "report": False},
            "orchestrator": {"mode": "off"},
        },
    )
    trainer = Trainer(setup(cfg))
    trainer.fit()  # one step and its checkpoint: the optimizer holds its moments
    times: dict[str, list[float]] = {"sync": [], "stall": [], "write": []}
    first = None
    for i in range(reps + 1):
        trainer.state.step += 1
        t0 = time.perf_counter()
        trainer.save(wait=True)
        sync = time.perf_counter() - t0
        trainer.state.step += 1
        t0 = time.perf_counter()
        trainer.save()
        stall = time.perf_counter() - t0
        t0 = time.perf_counter()
        trainer.finish_save()
        write = time.perf_counter() - t0
        if i == 0:
            first = stall
            continue
        for key, value in zip(times, (sync, stall, write)):
            times[key].append(value)
    params = sum(p.numel() for p in trainer.model.parameters())
    kept = list((trainer.cfg.run_dir / "checkpoints").glob("step_*"))
    bytes_ = sum(f.stat().st_size for c in kept for f in c.iterdir() if f.is_file()) / len(kept)
    emit({"params": params, "bytes": bytes_, "first": first, **times})


def row(preset: str, r: dict) -> str:
    def med(key: str) -> str:
        low, high = median_ci(r[key])
        return f"{statistics.median(r[key]) * 1000:.1f} ({low * 1000:.1f}-{high * 1000:.1f})"

    ratio = paired_ratio(r["sync"], r["stall"])
    return (
        f"| `{preset}` | {r['params'] / 1e6:.1f}M | {r['bytes'] / 2**20:.0f} | {med('sync')} | {med('stall')} "
        f"| {r['first'] * 1000:.1f} | {med('write')} | **{ratio}** |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="small,dense-25m")
    ap.add_argument("--reps", type=int, default=10, help="pairs of saves per preset")
    ap.add_argument("--work", default=None, help="where the run directories go (default: a temp dir)")
    ap.add_argument("--child", nargs=3, metavar=("PRESET", "REPS", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true", help="debug, 2 pairs, no BENCHMARKS.md")
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), args.child[2])
    presets, reps = (["debug"], 2) if args.dry_run else (args.presets.split(","), args.reps)
    results = {}
    with scratch(args.work, "bench-checkpoint-") as work:
        for preset in presets:
            print(f"{preset} ...", flush=True)
            what = f"{preset}'s saves"
            if args.dry_run:  # checks that it runs, not what it measures: no fresh interpreter (~3 s of CPU)
                results[preset] = run_here(functools.partial(child, preset, reps, str(work / preset)), what)
                continue
            cmd = [sys.executable, __file__, "--child", preset, str(reps), str(work / preset)]
            results[preset] = run_child(cmd, what)
    body = (
        f"One process (one thread), {reps} pairs of saves per preset after one training step, alternating "
        "synchronous and background; milliseconds, median (95% interval). Sync: the whole save, files "
        "written, fsynced and committed. Background stall: what training waits for, the host copy of "
        "weights, AdamW's moments and RNG; first: the first background save, which allocates that copy's "
        "buffers; write: the background thread's remaining work, waited for here (in a run it overlaps the "
        "next steps). Ratio: sync / background stall, paired.\n\n"
        "| preset | parameters | checkpoint (MiB) | sync save (ms) | background stall (ms) | first (ms) "
        "| background write (ms) | sync / stall |\n|---|---|---|---|---|---|---|---|\n"
        + "\n".join(row(p, r) for p, r in results.items())
    )
    publish(HEADING, body, precision="fp32", other_cpu=[r["other_cpu"] for r in results.values()], dry_run=args.dry_run)


if __name__ == "__main__":
    main()
