"""Mixture-of-Depths quality at equal compute: validation loss of `debug-mod` vs `debug` after
the same training FLOPs.

    python bench/mod_quality.py [--steps 200] [--seeds 1 2 3] [--presets debug debug-mod]

The first preset is the reference: it trains `--steps` steps; every other preset trains as many
steps of the same batch as the same FLOPs buy (its flops_per_token, the planner's count, is
smaller: a MoD block at capacity c pays for a fraction c of the tokens; Raposo et al. 2024
compare at equal FLOPs, section 4). Each preset trains once per `--seeds` (`train.seed`: the
initialisation and data order), evaluated at its end on the same held-out tokens; a seed's two
runs are paired, and the ratio of their validation losses is reported as the median with a
bootstrap 95% interval (below 1: the preset beats the reference at equal compute). FLOPs are
counted at the target capacity: MoD's capacity warm-up (`model.mod.warmup_steps`, from all
tokens) spends a little more than counted, which favours MoD by about 1%. Wall time is
recorded too (on this CPU it says what the skipped tokens save). Results go to the
"Mixture-of-Depths quality at equal compute" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _benchfile import precisions, publish, scratch  # noqa: E402  bench/_benchfile.py, next to this file
from _measure import Contention, paired_ratio  # noqa: E402
from trimtab import api  # noqa: E402
from trimtab.config import load_config  # noqa: E402
from trimtab.model.catalog import model_size  # noqa: E402

HEADING = "## Mixture-of-Depths quality at equal compute (bench/mod_quality.py)"
QUIET = {"log": {"progress": False, "tensorboard": False, "report": False}, "checkpoint": {"every": 0}}


def config(preset: str, steps: int, seed: int, out: Path):
    train = {"max_steps": steps, "seed": seed, "eval_every": 0}
    return load_config(preset=preset, overrides={**QUIET, "train": train, "out": str(out)})


def plan(presets: list[str], steps: int, work: Path) -> dict[str, dict]:
    """Steps per preset for the reference's FLOPs (same batch tokens, or it is refused)."""
    sizes = {p: config(p, steps, 0, work / "plan") for p in presets}
    batch = {p: cfg.train.batch_tokens for p, cfg in sizes.items()}
    if len(set(batch.values())) > 1:
        sys.exit(f"the presets' train.batch_tokens differ ({batch}); compare presets with one batch size")
    fpt = {p: model_size(cfg).flops_per_token for p, cfg in sizes.items()}
    budget = steps * batch[presets[0]] * fpt[presets[0]]
    return {p: {"fpt": fpt[p], "steps": round(budget / (batch[p] * fpt[p])), "budget": budget} for p in presets}


def measure(presets: list[str], plans: dict[str, dict], seeds: list[int], work: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {p: [] for p in presets}
    for seed in seeds:
        for p in presets:  # interleaved, so the machine's drift touches every preset alike
            t0 = time.perf_counter()
            summary = api.train(config(p, plans[p]["steps"], seed, work / f"{p}-{seed}"))
            seconds = time.perf_counter() - t0
            runs[p].append({"val_loss": summary["val_loss"], "seconds": seconds, "precision": summary["precision"]})
            print(f"seed {seed} {p}: val_loss {summary['val_loss']:.4f} ({runs[p][-1]['seconds']:.0f} s)", flush=True)
    return runs


def report(args: argparse.Namespace, plans: dict[str, dict], runs: dict[str, list[dict]]) -> str:
    ref = args.presets[0]
    lines = [
        f"`python bench/mod_quality.py --steps {args.steps}`: every preset trained for "
        f"{plans[ref]['budget']:.3g} training FLOPs (the reference `{ref}`'s {args.steps} steps), once per "
        f"train.seed {', '.join(map(str, args.seeds))}, validation loss at the end.",
        "",
        "| preset | FLOPs / token | steps | val loss per seed | mean | wall s (median) |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for p, rs in runs.items():
        losses = [r["val_loss"] for r in rs]
        wall = statistics.median(r["seconds"] for r in rs)
        each = ", ".join(f"{x:.4f}" for x in losses)
        lines.append(
            f"| {p} | {plans[p]['fpt']:,} | {plans[p]['steps']} | {each} | {statistics.mean(losses):.4f} | {wall:.0f} |"
        )
    lines.append("")
    for p in args.presets[1:]:
        ratio = paired_ratio([r["val_loss"] for r in runs[p]], [r["val_loss"] for r in runs[ref]])
        verdict = "better" if ratio.high < 1 else "worse" if ratio.low > 1 else "not resolved (the interval holds 1)"
        lines.append(f"- {p} / {ref} validation loss at equal FLOPs: **{ratio}**: {verdict}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="the reference preset's steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--presets", nargs="+", default=["debug", "debug-mod"], help="the first is the reference")
    parser.add_argument("--work", help="scratch directory (default: a temp dir, removed after)")
    parser.add_argument("--dry-run", action="store_true", help="4 reference steps, 1 seed; print only")
    args = parser.parse_args()
    if args.dry_run:
        args.steps, args.seeds = 4, [1]
    with scratch(args.work, "trimtab-mod-quality-") as work, Contention() as busy:
        plans = plan(args.presets, args.steps, work)
        runs = measure(args.presets, plans, args.seeds, work)
    precision = precisions({p: rs[0]["precision"] for p, rs in runs.items()})
    # losses, not timings: the CPU share moves only the wall times
    publish(HEADING, report(args, plans, runs), precision=precision, other_cpu=busy.other, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
