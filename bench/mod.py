"""Mixture-of-Depths savings: training step time of MoD models vs the same dense model.

    python bench/mod.py [--rows 16] [--seq-len 256] [--reps 5] [--threads 2 1]

One training step (forward, backward, AdamW) of the `small` preset's shape (d_model 256, 4
layers, vocab 4096) on rows x seq_len tokens, for:

    dense            layer_pattern [dense]
    mod c            layer_pattern [mod], every block processes a fraction c of the tokens
    dense+mod 0.125  layer_pattern [dense, mod] at 0.125: the paper's best setting (Raposo et al.
                     2024, section 4: every other block, 12.5% capacity)

Skipped tokens must skip compute: the target is mod 0.5 <= 0.7x the dense step. The variants
run interleaved, `--reps` times after two warm-up steps each; the median is reported, with the
other processes' CPU share (a busy core slows torch several fold). The FLOPs ratio from
flops_per_token is printed next to the time ratio. Results go to the "Mixture-of-Depths" section
of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _benchfile import replace_section  # noqa: E402  bench/_benchfile.py, next to this file
from _measure import Contention  # noqa: E402  bench/_measure.py, next to this file
from trimtab.config import ModelConfig  # noqa: E402
from trimtab.model import build_model  # noqa: E402

HEADING = "## Mixture-of-Depths (bench/mod.py)"
VARIANTS = {
    "dense": (["dense"], 1.0),
    "mod 0.5": (["mod"], 0.5),
    "mod 0.25": (["mod"], 0.25),
    "mod 0.125": (["mod"], 0.125),
    "dense+mod 0.125": (["dense", "mod"], 0.125),
}


def build(pattern: list[str], capacity: float, seq_len: int):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, max_seq_len=seq_len, layer_pattern=pattern)
    cfg.mod.capacity = capacity
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


def bench(args, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    tokens = torch.randint(0, 4096, (args.rows, args.seq_len + 1))
    built = {name: build(*spec, args.seq_len) for name, spec in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with Contention() as busy:
        for model, opt in built.values():
            for _ in range(2):
                step(model, opt, tokens)
        for _ in range(args.reps):
            for name, (model, opt) in built.items():
                times[name].append(step(model, opt, tokens))
    dense_ms = statistics.median(times["dense"]) * 1e3
    dense_flops = built["dense"][0].flops_per_token(args.seq_len)
    rows = []
    for name, (model, _) in built.items():
        ms = statistics.median(times[name]) * 1e3
        rows.append(
            {
                "threads": threads,
                "variant": name,
                "ms": ms,
                "all": times[name],
                "ratio": ms / dense_ms,
                "flops": model.flops_per_token(args.seq_len) / dense_flops,
                "other": busy.other,
            }
        )
        print(
            f"threads={threads} {name:16s} {ms:8.1f} ms  x{ms / dense_ms:.2f} of dense "
            f"(FLOPs x{rows[-1]['flops']:.2f})  other CPU {busy.other:.0%}",
            flush=True,
        )
    return rows


def write_report(args, rows: list[dict], elapsed: float) -> None:
    lines = [
        HEADING,
        "",
        f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}; one training step (forward, backward, "
        f"AdamW) of the `small` shape (d_model 256, 4 layers, vocab 4096) on {args.rows} x "
        f"{args.seq_len} tokens, fp32; median of {args.reps} interleaved repetitions "
        f"({elapsed:.0f} s in all). Target: mod 0.5 <= 0.7x dense.",
        "",
        "| torch threads | variant | ms (median) | all reps | step time vs dense | FLOPs vs dense "
        "(flops_per_token) | other processes' CPU share |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        each = ", ".join(f"{t * 1e3:.0f}" for t in r["all"])
        name = f"**{r['variant']}**" if r["variant"] == "mod 0.5" else r["variant"]
        lines.append(
            f"| {r['threads']} | {name} | {r['ms']:,.1f} | {each} | {r['ratio']:.2f}x | "
            f"{r['flops']:.2f}x | {r['other']:.0%} |"
        )
    lines += [
        "",
        "- mod c: every block routes the top c of each sequence's tokens through attention and "
        "feed-forward (gathered into a shorter sequence) and the rest along the residual; the "
        "router and the causal predictor run on every token. The lm head and embedding are not "
        "routed, which is why the step time stays above c.",
    ]
    section = "\n".join(lines) + "\n"
    print(section)
    replace_section(ROOT / "BENCHMARKS.md", HEADING, section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads(), 1])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = [row for th in dict.fromkeys(args.threads) for row in bench(args, th)]
    if not args.no_write:
        write_report(args, rows, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
