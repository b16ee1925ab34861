"""Activation checkpointing off, selective and full: the memory a forward keeps and the step's time.

    python bench/recompute.py [--presets dense-25m moe-40m] [--set k=v ...] [--steps 8] [--reps 5]
                              [--device cpu|cuda] [--dtype bf16|fp32] [--dry-run]

Per preset, one process per repetition builds the model once and runs training steps (forward,
trimtab's fused loss, backward, AdamW) on one micro-batch of the preset's train.micro_batch_tokens,
the three modes of train.activation_checkpointing taking turns step by step (their order rotating),
so all three see the same moments of the machine; a first round warms up. Reported per mode: the
median step time, its ratio to off (paired by repetition: each repetition's median over off's;
median and bootstrap 95% interval), and the bytes per token the forward leaves for the backward,
measured (model/recompute.py: the allocator on CUDA, torch's profiler on a CPU; the slope between
4 and 8 rows) beside plan/memory.py's estimate; on CUDA also the step's peak allocated memory.
Results go to BENCHMARKS.md, a section per device (`--dry-run`: debug, 2 steps, 1 rep, printed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _benchfile import publish  # bench/_benchfile.py, next to this file
from _measure import Contention, emit, paired_ratio, run_child

ROOT = Path(__file__).resolve().parent.parent
MODES = ("off", "selective", "full")


def _config(args: argparse.Namespace, preset: str, out: str):
    from throughput import _batches  # resolves the vocabulary from the built-in data
    from trimtab.config import load_config

    cfg = load_config(preset=preset, overrides={"out": out}, sets=args.set)
    return _batches(cfg, 0)[0]


def child(args: argparse.Namespace) -> None:
    """One preset, one repetition: a RESULT line."""
    emit(_measure(args))


def _measure(args: argparse.Namespace) -> dict:
    """One preset, one repetition: the steps, then each mode's kept bytes."""
    import torch

    from trimtab.model import build_model
    from trimtab.model.recompute import measure_kept_bytes
    from trimtab.plan.memory import activation_bytes_per_token
    from trimtab.plan.memory import kept_bytes_per_token as estimate
    from trimtab.training.loss import model_loss

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    with tempfile.TemporaryDirectory() as out:
        cfg = _config(args, args.preset, out)
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    rows = max(1, cfg.train.micro_budget // cfg.data.seq_len)
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.data.seq_len + 1), device=device)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    peaks: dict[str, int] = {}
    for i in range(1 + args.steps):  # the first round warms up
        for mode in MODES[i % 3 :] + MODES[: i % 3]:
            model.set_activation_checkpointing(mode)
            seconds, peak = _step(model, opt, tokens, dtype)
            if i:
                times[mode].append(seconds)
                peaks[mode] = max(peaks.get(mode, 0), peak)
    kept, p = {}, 2 if dtype else 4
    for mode in MODES:
        model.set_activation_checkpointing(mode)
        kept[mode] = measure_kept_bytes(model, lambda t: model_loss(model, t, dtype), lambda n: tokens[:n])
    fused = device.type == "cuda"
    return {
        "times": {m: statistics.median(t) for m, t in times.items()},
        "peaks": peaks,
        "kept": kept,
        "estimate": {m: estimate(cfg, p, m, fused_norm=fused)[0] for m in MODES},
        "peak_estimate": {m: activation_bytes_per_token(cfg, p, m, fused_norm=fused) for m in MODES},
        "tokens": rows * cfg.data.seq_len,
        "params": sum(x.numel() for x in model.parameters()),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
    }


def _step(model, opt, tokens, dtype) -> tuple[float, int]:
    """One training step's seconds and, on CUDA, its peak allocated bytes."""
    import torch

    from trimtab.training.loss import model_loss

    cuda = tokens.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model_loss(model, tokens, dtype).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() if cuda else 0


def _run_child(args: argparse.Namespace, preset: str) -> dict:
    if args.dry_run:  # checks that it runs, not what it measures: no fresh interpreter (~2.5 s of CPU on imports)
        with Contention() as busy:
            result = _measure(argparse.Namespace(**{**vars(args), "preset": preset}))
        return {**result, "other_cpu": busy.other}
    cmd = [sys.executable, __file__, "--child", preset, "--steps", str(args.steps), "--device", args.device]
    cmd += ["--dtype", args.dtype] + [f"--set={s}" for s in args.set]
    return run_child(cmd, preset, ROOT)


def parent(args: argparse.Namespace) -> None:
    runs: dict[str, list[dict]] = {p: [] for p in args.presets}
    for rep in range(args.reps):
        for preset in args.presets:
            runs[preset].append(r := _run_child(args, preset))
            ms = "  ".join(f"{m} {r['times'][m] * 1e3:8.1f} ms" for m in MODES)
            print(f"rep {rep} {preset:10s} {ms}", flush=True)
    first = next(iter(runs.values()))[0]
    cuda = args.device == "cuda"
    lines = [
        f"{'`--set ' + ' '.join(args.set) + '`; ' if args.set else ''}One micro-batch a step (forward, fused "
        f"loss, backward, AdamW) in {args.dtype}, {args.steps} timed steps of each mode taking turns in one process "
        f"after a warm-up round; {args.reps} repetitions (a process each). Ratio: the mode's median step time over "
        "off's, paired by repetition (median, bootstrap 95% interval). Kept: bytes per token a forward leaves for "
        "its backward, measured (slope between 4 and 8 rows) and estimated (plan/memory.py); the planner's "
        "activation peak adds one block's re-run to it.",
        "",
        "| preset | mode | tokens a step | step ms (median) | time / off | kept B/token measured | estimated | "
        + ("peak GiB | " if cuda else "")
        + "other processes' CPU share |",
        "|---|---|---|---|---|---|---|" + ("---|" if cuda else "") + "---|",
    ]
    for preset, rs in runs.items():
        for mode in MODES:
            ratio = paired_ratio([r["times"][mode] for r in rs], [r["times"]["off"] for r in rs])
            ms = statistics.median(r["times"][mode] for r in rs) * 1e3
            kept = statistics.median(r["kept"][mode] for r in rs)
            peak = f" {max(r['peaks'][mode] for r in rs) / 2**30:.1f} |" if cuda else ""
            loads = ", ".join(f"{r['other_cpu']:.0%}" for r in rs)
            lines.append(
                f"| {preset} | {mode} | {rs[0]['tokens']:,} | {ms:,.1f} | {ratio if mode != 'off' else '1'} | "
                f"{kept:,.0f} | {rs[0]['estimate'][mode]:,.0f} |{peak} {loads} |"
            )
    heading = "## Activation checkpointing: off, selective, full (bench/recompute.py)" + (
        f" on {first['device_name']}" if cuda else ""
    )
    other = [r["other_cpu"] for rs in runs.values() for r in rs]
    publish(heading, "\n".join(lines), precision=args.dtype, other_cpu=other, dry_run=args.dry_run)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["dense-25m", "moe-40m"])
    parser.add_argument("--set", action="append", default=[], help="a config override for every preset")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--dry-run", action="store_true", help="debug only, 2 steps, 1 rep; print only")
    parser.add_argument("--child", dest="preset", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.dry_run:
        ns.presets, ns.steps, ns.reps = ["debug"], 2, 1
    child(ns) if ns.preset else parent(ns)
