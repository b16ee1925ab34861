"""Training throughput: trimtab vs a minimal PyTorch loop vs transformers' LlamaForCausalLM.

    python bench/throughput.py [--preset small] [--steps 12] [--warmup 2] [--reps 5] [--seq-len N]
                               [--compile] [--precision auto|fp32|bf16]

Each variant trains the same model shape on the same batches (trimtab's loader over the built-in
corpus) for the same steps. Each repetition is one process running the three a step of each in
turn (the Trainer's step, then one of each loop, their order rotating): run one process per
variant, a variant swung 20-50% between processes on a shared host with nothing else running
here, while step by step every variant sees the same moments and the paired ratio cancels them.
Peak RSS comes from a short separate process per variant. Contention is measured (CPU time of
other processes during each run), because a busy second core slows two-thread torch 3-10x.
Results go to BENCHMARKS.md.

    trimtab          trimtab.training.Trainer.fit at the preset's defaults (train.compile: auto,
                     which keeps a run this short eager; train.precision: auto, bf16 autocast on
                     a CPU with native bf16 matmuls, fp32 elsewhere)
    minimal          a bare loop over trimtab's model: identical settings to `trimtab`, its
                     precision included
    transformers     LlamaForCausalLM (fp32 eager, default attention) + default AdamW, plain loop

`--precision P` sets all three to P (trimtab's train.precision, the loops' autocast), for a
comparison at identical settings throughout; each row says the precision it ran.

`--compile` runs the three torch.compile'd (trimtab+compile: train.compile=true; the loops:
torch.compile of the model) beside trimtab eager, and reports compiling's speed-up and its cold
start (the compiled warm-up steps' time less the eager ones', paired by repetition, every process
compiling from empty caches): the figures train.compile=auto decides with
(src/trimtab/training/services/compiling.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _benchfile import precisions, publish  # bench/_benchfile.py, next to this file
from _measure import emit, median_ci, paired_ratio, run_child, step_rate  # bench/_measure.py, next to this file
from _peers import llama_like  # bench/_peers.py, next to this file

ROOT = Path(__file__).resolve().parent.parent
RSS_STEPS = 3  # eager: a variant's peak RSS is taken in its own process over this many steps


def _config(args: argparse.Namespace, out: str, compile_: bool | None = None):
    """The preset at `--seq-len` (its context stretched: the same tokens a step, fewer rows)."""
    from trimtab.config import load_config

    sets = ["log.progress=false", "train.eval_every=0", "checkpoint.every=0", f"train.precision={args.precision}"]
    if compile_ is not None:
        sets.append(f"train.compile={str(compile_).lower()}")
    if args.seq_len:
        sets += [f"data.seq_len={args.seq_len}", f"model.max_seq_len={args.seq_len}"]
    steps = {"max_steps": args.warmup + args.steps}
    return load_config(preset=args.preset, overrides={"out": out, "train": steps}, sets=sets)


def _batches(cfg, n: int):
    """(cfg with the tokenizer's vocabulary, the first n step batches of its data): a resolved
    config is never changed, the completed one is a new config."""
    from trimtab.config import derive
    from trimtab.data import BatchLoader, build_splits, get_tokenizer, read_documents
    from trimtab.paths import cache_dir

    docs, _ = read_documents(cfg.data)
    tok = get_tokenizer(cfg.data, docs, cache_dir())
    rows, _ = build_splits(cfg.data, tok, docs, None, seed=cfg.train.seed)
    cfg = derive(cfg, {"model": {"vocab_size": cfg.model.vocab_size or tok.vocab_size}})
    loader = BatchLoader(rows, cfg.train.batch_tokens, cfg.train.micro_batch_tokens, cfg.train.seed, tok.pad_id)
    return cfg, [loader.next_batch() for _ in range(n)]


def timed_fit(cfg, warmup: int) -> dict:
    """trimtab's Trainer.fit on `cfg` alone, timed step by step (_measure.step_rate)."""
    return interleaved_fit(cfg, warmup, {})["trimtab"]


def time_steps(step, n: int, warmup: int, prof=None) -> dict:
    """Run step(i) for i < n, timing each (_measure.step_rate); `prof` records after `warmup` steps."""
    marks = [(time.perf_counter(), 0)]
    for i in range(n):
        if i == warmup and prof is not None:
            prof.start()
        tokens = step(i)  # before the clock is read: the mark is this step's end
        marks.append((time.perf_counter(), marks[-1][1] + tokens))
    if prof is not None:
        prof.stop()
    return {**step_rate(marks, warmup), "precision": step.precision}


def interleaved_fit(cfg, warmup: int, others: dict) -> dict[str, dict]:
    """trimtab's Trainer.fit on `cfg` and, after each of its steps, one step of every variant in
    `others` (name -> step(i) -> tokens, their order rotating each step), so all of them run
    through the same moments of the machine: a slow minute slows every variant alike and the
    paired ratio cancels it. Each variant's time counts only its own steps."""
    from trimtab.training.hooks import Hook
    from trimtab.training.setup import setup
    from trimtab.training.trainer import Trainer

    names = list(others)
    spans: dict[str, list[tuple[float, int]]] = {"trimtab": [], **{n: [] for n in names}}

    class Interleave(Hook):
        def __init__(self):
            self.start = time.perf_counter()

        def on_step_end(self, run, out):
            spans["trimtab"].append((time.perf_counter() - self.start, out.batch.n_tokens))
            i = len(spans["trimtab"]) - 1
            first = i % len(names) if names else 0
            for name in names[first:] + names[:first]:
                t0 = time.perf_counter()
                tokens = others[name](i)
                spans[name].append((time.perf_counter() - t0, tokens))
            self.start = time.perf_counter()

    trainer = Trainer(setup(cfg), hooks=[hook := Interleave()])
    hook.start = time.perf_counter()
    trainer.fit()
    result = {name: step_rate(_marks(spans[name]), warmup) for name in spans}
    result["trimtab"].update(compile=trainer.compile.enabled, precision=trainer.precision.name)
    return result


def _marks(spans: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """(seconds, tokens) per step as step_rate's running (time, tokens) marks."""
    marks = [(0.0, 0)]
    for seconds, tokens in spans:
        marks.append((marks[-1][0] + seconds, marks[-1][1] + tokens))
    return marks


def run_trimtab(args: argparse.Namespace, compile_: bool | None) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cfg = _config(args, out, compile_)
        return timed_fit(cfg, args.warmup)


def _precision(name: str):
    """trimtab's resolution of a train.precision on this CPU (auto: bf16 where its matmuls are native)."""
    import torch

    from trimtab.hardware import choose_precision

    return choose_precision(torch.device("cpu"), name)


def minimal_stepper(cfg, batches, compile_: bool):
    """step(i) -> tokens: a bare loop over trimtab's model at trimtab's settings (its precision as
    the Trainer resolves it, AdamW groups, clipping), cross-entropy on the full logits."""
    import torch
    import torch.nn.functional as F

    from trimtab.model import build_model
    from trimtab.training.services.cpu_precision import refine_cpu_precision

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    precision = refine_cpu_precision(_precision(cfg.train.precision), cfg, model)  # as the Trainer resolves it
    forward = torch.compile(model) if compile_ else model
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "emb" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "emb" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        fused=True,
    )

    def step(i: int) -> int:
        batch = batches[i]
        for micro in batch.micro:
            with precision.autocast():
                logits = forward(micro.inputs)
                loss = (
                    F.cross_entropy(
                        logits.float().flatten(0, 1), micro.targets.flatten(), ignore_index=-100, reduction="sum"
                    )
                    / batch.n_targets
                )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        return batch.n_tokens

    step.precision = precision.name
    return step


def transformers_stepper(cfg, batches, compile_: bool, precision_name: str):
    """step(i) -> tokens: LlamaForCausalLM of the same shape at its defaults (fp32 unless
    `precision_name` names one, default AdamW), a plain loop."""
    import torch

    precision = _precision("fp32" if precision_name == "auto" else precision_name)
    torch.manual_seed(cfg.train.seed)
    model = llama_like(cfg.model)
    model.train()
    forward = torch.compile(model) if compile_ else model
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)  # its defaults

    def step(i: int) -> int:
        batch = batches[i]
        for micro in batch.micro:
            # transformers shifts labels itself: labels are the inputs, -100 where masked.
            labels = torch.cat([micro.inputs[:, :1], micro.targets[:, :-1]], dim=1)
            with precision.autocast():
                loss = forward(input_ids=micro.inputs, labels=labels).loss / len(batch.micro)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return batch.n_tokens

    step.precision = precision.name
    return step


def run_loop(args: argparse.Namespace, name: str, compile_: bool) -> dict:
    """One loop variant alone in this process (its peak RSS, or a compiled run)."""
    cfg = _config(args, "unused")
    cfg, batches = _batches(cfg, args.warmup + args.steps)
    step = (
        minimal_stepper(cfg, batches, compile_)
        if name == "minimal"
        else transformers_stepper(cfg, batches, compile_, args.precision)
    )
    return {**time_steps(step, len(batches), args.warmup), "compile": compile_}


def run_interleaved(args: argparse.Namespace) -> dict[str, dict]:
    """The three variants eager in this one process, a step of each in turn (interleaved_fit)."""
    cfg = _config(args, "unused")
    cfg, batches = _batches(cfg, args.warmup + args.steps)
    loops = {
        "minimal": minimal_stepper(cfg, batches, False),
        "transformers": transformers_stepper(cfg, batches, False, args.precision),
    }
    with tempfile.TemporaryDirectory() as out:
        result = interleaved_fit(_config(args, out, False), args.warmup, loops)
    for name, step in loops.items():
        result[name]["precision"] = step.precision
    return result


def child(args: argparse.Namespace) -> None:
    from trimtab.training.runtime import peak_rss_mb

    name, compile_ = args.variant.removesuffix("+compile"), args.variant.endswith("+compile")
    if name == "interleaved":
        result = run_interleaved(args)
    elif name == "trimtab":
        result = run_trimtab(args, True if compile_ else None)
    else:
        result = run_loop(args, name, compile_)
    result["peak_rss_mb"] = peak_rss_mb()
    emit(result)


def parent(args: argparse.Namespace) -> None:
    """Eager: each repetition one process running the three variants a step of each in turn, then
    one short process per variant for its peak RSS. --compile: each variant in its own process per
    repetition (each compiles from empty caches; two Trainers cannot share a process)."""
    variants = ["trimtab", "minimal", "transformers"]
    if args.compile:
        variants = ["trimtab+compile", "trimtab", "minimal+compile", "transformers+compile"]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(args.reps):
        if args.compile:
            results = {v: _run_child(args, v) for v in variants}
        else:
            both = _run_child(args, "interleaved")
            results = {v: {**both[v], "other_cpu": both["other_cpu"]} for v in variants}
        for variant, result in results.items():
            runs[variant].append(result)
            print(
                f"rep {rep} {variant:14s} {result['tokens_per_s']:8.0f} tok/s  "
                f"other processes {result['other_cpu']:.0%} of the CPUs",
                flush=True,
            )
    if not args.compile:
        short = argparse.Namespace(**{**vars(args), "steps": RSS_STEPS, "warmup": 1})
        for variant in variants:
            rss = _run_child(short, variant)["peak_rss_mb"]
            for r in runs[variant]:
                r["peak_rss_mb"] = rss
    write_report(args, runs)


def _run_child(args: argparse.Namespace, variant: str) -> dict:
    """`variant` (or "interleaved") in a fresh process: its RESULT and the other processes' CPU share."""
    cmd = [sys.executable, __file__, "--child", variant, "--preset", args.preset, "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), "--seq-len", str(args.seq_len), "--precision", args.precision]
    # Each process compiles from empty caches: inductor's on-disk cache would otherwise hand every
    # repetition after the first its kernels, and the cold start seem seconds.
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache}
        return run_child(cmd, variant, ROOT, env)


def write_report(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    med = {v: statistics.median(r["tokens_per_s"] for r in rs) for v, rs in runs.items()}
    rss = {v: max(r["peak_rss_mb"] for r in rs) for v, rs in runs.items()}
    lines = [
        f"{args.steps} timed steps "
        f"after {args.warmup} warm-up steps (tokens/s: a step's mean tokens over the median step time), "
        f"{args.reps} repetitions, "
        + (
            "each variant in its own process"
            if args.compile
            else "each one process running the three a step of each in turn (the Trainer's, then the loops' "
            f"in rotating order; peak RSS from a separate {RSS_STEPS}-step process per variant)"
        )
        + "; ratios pair repetition i of each variant, median with a bootstrap 95% interval.",
        "",
        "| variant | precision | tokens/s (median) | all reps | warm-up s | peak RSS MB | other processes' CPU share |",
        "|---|---|---|---|---|---|---|",
    ]
    for v, rs in runs.items():
        each = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in rs)
        loads = ", ".join(f"{r['other_cpu']:.0%}" for r in rs)
        warm = statistics.median(r["warmup_s"] for r in rs)
        lines.append(f"| {v} | {rs[0]['precision']} | {med[v]:,.0f} | {each} | {warm:.1f} | {rss[v]:,.0f} | {loads} |")
    tps = {v: [r["tokens_per_s"] for r in rs] for v, rs in runs.items()}
    lines.append("")
    for name, a, b, target in claims(args.compile, args.precision):
        ratio = paired_ratio(tps[a], tps[b])
        parity = f"; as parity: {ratio.within(0.05)}" if b.startswith("minimal") else ""
        lines.append(f"- {name}: **{ratio}**; target >= {target:g}x: {ratio.verdict(target)}{parity}")
    if args.compile:
        cold = [c["warmup_s"] - e["warmup_s"] for c, e in zip(runs["trimtab+compile"], runs["trimtab"])]
        low, high = median_ci(cold)
        lines.append(
            f"- train.compile cold start (trimtab+compile's {args.warmup} warm-up steps less trimtab's): "
            f"**{statistics.median(cold):.1f} s** (95% interval {low:.1f}-{high:.1f}, {len(cold)} pairs)"
        )
    precision = precisions({v: rs[0]["precision"] for v, rs in runs.items()})
    other = (
        [r["other_cpu"] for rs in runs.values() for r in rs]
        if args.compile
        else [r["other_cpu"] for r in runs["trimtab"]]
    )
    publish(heading(args), "\n".join(lines), precision=precision, other_cpu=other, dry_run=args.dry_run)


def claims(compiled: bool, precision: str) -> list[tuple[str, str, str, float]]:
    """(what, numerator variant, denominator variant, target ratio) for the run's variants."""
    each = "each at its default precision" if precision == "auto" else f"both {precision}"
    if compiled:
        return [
            ("train.compile=true / eager, trimtab", "trimtab+compile", "trimtab", 1.0),
            (f"trimtab / transformers, both compiled, {each}", "trimtab+compile", "transformers+compile", 1.3),
            ("trimtab / minimal loop, both compiled", "trimtab+compile", "minimal+compile", 0.98),
        ]
    return [
        (f"trimtab / transformers, {each}", "trimtab", "transformers", 1.3),
        ("trimtab / minimal loop, identical settings", "trimtab", "minimal", 0.98),
    ]


def heading(args: argparse.Namespace) -> str:
    """One section per shape, so a long-context run keeps the default one."""
    flags = (f" --seq-len {args.seq_len}" if args.seq_len else "") + (" --compile" if args.compile else "")
    flags += f" --precision {args.precision}" if args.precision != "auto" else ""
    return f"## Training throughput (`bench/throughput.py --preset {args.preset}{flags}`)"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=0, help="context length (0: the preset's; same tokens a step)")
    parser.add_argument("--compile", action="store_true", help="torch.compile every variant (and trimtab eager)")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"], help="all three at P")
    parser.add_argument("--dry-run", action="store_true", help="debug preset, 1 warm-up + 1 step, 1 rep; print only")
    parser.add_argument("--child", dest="variant", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.dry_run:
        ns.preset, ns.steps, ns.warmup, ns.reps = "debug", 1, 1, 1
    child(ns) if ns.variant else parent(ns)
