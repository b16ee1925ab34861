"""The fused linear cross-entropy (training/loss.py) against the plain loss, by chunk size: time
of forward + backward and peak memory above the inputs, at one micro-batch's shape.

    python bench/loss.py [--tokens 16384] [--d-model 2048] [--vocab 50304] [--chunks 1024 4096 8192]
                         [--reps 20] [--bf16] [--no-write] [--dry-run]

    plain       F.linear under bf16 autocast, then F.cross_entropy on the fp32 logits (autograd
                keeps the logits and their log-probabilities)
    fused C     cross_entropy_sum(hidden, head, targets, chunk=C): C tokens' logits at a time,
                their gradients taken in the forward

On CUDA bf16 autocast, timed after a synchronize; on CPU fp32 (the trainer's choice there for
most models), or bf16 autocast with --bf16. Every variant is checked against plain (loss to 1e-3, gradients
to 2e-2 relative), then the variants alternate --reps times and the median is reported. Results
go to the "Fused cross-entropy" section of BENCHMARKS.md.
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
from _measure import Contention, paired_ratio  # noqa: E402
from trimtab.training.loss import cross_entropy_sum  # noqa: E402

HEADING = "## Fused cross-entropy (bench/loss.py)"


def variants(chunks: list[int]) -> dict:
    def plain(h, w, t):
        logits = F.linear(h, w)
        return F.cross_entropy(logits.float().flatten(0, 1), t.flatten(), reduction="sum")

    out = {"plain": plain}
    for c in chunks:
        out[f"fused {c}"] = lambda h, w, t, c=c: cross_entropy_sum(h, w, t, chunk=c)
    return out


def run(f, h, w, t, autocast: bool):
    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = f(h, w, t)
    return loss.detach(), torch.autograd.grad(loss, (h, w))


def timed(f, h, w, t, autocast: bool) -> tuple[float, float]:
    """Seconds and peak bytes above what was allocated before (CUDA; 0 on CPU)."""
    cuda = h.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    run(f, h, w, t, autocast)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return seconds, (torch.cuda.max_memory_allocated() - base) if cuda else 0.0


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = device.type == "cuda" or args.bf16
    torch.manual_seed(0)
    N, D, V = args.tokens, args.d_model, args.vocab
    h = torch.randn(1, N, D, device=device, requires_grad=True)
    w = (0.02 * torch.randn(V, D, device=device)).requires_grad_()
    t = torch.randint(0, V, (1, N), device=device)
    fs = variants(args.chunks)
    ref, ref_grads = run(fs["plain"], h, w, t, autocast)
    for name, f in fs.items():  # same function first, then speed
        loss, grads = run(f, h, w, t, autocast)
        assert rel(loss, ref) < 1e-3 and all(rel(a, b) < 2e-2 for a, b in zip(grads, ref_grads)), name
    del ref_grads
    times: dict[str, list[float]] = {n: [] for n in fs}
    peaks: dict[str, float] = {}
    with Contention() as busy:
        for _ in range(2):  # warm-up
            for f in fs.values():
                timed(f, h, w, t, autocast)
        for _ in range(args.reps):
            for name, f in fs.items():
                s, peak = timed(f, h, w, t, autocast)
                times[name].append(s)
                peaks[name] = max(peaks.get(name, 0.0), peak)
    lines = [
        f"{N:,} tokens, d_model {D}, vocab {V:,}; forward + backward; median of {args.reps} alternating "
        "repetitions after 2 warm-ups; vs plain: plain's time over the variant's, paired by repetition, "
        "median with a bootstrap 95% interval.",
        "",
        "| variant | ms (median) | min-max | vs plain | peak memory above inputs MiB |",
        "|---|---|---|---|---|",
    ]
    for n, ts in times.items():
        med, vs = statistics.median(ts), paired_ratio(times["plain"], ts)
        lines.append(
            f"| {n} | {1e3 * med:.2f} | {1e3 * min(ts):.2f}-{1e3 * max(ts):.2f} | {vs.value:.2f}x "
            f"({vs.low:.2f}-{vs.high:.2f}) | {peaks[n] / 2**20:,.0f} |"
        )
    precision = "bf16 autocast" if autocast else "fp32"
    markdown = "-" if args.no_write else None
    publish(
        HEADING, "\n".join(lines), precision=precision, other_cpu=busy.other, dry_run=args.dry_run, markdown=markdown
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast on a CPU too")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--dry-run", action="store_true", help="a tiny shape, 2 repetitions, nothing written")
    ns = parser.parse_args()
    if ns.dry_run:
        ns.tokens, ns.d_model, ns.vocab, ns.chunks, ns.reps = 512, 32, 1000, [128, 256], 2
    main(ns)
