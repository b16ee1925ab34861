"""Activation memory: the largest batch that fits a memory cap, trimtab vs transformers' LlamaForCausalLM.

    python bench/memory.py [--preset small] [--cap-mb 3000] [--max-rows 256] [--seq-len N] [--dry-run]

Every variant trains the same model shape (the preset's, fp32, eager) on the same rows (trimtab's
loader over the built-in corpus) for 2 optimizer steps of B rows x seq_len as one micro-batch (the
second step runs with AdamW's state allocated). Its peak memory is the whole process's, since a cap
applies to the whole process: peak RSS (VmHWM) on CPU, the caching allocator's peak reserved
bytes on CUDA (what torch.cuda.set_per_process_memory_fraction limits and what runs out), read at
the end of the second step (so trimtab's end-of-run save is not counted). The baseline is the same
figure with the model and optimizer built and the data loaded, before the first step. Each probe
is a fresh subprocess. B doubles from 1 up to --max-rows until it no longer fits (peak > --cap-mb);
between the last two, memory being about linear in B, a guess interpolated from their peaks and
its neighbour usually settle it in two probes, and bisection settles whatever they leave. Peak RSS
repeats to within a few MB: one probe is repeated and the difference printed and reported.

    trimtab            trimtab.api.train_or_raise (Trainer + the orchestrator and built-in hooks) at the
                       preset's defaults (its loss: training/loss.py's cross entropy fused with the
                       lm head, which keeps no [N, V] logits for the backward), fp32, no compile
    trimtab+ckpt       the same with train.activation_checkpointing=full
    transformers       LlamaForCausalLM of the same shape (local config, sdpa attention), its own loss
                       (labels=...), use_cache=False, default AdamW, plain loop
    transformers+ckpt  the same after model.gradient_checkpointing_enable()

Micro-batch auto-sizing (train.micro_batch_tokens=0) is measured on CUDA only: the cap is imposed
with set_per_process_memory_fraction and trimtab trains --max-rows rows a step, its orchestrator
halving the micro-batch on each out-of-memory error; the micro-batch it settles on is reported. On
CPU nothing runs out of memory before the machine swaps, so it is skipped with a printed reason.
Results go to BENCHMARKS.md (`--dry-run`: the debug preset, one probe of 1 row per variant, printed,
nothing written).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from _benchfile import publish  # bench/_benchfile.py, next to this file
from _measure import emit, run_child
from _peers import llama_like  # bench/_peers.py, next to this file
from throughput import _batches  # the throughput bench's batches (trimtab's loader)

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("trimtab", "trimtab+ckpt", "transformers", "transformers+ckpt")
STEPS = 2  # the second step has AdamW's moments allocated: the steady-state peak
DONE: list[dict] = []  # every probe the parent ran, for the report's count and load


def _cuda() -> bool:
    return __import__("torch").cuda.is_available()


def _now_mb() -> float:
    """Memory held now: resident set on CPU (Linux /proc), reserved by torch's allocator on CUDA."""
    if _cuda():
        return __import__("torch").cuda.memory_reserved() / 2**20
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    if _cuda():
        return __import__("torch").cuda.max_memory_reserved() / 2**20
    from trimtab.training.runtime import peak_rss_mb

    return peak_rss_mb()


def _seq_len(args: argparse.Namespace) -> int:
    from trimtab.config import load_config

    return args.seq_len or load_config(preset=args.preset).data.seq_len


def _config(args: argparse.Namespace, rows: int, out: str, ckpt: bool = False, auto: bool = False):
    """The preset at B rows a step in one micro-batch (auto: micro_batch_tokens=0, trimtab sizes it)."""
    from trimtab.config import load_config

    seq = _seq_len(args)
    sets = ["log.progress=false", "log.tensorboard=false", "log.report=false", "train.eval_every=0"]
    sets += ["checkpoint.every=0", "train.precision=fp32", "train.compile=false"]
    if args.seq_len:
        sets += [f"data.seq_len={seq}", f"model.max_seq_len={seq}"]
    train = {"max_steps": STEPS, "batch_tokens": rows * seq, "micro_batch_tokens": 0 if auto else rows * seq}
    train["activation_checkpointing"] = "full" if ckpt else "off"
    return load_config(preset=args.preset, overrides={"out": out, "train": train}, sets=sets)


def run_trimtab(args: argparse.Namespace, ckpt: bool, auto: bool) -> dict:
    from trimtab.api import train_or_raise
    from trimtab.training.hooks import Hook

    class Meter(Hook):
        def on_train_start(self, run):
            self.base = _now_mb()

        def on_step_end(self, run, out):  # after the update; before the end-of-run save
            self.peak, self.micro = _peak_mb(), out.micro_batch_tokens

    meter = Meter()
    meter.base, meter.peak, meter.micro = 0.0, float("inf"), 0  # if no step ran (out of memory at 1 row)
    with tempfile.TemporaryDirectory() as out:
        cfg = _config(args, args.rows, out, ckpt, auto)
        train_or_raise(cfg, [meter])
    # The orchestrator halves the micro-batch on an out-of-memory error: then B did not fit.
    return {"base_mb": meter.base, "peak_mb": meter.peak, "micro_rows": meter.micro // cfg.data.seq_len}


def run_transformers(args: argparse.Namespace, ckpt: bool) -> dict:
    import torch

    cfg = _config(args, args.rows, "unused")
    cfg, batches = _batches(cfg, STEPS)
    m, device = cfg.model, "cuda" if _cuda() else "cpu"
    torch.manual_seed(cfg.train.seed)
    model = llama_like(m).to(device)
    if ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)  # its defaults
    base = _now_mb()
    for batch in batches:
        (micro,) = batch.micro
        inputs, targets = micro.inputs.to(device), micro.targets.to(device)
        # transformers shifts labels itself: labels are the inputs, -100 where masked.
        labels = torch.cat([inputs[:, :1], targets[:, :-1]], dim=1)
        model(input_ids=inputs, labels=labels, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"base_mb": base, "peak_mb": _peak_mb(), "micro_rows": len(micro.inputs)}


def child(args: argparse.Namespace) -> None:
    if args.variant == "trimtab-auto":  # the cap as the allocator's limit, before any allocation
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_mb * 2**20 / total)
    ckpt = args.variant.endswith("+ckpt")
    if args.variant.startswith("trimtab"):
        result = run_trimtab(args, ckpt, auto=args.variant == "trimtab-auto")
    else:
        result = run_transformers(args, ckpt)
    emit(result)


def probe(args: argparse.Namespace, variant: str, rows: int) -> dict:
    """One fresh process training `variant` at `rows`; fits: peak <= cap and the micro-batch kept."""
    cmd = [sys.executable, __file__, "--child", variant, "--preset", args.preset, "--rows", str(rows)]
    cmd += ["--seq-len", str(args.seq_len), "--cap-mb", str(args.cap_mb)]
    t0 = time.perf_counter()
    r = run_child(cmd, f"{variant} at {rows} rows", ROOT, tolerate="out of memory")
    if r.pop("failed", False):
        r |= {"base_mb": 0.0, "peak_mb": float("inf"), "micro_rows": 0}
    r.update(rows=rows, seconds=time.perf_counter() - t0)
    r["fits"] = r["peak_mb"] <= args.cap_mb and (variant == "trimtab-auto" or r["micro_rows"] == rows)
    DONE.append(r)
    print(
        f"{variant:18s} {rows:5d} rows  peak {r['peak_mb']:8.0f} MB  base {r['base_mb']:6.0f} MB  "
        f"{'fits' if r['fits'] else 'over'}  {r['seconds']:5.1f} s  other processes {r['other_cpu']:.0%}",
        flush=True,
    )
    return r


def search(args: argparse.Namespace, variant: str) -> tuple[int, dict[int, dict]]:
    """The largest rows <= --max-rows that fit, and every probe: powers of two until one does not
    fit; then, as memory grows about linearly in rows, a guess interpolated between the last two
    peaks and its neighbour (two probes close the gap when it is linear); bisection for the rest."""
    seen: dict[int, dict] = {}
    lo, hi = 0, args.max_rows + 1  # the largest rows known to fit, the smallest known not to

    def at(rows: int) -> bool:
        nonlocal lo, hi
        seen[rows] = probe(args, variant, rows)
        lo, hi = (rows, hi) if seen[rows]["fits"] else (lo, rows)
        return seen[rows]["fits"]

    ladder = [1 << i for i in range(args.max_rows.bit_length()) if 1 << i < args.max_rows] + [args.max_rows]
    for rows in ladder:
        if not at(rows):
            break
    if hi - lo > 1 and lo and math.isfinite(seen[hi]["peak_mb"]) and seen[hi]["peak_mb"] > seen[lo]["peak_mb"]:
        a, b = seen[lo]["peak_mb"], seen[hi]["peak_mb"]
        guess = min(max(lo + int((args.cap_mb - a) / (b - a) * (hi - lo)), lo + 1), hi - 1)
        near = guess + 1 if at(guess) else guess - 1
        if lo < near < hi:
            at(near)
    while hi - lo > 1:
        at((lo + hi) // 2)
    return lo, seen


def parent(args: argparse.Namespace) -> None:
    if not args.dry_run:  # the first run trains the tokenizer into the cache: not a probe's cost
        probe(args, VARIANTS[0], 1)
    largest, seen = {}, {}
    for v in VARIANTS:
        largest[v], seen[v] = search(args, v)
    common = min(largest.values())
    at_common = {v: seen[v].get(common) or probe(args, v, common) for v in VARIANTS} if common else {}
    repeat = probe(args, VARIANTS[0], common) if common else None
    auto = None
    if _cuda():
        auto = probe(args, "trimtab-auto", args.max_rows)
    else:
        print("micro-batch auto-sizing: skipped (CUDA only; on CPU nothing runs out of memory before swap)")
    body = report(args, largest, at_common, repeat, auto)
    publish(heading(args), body, precision="fp32", other_cpu=[r["other_cpu"] for r in DONE], dry_run=args.dry_run)


def heading(args: argparse.Namespace) -> str:
    seq = f" --seq-len {args.seq_len}" if args.seq_len else ""
    return f"## Activation memory: largest batch under a cap (bench/memory.py --preset {args.preset}{seq})"


def report(args, largest: dict, at_common: dict, repeat: dict | None, auto: dict | None) -> str:
    import transformers

    seq, common = _seq_len(args), min(largest.values())
    head = f"| variant | largest rows | largest tokens | peak MB at {common} rows "
    head += "| MB a row above baseline | baseline MB (model, optimizer, data loaded) |"
    unit = "peak reserved CUDA memory" if _cuda() else "peak RSS of the whole process"
    lines = [
        f"transformers {transformers.__version__}; cap {args.cap_mb:,} MB of {unit}; eager, seq_len {seq}, {STEPS} "
        f"optimizer steps of one micro-batch; rows searched up to {args.max_rows} (powers of two, then an "
        f"interpolated guess and bisection): {len(DONE)} probes, each its own process, "
        f"{sum(r['seconds'] for r in DONE) / 60:.0f} min in all.",
        "",
        head,
        "|---|---|---|---|---|---|",
    ]
    for v in VARIANTS:
        most = f"{'>= ' if largest[v] == args.max_rows else ''}{largest[v]}"
        r = at_common.get(v, {"peak_mb": float("nan"), "base_mb": float("nan")})
        per_row = (r["peak_mb"] - r["base_mb"]) / max(common, 1)
        cells = f"{r['peak_mb']:,.0f} | {per_row:,.1f} | {r['base_mb']:,.0f}"
        lines.append(f"| {v} | {most} | {largest[v] * seq:,} | {cells} |")
    lines.append("")
    for a, b in (("trimtab", "transformers"), ("trimtab+ckpt", "transformers+ckpt"), ("trimtab+ckpt", "trimtab")):
        ratio = f"{largest[a] / largest[b]:.2f}x" if largest[b] else "n/a (nothing fits)"
        bound = " (a lower bound: the search stopped at --max-rows)" if largest[a] == args.max_rows else ""
        lines.append(f"- largest batch, {a} / {b}: **{ratio}**{bound}")
    if repeat:
        diff = repeat["peak_mb"] - at_common[VARIANTS[0]]["peak_mb"]
        lines.append(f"- repeatability: {VARIANTS[0]} at {common} rows measured twice, {diff:+.1f} MB apart")
    if auto:
        lines.append(
            f"- micro-batch auto-sizing (train.micro_batch_tokens=0, {args.max_rows} rows a step, the cap imposed "
            f"with set_per_process_memory_fraction): settled on {auto['micro_rows']} rows a micro-batch, "
            f"peak {auto['peak_mb']:,.0f} MB"
        )
    else:
        lines.append("- micro-batch auto-sizing: not measured (CUDA only: on CPU nothing runs out of memory)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--cap-mb", type=int, default=3000, help="the memory cap, MB (RSS on CPU, reserved on CUDA)")
    parser.add_argument("--max-rows", type=int, default=256, help="the search stops here")
    parser.add_argument("--seq-len", type=int, default=0, help="context length (0: the preset's)")
    parser.add_argument("--dry-run", action="store_true", help="debug preset, 1 row per variant; print only")
    parser.add_argument("--child", dest="variant", help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=1, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.dry_run:
        ns.preset, ns.max_rows = "debug", 1
    child(ns) if ns.variant else parent(ns)
