"""Hyperparameter search on `debug`: does TPE reach the grid's best in a third of its trials?

    python bench/tune.py [--steps 30] [--seeds 0 1 2 3 4] [--workers 2] [--work DIR]

An exhaustive grid (6 learning rates log-spaced over [3e-4, 3e-2] x warm-up 0 / 10 / 20 steps:
18 trials) against `trimtab tune`'s TPE sampler over the same ranges, continuous, with a third of
the grid's trials (6: 2 random start-up points, then multivariate TPE), once per seed. Every trial is a short
`debug` run of `--steps` steps scored by its final validation loss, which is deterministic given
the config (checked: the grid's best trial trained again gives the same loss), so the figures do
not depend on how loaded the machine is; wall time does. Results go to the "Hyperparameter search"
section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


from _benchfile import replace_section, scratch  # noqa: E402  bench/_benchfile.py, next to this file
from trimtab import api  # noqa: E402
from trimtab.config import load_config  # noqa: E402
from trimtab.tune import tune  # noqa: E402

HEADING = "## Hyperparameter search (bench/tune.py)"
LR = [3e-4, 3e-2]
WARMUP = [0, 20]


def space_file(work: Path, name: str, sampler: dict, space: dict, steps: int, seed: int) -> Path:
    doc = {
        "study": {"name": name, "sampler": sampler, "seed": seed},
        "base": {"preset": "debug", "log": {"tensorboard": False, "report": False}, "checkpoint": {"every": 0}},
        "budget": {"max_steps": steps, "eval_every": steps},
        "space": space,
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def grid(work: Path, steps: int, workers: int) -> tuple[float, dict, int, float]:
    space = {
        "optim.lr": {"log_uniform": LR, "steps": 6},
        "optim.warmup_steps": {"int": WARMUP, "steps": 3},
    }
    t0 = time.perf_counter()
    result = tune(space_file(work, "grid", "grid", space, steps, 0), workers=workers, out=work / "grid")
    best = result.best
    return best.values[0], best.user_attrs, len(result.study.trials), time.perf_counter() - t0


def tpe(work: Path, steps: int, trials: int, seed: int) -> tuple[float, dict]:
    space = {"optim.lr": {"log_uniform": LR}, "optim.warmup_steps": {"int": WARMUP}}
    path = space_file(work, f"tpe-{seed}", "tpe", space, steps, seed)  # trimtab's TPE defaults
    result = tune(path, trials=trials, workers=1, out=work / f"tpe-{seed}")  # one worker: reproducible
    return result.best.values[0], result.best.params


def rerun(work: Path, attrs: dict) -> float:
    """The grid's best config trained again from scratch: the same loss if runs are deterministic."""
    cfg = load_config(overrides={**attrs["config"], "out": str(work / "rerun")})
    return api.train(cfg)["val_loss"]


def report(steps: int, grid_row: tuple, rows: list[tuple], again: float) -> str:
    best, attrs, n, seconds = grid_row
    params = attrs["config"]["optim"]
    lines = [
        HEADING,
        "",
        f"`python bench/tune.py --steps {steps}`: `debug`, {steps} steps a trial, final validation loss; "
        f"grid: 6 learning rates log-spaced over [{LR[0]:g}, {LR[1]:g}] x warm-up {{0, 10, 20}} = {n} trials "
        f"({seconds:.0f} s); TPE: the same ranges, continuous, {n // 3} trials (trimtab's defaults: "
        f"{max(2, n // 3 // 4)} random start-up trials, multivariate).",
        "",
        f"Grid best: **{best:.4f}** (lr {params['lr']:.3g}, warm-up {params['warmup_steps']}); trained again: "
        f"{again:.4f} ({'deterministic' if again == best else 'differs'}).",
        "",
        "| TPE seed | trials | best val_loss | lr | warm-up | gap to grid best | within 1% |",
        "|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for seed, value, p in rows:
        gap = (value - best) / best * 100
        lines.append(
            f"| {seed} | {n // 3} | {value:.4f} | {p['optim.lr']:.3g} | {p['optim.warmup_steps']} | {gap:+.3f}% | "
            f"{'yes' if gap <= 1.0 else 'no'} |"
        )
    hits = sum((v - best) / best <= 0.01 for _, v, _ in rows)
    lines += ["", f"TPE within 1% of the grid's best with a third of its trials: {hits} of {len(rows)} seeds."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work", help="scratch directory (default: a temp dir, removed after)")
    args = parser.parse_args()
    with scratch(args.work, "trimtab-tune-") as work:
        grid_row = grid(work, args.steps, args.workers)
        rows = [(s, *tpe(work, args.steps, grid_row[2] // 3, s)) for s in args.seeds]
        section = report(args.steps, grid_row, rows, rerun(work, grid_row[1]))
        print(section)
        replace_section(ROOT / "BENCHMARKS.md", HEADING, section)


if __name__ == "__main__":
    main()
