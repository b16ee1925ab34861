"""MoE expert compute: trimtab's MoE layer vs a naive per-expert loop (and two other layouts).

    python bench/moe.py [--tokens 4096] [--d-model 256] [--experts 8 16 32] [--reps 3]

Forward + backward of one MoE layer (router, dispatch, experts, combine) on N tokens, top-2,
in dropless (capacity_factor 0) and capacity (1.25) modes. All variants share the module's
router and weights and are checked against each other before timing.

    moe         trimtab.model.moe.MoE as built (impl "auto": on CPU, sort by expert and run
                three torch.nn.functional.grouped_mm with per-expert offsets, no padding)
    moe-padded  the same module with impl "padded": slots in an [E, C, D] buffer, three bmm
    slices      same sort, then one matmul per expert on its contiguous slice (weights unbind)
    naive       every expert on every token, masked by the routing (loop over experts)

Variants run interleaved, `--reps` times after a warm-up, the median is reported, and the CPU
share of other processes is measured during each size: a busy core slows torch several fold,
and multi-threaded ops with many small parallel regions (slices) most, so every size runs with
torch's default thread count and with 1 thread. Results go to the "MoE expert compute"
section of BENCHMARKS.md.
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
from _measure import Contention  # noqa: E402
from trimtab.config.sparse import MoEConfig  # noqa: E402
from trimtab.model.moe import MoE  # noqa: E402

HEADING = "## MoE expert compute (bench/moe.py)"


def _sorted_assignments(m: MoE, r, n: int):
    """Assignment order grouped by expert (token order within), after capacity; per-expert
    counts. Returns (order [A'], counts [E])."""
    flat = r.experts.flatten()
    order = flat.argsort(stable=True)
    counts = r.counts.long()
    cap = m.capacity(n) if m.training else 0
    if cap:
        rank = torch.arange(flat.numel()) - (counts.cumsum(0) - counts)[flat[order]]
        order, counts = order[rank < cap], counts.clamp(max=cap)
    return order, counts


def slices(m: MoE, x: torch.Tensor) -> torch.Tensor:
    xf = x.reshape(-1, x.shape[-1])
    r = m.route(xf)
    order, counts = _sorted_assignments(m, r, xf.shape[0])
    tok = order // m.top_k
    outs = [
        (F.silu(xe @ a) * (xe @ b)) @ c
        for xe, a, b, c in zip(xf[tok].split(counts.tolist()), m.w1.unbind(0), m.w3.unbind(0), m.w2.unbind(0))
    ]
    out = torch.cat(outs) * r.gates.flatten()[order, None]
    return xf.new_zeros(xf.shape).index_add(0, tok, out)


def naive(m: MoE, x: torch.Tensor) -> torch.Tensor:
    xf = x.reshape(-1, x.shape[-1])
    r = m.route(xf)
    cap = m.capacity(xf.shape[0]) if m.training else 0
    y = torch.zeros_like(xf)
    for e in range(m.n_experts):
        hit = r.experts == e  # [N, k]
        routed = hit.any(-1)
        if cap:
            routed = routed & (routed.cumsum(0) <= cap)
        gate = (r.gates * hit).sum(-1) * routed
        y = y + ((F.silu(xf @ m.w1[e]) * (xf @ m.w3[e])) @ m.w2[e]) * gate[:, None]
    return y


def module(impl: str):
    def run(m: MoE, x: torch.Tensor) -> torch.Tensor:
        m.impl = impl
        return m(x).reshape(-1, x.shape[-1])

    return run


VARIANTS = {"moe": module("auto"), "moe-padded": module("padded"), "slices": slices, "naive": naive}


def _step(fn, m: MoE, x: torch.Tensor, g: torch.Tensor) -> float:
    m.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    (fn(m, x) * g).sum().backward()
    return time.perf_counter() - t0


def bench_size(args, E: int, threads: int) -> list[dict]:
    N, D, H, k = args.tokens, args.d_model, args.hidden, args.top_k
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    x, g = torch.randn(1, N, D), torch.randn(N, D)
    cases = []
    with Contention() as busy:
        for cf in (0.0, 1.25):
            m = MoE(D, H, MoEConfig(n_experts=E, top_k=k, capacity_factor=cf), init_std=0.02)
            names = [v for v in VARIANTS if cf == 0.0 or v != "naive"]  # naive masks all anyway
            with torch.no_grad():
                ref = naive(m, x)
                diff = {v: (VARIANTS[v](m, x) - ref).abs().max().item() for v in names}
                for v in names:  # warm-up (lazy init, allocator) on a slice
                    VARIANTS[v](m, x[:, : N // 8])
            m(x)
            stats = {
                "imbalance": (m.stats["tokens_per_expert"].max() * E / (N * k)).item(),
                "dropped": m.stats["dropped"].item(),
            }
            cases.append((cf, m, names, diff, stats, {v: [] for v in names}))
        for _ in range(args.reps):  # interleaved: each rep times every variant once
            for _, m, names, _, _, times in cases:
                for v in names:
                    times[v].append(_step(VARIANTS[v], m, x, g))
    naive_ms = statistics.median(cases[0][5]["naive"]) * 1e3
    rows = []
    for cf, _, names, diff, stats, times in cases:
        for v in names:
            ms = statistics.median(times[v]) * 1e3
            mode = "dropless" if cf == 0 else f"capacity {cf}"
            rows.append(
                {
                    "threads": threads,
                    "E": E,
                    "mode": mode,
                    "variant": v,
                    "ms": ms,
                    "all": times[v],
                    "speedup": naive_ms / ms,
                    "diff": diff[v],
                    **stats,
                    "other": busy.other,
                }
            )
            print(
                f"threads={threads} E={E:3d} cf={cf:<4} {v:10s} {ms:8.1f} ms  "
                f"x{naive_ms / ms:5.1f} vs naive  max|diff| {diff[v]:.1e}  "
                f"other CPU {busy.other:.0%}",
                flush=True,
            )
    return rows


def write_report(args, rows: list[dict], elapsed: float) -> None:
    lines = [
        "One MoE layer forward + backward "
        f"(router, dispatch, experts, combine), N={args.tokens} tokens, D={args.d_model}, "
        f"expert hidden {args.hidden}, top-{args.top_k}, fp32, random-init router; median of "
        f"{args.reps} interleaved repetitions ({elapsed:.0f} s in all).",
        "",
        "| torch threads | E | mode | variant | ms (median) | all reps | vs naive | "
        "max load / mean | dropped | max abs diff vs naive | other processes' CPU share |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        each = ", ".join(f"{t * 1e3:.0f}" for t in r["all"])
        name = f"**{r['variant']}**" if r["variant"] == "moe" else r["variant"]
        lines.append(
            f"| {r['threads']} | {r['E']} | {r['mode']} | {name} | {r['ms']:,.1f} | "
            f"{each} | {r['speedup']:.1f}x | {r['imbalance']:.2f} | {r['dropped']:.1%} | "
            f"{r['diff']:.1e} | {r['other']:.0%} |"
        )
    lines += [
        "",
        "- **moe** = trimtab.model.moe.MoE as built (CPU: tokens sorted by expert, three "
        'grouped_mm, no padding); moe-padded = the same module, impl "padded" (slots in '
        "[E, C, D], C = largest count capped at the capacity, three bmm); slices = one "
        "matmul per expert on its contiguous slice; naive = every expert on every token, "
        "masked (timed in dropless mode only: its cost does not depend on capacity).",
        "- Max abs diff: each variant's output vs the naive loop with the same capacity.",
    ]
    other = [r["other"] for r in rows if r["variant"] == "naive"]  # one figure per (threads, E)
    markdown = "-" if args.no_write else None
    publish(HEADING, "\n".join(lines), precision="fp32", other_cpu=other, dry_run=args.dry_run, markdown=markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument(
        "--hidden",
        type=int,
        default=352,
        help="expert width (default: the dense ffn width for d_model 256, 704, / top_k)",
    )
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[torch.get_num_threads(), 1],
        help="torch intra-op thread counts to run (default: torch's, then 1)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--dry-run", action="store_true", help="256 tokens, 4 experts, 1 rep, 1 thread; print only")
    args = parser.parse_args()
    if args.dry_run:
        args.tokens, args.d_model, args.hidden, args.experts, args.reps, args.threads = 256, 32, 44, [4], 1, [1]
    t0 = time.perf_counter()
    rows = [row for th in dict.fromkeys(args.threads) for E in args.experts for row in bench_size(args, E, th)]
    write_report(args, rows, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
