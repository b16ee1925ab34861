"""Mixture-of-Depths and hybrid models: training step time vs the dense model of the same shape.

    python bench/mod.py [--rows 16] [--seq-len 256] [--steps 8] [--warmup 1] [--reps 7]
                        [--threads 2 [1]] [--dry-run]

One training step (forward, backward, AdamW) of the `small` preset's shape (d_model 256, 4
layers, 4 heads, vocab 4096) on rows x seq_len random tokens, fp32, for:

    dense            layer_pattern [dense]
    mod c            layer_pattern [mod], every block processes a fraction c of the tokens
    dense+mod 0.125  layer_pattern [dense, mod] at 0.125: the paper's best setting (Raposo et al.
                     2024, section 4: every other block, 12.5% capacity)
    moe              layer_pattern [moe] at the MoE section's defaults: 8 experts, top-2, expert
                     hidden = the dense FFN width / top_k rounded up to 64, 704 / 2 -> 384 (a
                     token's active expert FLOPs 1.09x the dense FFN's), capacity factor 1.25,
                     balance and z-loss on
    hybrid           layer_pattern [dense, moe, mod, moe+mod] (the debug-hybrid preset's pattern
                     and MoD capacities 0.5 and 0.25, its capacity warm-up off) at this shape,
                     MoE as above

Each repetition is one process that builds every variant, runs `--warmup` steps of each, then
`--steps` rounds of one step of each (their order rotating), and takes each variant's median:
run one process per variant instead, a variant swung 20-50% between processes on a shared host
with nothing else running here, while round by round every variant sees the same moments. Peak
RSS comes from a short separate process per variant. `--reps` repetitions; other processes' CPU
share is measured during each (a busy core slows torch several fold). Every "vs dense" step-time
ratio pairs repetition i of the variant and of dense: the median of the pair ratios with a
bootstrap 95% interval (_measure.paired_ratio), next to the FLOPs ratio from flops_per_token.
Skipped tokens must skip compute: the target is mod 0.5 <= 0.7x the dense step (met only when
the whole interval is at or under it, not met when it is all above, else not resolved). Results
go to the "Mixture-of-Depths" section of BENCHMARKS.md (`--dry-run`: tiny batch, one step, one
repetition, printed, nothing written).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _benchfile import publish  # noqa: E402  bench/_benchfile.py, next to this file
from _measure import emit, paired_ratio, run_child  # noqa: E402  bench/_measure.py, next to this file
from trimtab.config import ModelConfig  # noqa: E402
from trimtab.model import build_model  # noqa: E402
from trimtab.training.runtime import peak_rss_mb  # noqa: E402

HEADING = "## Mixture-of-Depths and hybrid step time (bench/mod.py)"
VOCAB = 4096
TARGET = ("mod 0.5", 0.7)  # variant, the most its step may take of the dense step
# name: (layer_pattern, model.mod fields)
VARIANTS = {
    "dense": (["dense"], {}),
    "mod 0.5": (["mod"], {"capacity": 0.5}),
    "mod 0.25": (["mod"], {"capacity": 0.25}),
    "mod 0.125": (["mod"], {"capacity": 0.125}),
    "dense+mod 0.125": (["dense", "mod"], {"capacity": 0.125}),
    "moe": (["moe"], {}),
    "hybrid": (["dense", "moe", "mod", "moe+mod"], {"layer_capacity": [0.5, 0.25]}),
}


def build(name: str, seq_len: int):
    pattern, mod = VARIANTS[name]
    cfg = ModelConfig(vocab_size=VOCAB, d_model=256, n_layers=4, n_heads=4, max_seq_len=seq_len, layer_pattern=pattern)
    for field, value in mod.items():
        setattr(cfg.mod, field, value)
    torch.manual_seed(0)
    model = build_model(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, opt, tokens: torch.Tensor) -> float:
    t0 = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    aux = model.aux_loss()
    (loss if aux is None else loss + aux).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def child(args: argparse.Namespace) -> None:
    """One repetition of every variant ("interleaved"), or one variant alone for its peak RSS:
    warm-up steps, then rounds of one timed step of each (order rotating); a RESULT line."""
    torch.set_num_threads(args.threads[0])
    imports_mb = peak_rss_mb()
    names = list(VARIANTS) if args.variant == "interleaved" else [args.variant]
    built = {name: build(name, args.seq_len) for name in names}
    tokens = torch.randint(0, VOCAB, (args.rows, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    for name in names:
        for _ in range(args.warmup):
            step(*built[name], tokens)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.steps):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(step(*built[name], tokens))
    result = {
        name: {"ms": statistics.median(times[name]) * 1e3, "flops": built[name][0].flops_per_token(args.seq_len)}
        for name in names
    }
    emit({**result, "peak_rss_mb": peak_rss_mb(), "imports_rss_mb": imports_mb})


def _run_child(args: argparse.Namespace, variant: str, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--threads", str(threads), "--rows", str(args.rows)]
    cmd += ["--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    t0 = time.perf_counter()
    result = run_child(cmd, variant, ROOT)
    return {**result, "other": result["other_cpu"], "wall_s": time.perf_counter() - t0}


def bench(args: argparse.Namespace, threads: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for rep in range(args.reps):
        r = _run_child(args, "interleaved", threads)
        for name in VARIANTS:
            runs[name].append({**r[name], "other": r["other"]})
            print(f"threads={threads} rep {rep} {name:16s} {r[name]['ms']:8.1f} ms/step  other CPU {r['other']:.0%}")
        print(f"threads={threads} rep {rep}: {r['wall_s']:.0f} s", flush=True)
    short = argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 1})
    for name in VARIANTS:  # each variant's peak RSS in a process of its own
        alone = _run_child(short, name, threads)
        for r in runs[name]:
            r.update(peak_rss_mb=alone["peak_rss_mb"], imports_rss_mb=alone["imports_rss_mb"])
    return runs


def report(args: argparse.Namespace, results: dict[int, dict[str, list[dict]]], elapsed: float) -> str:
    lines = [
        "A training step (forward, backward, "
        f"AdamW) of the `small` shape (d_model 256, 4 layers, 4 heads, vocab {VOCAB}) on {args.rows} x "
        f"{args.seq_len} random tokens, fp32. Each repetition one process running every variant: "
        f"{args.warmup} warm-up step(s) each, then {args.steps} rounds of one step of each (order rotating), "
        f"each variant's median; {args.reps} repetitions; {elapsed:.0f} s in all. "
        "Step time vs dense: the median of the paired ratios (repetition i of the variant over "
        "repetition i of dense) with a bootstrap 95% interval. Peak RSS: the process's maximum resident "
        "set of a 2-step process running the variant alone, the interpreter and torch included (in "
        "brackets: the part above the imports, i.e. model, optimizer state and the step's activations).",
        "",
        "| torch threads | variant | ms/step (median) | all reps | step time vs dense (95% interval) | "
        "FLOPs vs dense (flops_per_token) | peak RSS MB | other processes' CPU share (median, max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    claims, widest = [], (0.0, "")
    for threads, runs in results.items():
        dense = [r["ms"] for r in runs["dense"]]
        dense_flops = runs["dense"][0]["flops"]
        for name, rs in runs.items():
            ms = [r["ms"] for r in rs]
            if name == "dense":
                vs = "1 (reference)"
            else:
                ratio = paired_ratio(ms, dense)
                vs = f"{ratio.value:.3f}x ({ratio.low:.3f}-{ratio.high:.3f})"
                half = (ratio.high - ratio.low) / 2 / ratio.value
                widest = max(widest, (half, f"{name}, {threads} threads"))
                if name == TARGET[0]:
                    claims.append(
                        f"- {name} / dense step time, {threads} torch threads: **{ratio}**; "
                        f"target <= {TARGET[1]:g}x: {ratio.at_most(TARGET[1])}"
                    )
            peak = max(r["peak_rss_mb"] for r in rs)
            above = max(r["peak_rss_mb"] - r["imports_rss_mb"] for r in rs)
            others = [r["other"] for r in rs]
            label = f"**{name}**" if name == TARGET[0] else name
            lines.append(
                f"| {threads} | {label} | {statistics.median(ms):,.1f} | {', '.join(f'{m:.0f}' for m in ms)} | {vs} | "
                f"{rs[0]['flops'] / dense_flops:.2f}x | {peak:,.0f} (+{above:,.0f}) | "
                f"{statistics.median(others):.0%}, {max(others):.0%} |"
            )
    if args.reps < 5:
        spread = f"- {args.reps} repetition(s): too few for an interval that means anything (5 or more)"
    else:
        resolved = "resolves" if widest[0] <= 0.05 else "does not resolve"
        spread = f"- the widest interval is +-{widest[0]:.1%} of its ratio ({widest[1]}): this run {resolved} 5%"
    lines += [
        "",
        *claims,
        spread,
        "- mod c: every block routes the top c of each sequence's tokens through attention and "
        "feed-forward (gathered into a shorter sequence) and the rest along the residual; the "
        "router and the causal predictor run on every token. The lm head and embedding are not "
        "routed, which is why the step time stays above c.",
        "- moe: flops_per_token counts the router and the top_k experts a token uses; the step also "
        "pays for sorting and gathering the assignments by expert, the combine, the balance and z "
        "losses, and experts run as grouped matmuls (on CPU, torch loops one matmul per expert; the "
        "grouped layout drops assignments past capacity and pads nothing).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="timed rounds per repetition (each variant's median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first, per repetition")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[2], help="torch threads; several: one run each")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--dry-run", action="store_true", help="2 x 32 tokens, 1 + 1 steps, 1 rep; print only")
    parser.add_argument("--child", dest="variant", choices=[*VARIANTS, "interleaved"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dry_run:
        args.rows, args.seq_len, args.steps, args.warmup, args.reps = 2, 32, 1, 1, 1
    if args.steps < 1 or args.reps < 1 or args.warmup < 0:
        parser.error("--steps and --reps must be >= 1, --warmup >= 0")
    if args.variant:
        return child(args)
    t0 = time.perf_counter()
    results = {threads: bench(args, threads) for threads in dict.fromkeys(args.threads)}
    body = report(args, results, time.perf_counter() - t0)
    other = [r["other"] for runs in results.values() for r in runs["dense"]]  # one process a repetition
    markdown = "-" if args.no_write else None
    publish(HEADING, body, precision="fp32", other_cpu=other, dry_run=args.dry_run, markdown=markdown)


if __name__ == "__main__":
    main()
