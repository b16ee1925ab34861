"""Hyperparameter search on `debug`: does TPE reach the grid's best in a third of its trials?

    python bench/tune.py [--steps 30] [--lrs 6] [--warmups 0 10 20] [--seeds 0 1 2 3 4] [--workers 2]

An exhaustive grid (`--lrs` learning rates log-spaced over [3e-4, 3e-2] x the `--warmups` warm-up
steps; 6 x 3 = 18 trials by default) against `trimtab tune`'s TPE sampler over the same ranges,
continuous, with a third of the grid's trials (trimtab's defaults: a quarter of them random
start-up points, then multivariate TPE), once per seed. Every trial is a short
`debug` run of `--steps` steps scored by its final validation loss, which is deterministic given
the config (checked: the grid's best trial trained again gives the same loss), so the figures do
not depend on how loaded the machine is; wall time does. The least of many noisy runs flatters
whichever search ran more of them (the winner's curse), so the grid's best and each TPE best
are also trained again with other `train.seed`s (`--confirm`) and compared by their means.
Results go to the "Hyperparameter search" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


from _benchfile import precisions, publish, scratch  # noqa: E402  bench/_benchfile.py, next to this file
from _measure import Contention  # noqa: E402
from trimtab import api  # noqa: E402
from trimtab.config import dump_yaml, load_config  # noqa: E402
from trimtab.tune import tune  # noqa: E402

HEADING = "## Hyperparameter search (bench/tune.py)"
LR = [3e-4, 3e-2]
PRECISIONS: dict[str, str] = {}  # the precision each retrained run resolved to (train.precision auto)


def space_file(work: Path, name: str, sampler: dict, space: dict, steps: int, seed: int) -> Path:
    doc = {
        "study": {"name": name, "sampler": sampler, "seed": seed},
        "base": {"preset": "debug", "log": {"tensorboard": False, "report": False}, "checkpoint": {"every": 0}},
        "budget": {"max_steps": steps, "eval_every": steps},
        "space": space,
    }
    path = work / f"{name}.yaml"
    path.write_text(dump_yaml(doc))
    return path


def grid(work: Path, steps: int, lrs: int, warmups: list[int], workers: int) -> tuple[float, dict, int, float]:
    space = {
        "optim.lr": {"log_uniform": LR, "steps": lrs},
        "optim.warmup_steps": {"choice": warmups},
    }
    t0 = time.perf_counter()
    result = tune(space_file(work, "grid", "grid", space, steps, 0), workers=workers, out=work / "grid")
    best = result.best
    return best.values[0], best.user_attrs, len(result.study.trials), time.perf_counter() - t0


def tpe(work: Path, steps: int, warmups: list[int], trials: int, seed: int) -> tuple[float, dict, dict]:
    space = {"optim.lr": {"log_uniform": LR}, "optim.warmup_steps": {"int": [min(warmups), max(warmups)]}}
    path = space_file(work, f"tpe-{seed}", "tpe", space, steps, seed)  # trimtab's TPE defaults
    result = tune(path, trials=trials, workers=1, out=work / f"tpe-{seed}")  # one worker: reproducible
    return result.best.values[0], result.best.params, result.best.user_attrs


def retrain(work: Path, attrs: dict, seed: int | None = None) -> float:
    """A trial's config trained again from scratch, with its own `train.seed` (the same loss if
    runs are deterministic) or another one (another initialisation and data order)."""
    config = attrs["config"]
    train = {**config["train"], **({} if seed is None else {"seed": seed})}
    out = Path(tempfile.mkdtemp(dir=work, prefix="retrain-"))
    summary = api.train(load_config(overrides={**config, "train": train, "out": str(out)}))
    PRECISIONS[out.name] = summary["precision"]
    return summary["val_loss"]


def confirm(work: Path, attrs: dict, seeds: list[int]) -> float:
    """The mean validation loss of a config over other training seeds: picking the least of 36
    noisy runs flatters the grid's best (the winner's curse), so both bests are judged afresh."""
    return statistics.mean(retrain(work, attrs, s) for s in seeds)


def report(args: argparse.Namespace, grid_row: tuple, rows: list[tuple], again: float, grid_mean: float) -> str:
    steps, lrs, warmups, seeds = args.steps, args.lrs, args.warmups, args.confirm
    best, attrs, n, seconds = grid_row
    params = attrs["config"]["optim"]
    lines = [
        f"`python bench/tune.py --steps {steps} --lrs {lrs} --warmups {' '.join(map(str, warmups))}`: `debug`, "
        f"{steps} steps a trial, final validation loss; grid: {lrs} learning rates log-spaced over "
        f"[{LR[0]:g}, {LR[1]:g}] x warm-up {{{', '.join(map(str, warmups))}}} = {n} trials "
        f"({seconds:.0f} s); TPE: the same ranges, continuous, {n // 3} trials (trimtab's defaults: "
        f"{max(2, n // 3 // 4)} random start-up trials, multivariate).",
        "",
        f"Grid best: **{best:.4f}** (lr {params['lr']:.3g}, warm-up {params['warmup_steps']}); trained again: "
        f"{again:.4f} ({'deterministic' if again == best else 'differs'}); its mean over train.seed "
        f"{', '.join(map(str, seeds))} (another initialisation and data order): **{grid_mean:.4f}**.",
        "",
        f"| TPE seed | trials | best val_loss | lr | warm-up | gap to grid best | within 1% | mean over "
        f"train.seed {', '.join(map(str, seeds))} | gap of the means | within 1% |",
        "|---:|---:|---:|---:|---:|---:|:---:|---:|---:|:---:|",
    ]
    for seed, value, p, _, mean in rows:
        gap, mean_gap = (value - best) / best * 100, (mean - grid_mean) / grid_mean * 100
        lines.append(
            f"| {seed} | {n // 3} | {value:.4f} | {p['optim.lr']:.3g} | {p['optim.warmup_steps']} | {gap:+.3f}% | "
            f"{'yes' if gap <= 1.0 else 'no'} | {mean:.4f} | {mean_gap:+.3f}% | {'yes' if mean_gap <= 1.0 else 'no'} |"
        )
    hits = sum((r[1] - best) / best <= 0.01 for r in rows)
    fresh = sum((r[4] - grid_mean) / grid_mean <= 0.01 for r in rows)
    lines += [
        "",
        f"TPE within 1% of the grid's best with a third of its trials: {hits} of {len(rows)} seeds on the "
        f"search's own runs; {fresh} of {len(rows)} when both bests are trained again with other seeds.",
        f"The grid's best run is {(best - grid_mean) / grid_mean:+.2%} from its own mean over other seeds: "
        "the margin to resolve is to be read against that seed-to-seed spread.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lrs", type=int, default=6, help="grid points over the learning rate range")
    parser.add_argument("--warmups", type=int, nargs="+", default=[0, 10, 20], help="the grid's warm-up steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--confirm", type=int, nargs="+", default=[1, 2, 3], help="train seeds to retrain bests with")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work", help="scratch directory (default: a temp dir, removed after)")
    parser.add_argument("--dry-run", action="store_true", help="4-step trials, a 3 x 2 grid, 1 TPE seed; print only")
    args = parser.parse_args()
    if args.dry_run:
        args.steps, args.lrs, args.warmups, args.seeds, args.confirm, args.workers = 4, 3, [0, 2], [0], [1], 1
    with scratch(args.work, "trimtab-tune-") as work, Contention() as busy:
        grid_row = grid(work, args.steps, args.lrs, args.warmups, args.workers)
        rows = [(s, *tpe(work, args.steps, args.warmups, grid_row[2] // 3, s)) for s in args.seeds]
        rows = [(*row, confirm(work, row[3], args.confirm)) for row in rows]
        again, grid_mean = retrain(work, grid_row[1]), confirm(work, grid_row[1], args.confirm)
    body = report(args, grid_row, rows, again, grid_mean)
    # validation losses, not timings: the CPU share says only how long the wall times took
    publish(HEADING, body, precision=precisions(PRECISIONS), other_cpu=busy.other, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
