"""Checkpoint averaging (LAWA) on `small`: does the mean of the last K checkpoints beat the last one?

    python bench/lawa.py [--preset small] [--every 20] [--seeds 0 1] [--work DIR]

Trains the preset once per seed keeping a checkpoint every `--every` steps, then, at the middle
and at the end of the run, compares the validation loss of the checkpoint there with that of
`trimtab merge --method average` over it and the K - 1 before it (K = 2, 3, 5), on the run's
own held-out batches (the same for every model). Kaddour 2022 ("Stop Wasting My Time!") and
Sanyal et al. 2023 ("Early weight averaging meets high learning rates for LLM pre-training")
report gains mid-run, at high learning rate, and fading as the LR decays. Results go to the
"Checkpoint averaging" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from _benchfile import precisions, publish, scratch  # noqa: E402  bench/_benchfile.py, next to this file
from _measure import Contention  # noqa: E402
from trimtab import api  # noqa: E402
from trimtab.checkpoint import list_checkpoints  # noqa: E402
from trimtab.checkpoint_load import load_model  # noqa: E402
from trimtab.config import read_saved  # noqa: E402
from trimtab.merge import average  # noqa: E402
from trimtab.model import build_model  # noqa: E402
from trimtab.training.loss import cross_entropy_sum  # noqa: E402
from trimtab.training.phase_data import build_phases  # noqa: E402

HEADING = "## Checkpoint averaging (bench/lawa.py)"
KS = (2, 3, 5)
PRECISIONS: dict[str, str] = {}  # each seed's run: the precision train.precision resolved to


def val_loss(run_dir: Path, checkpoint: Path, batches) -> float:
    model = build_model(read_saved(run_dir).model)
    load_model(model, checkpoint)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for micro in batches:
            total += cross_entropy_sum(model.hidden(micro.inputs), model.lm_head.weight, micro.targets).item()
            count += micro.n_targets
    return total / count


def one_seed(preset: str, every: int, seed: int, work: Path, steps: int | None = None) -> list[dict]:
    run = work / f"{preset}-seed{seed}"
    train = {"seed": seed} | ({"max_steps": steps} if steps else {})
    overrides = {"train": train, "checkpoint": {"every": every, "keep": 1000}, "log": {"progress": False}}
    PRECISIONS[f"seed {seed}"] = api.train(preset=preset, out=str(run), **overrides)["precision"]
    cfg = read_saved(run)
    batches = build_phases(cfg, run / "tokenizer.json")[1][0].eval_micro
    steps = [p for p in list_checkpoints(run) if int(p.name[5:]) > 0]
    rows = []
    for end in (len(steps) // 2 - 1, len(steps) - 1):
        last = steps[end]
        row = {"seed": seed, "step": int(last.name[5:]), "last": val_loss(run, last, batches)}
        for k in KS:
            trimmed = work / "trim"
            shutil.rmtree(trimmed, ignore_errors=True)
            shutil.copytree(run, trimmed, ignore=shutil.ignore_patterns("tb", "eval"))
            for later in list_checkpoints(trimmed)[
                list_checkpoints(trimmed).index(trimmed / "checkpoints" / last.name) + 1 :
            ]:
                shutil.rmtree(later)
            out = average(trimmed, k, work / f"avg{k}")
            row[k] = val_loss(out, list_checkpoints(out)[0], batches)
            shutil.rmtree(out)
        rows.append(row)
        print(row, flush=True)
    return rows


def report(rows: list[dict], preset: str, every: int) -> str:
    lines = [
        f"`{preset}`, a checkpoint every {every} steps, the run's own held-out "
        "batches; the average of the last K checkpoints (K including the one compared against).",
        "",
        "| seed | at step | last checkpoint | " + " | ".join(f"mean of last {k}" for k in KS) + " |",
        "|---|---|---|" + "---|" * len(KS),
    ]
    for r in rows:
        cells = " | ".join(f"{r[k]:.4f} ({r[k] - r['last']:+.4f})" for k in KS)
        lines.append(f"| {r['seed']} | {r['step']} | {r['last']:.4f} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--work", help="scratch directory (default: a temp dir, removed after)")
    parser.add_argument("--dry-run", action="store_true", help="debug, 20 steps, a checkpoint every 2; print only")
    args = parser.parse_args()
    steps = None
    if args.dry_run:
        args.preset, args.every, args.seeds, steps = "debug", 2, [0], 20
    with scratch(args.work, "trimtab-lawa-") as work, Contention() as busy:
        rows = [row for seed in args.seeds for row in one_seed(args.preset, args.every, seed, work, steps)]
    # losses, not timings: the CPU share is recorded, it moves no figure
    body = report(rows, args.preset, args.every)
    publish(HEADING, body, precision=precisions(PRECISIONS), other_cpu=busy.other, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
