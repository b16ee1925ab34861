"""MoE training step: trimtab vs the transformers class trimtab exports the model to.

    python bench/moe_step.py [--preset debug-moe|moe-40m] [--experts N] [--steps 30] [--warmup 2]
                             [--reps 7] [--threads N] [--precision auto|fp32|bf16] [--profile]
                             [--dry-run]

A whole optimizer step (forward, backward, AdamW update) on the same batches (trimtab's loader
over the built-in corpus). `--precision auto` (the default) compares each at its defaults: the
Trainer at train.precision auto (training/services/cpu_precision.py: bf16 autocast only where this model's
step is faster in it), the loops at transformers' default, fp32. `--precision P` runs all four
at P (identical settings); each row says the precision it ran.

Each repetition is one process that runs the four variants a step of each in turn (the Trainer's
step, then one of each loop, their order rotating). Run one process per variant instead, the
same variant swung 20-50% between processes with no other process busy (a shared host's other
tenants, not visible from here), which no affordable number of repetitions resolves to 5%; step
by step, every variant sees the same moments of the machine and the paired ratio cancels them.
Peak RSS comes from a short separate process per variant. Other processes' CPU share is
measured too, because a busy second core slows two-thread torch 3-10x (`--threads 1` there).

    trimtab        trimtab.training.Trainer.fit at the preset's defaults (capacity factor, z-loss,
                   warm-up schedule, precision; eager; no eval, checkpoints or progress): the product
    trimtab-loop   a bare loop over trimtab's model of the function the exported class computes
                   (dropless, balance loss only): identical settings to the two loops below
    hf-grouped_mm  the exported transformers class (export_class/to_hf_config), its experts on
                   experts_implementation="grouped_mm" (transformers' default), balance loss on
    hf-eager       the same with experts_implementation="eager" (a loop over the experts)

The loops share AdamW (same lr, betas, eps, weight decay, fused), clipping and token-normalised
loss. `--profile` adds trimtab-loop's top ops by self CPU time. Results go to the "MoE training
step" section of BENCHMARKS.md (`--dry-run`: one tiny repetition, printed, nothing written).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _benchfile import precisions, publish  # bench/_benchfile.py, next to this file
from _measure import emit, paired_ratio, run_child
from throughput import _batches, _precision, interleaved_fit, time_steps, timed_fit  # the throughput bench's helpers

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("trimtab", "trimtab-loop", "hf-grouped_mm", "hf-eager")
RSS_STEPS = 3  # a variant's peak RSS is taken in its own process over this many steps


def _config(args: argparse.Namespace, out: str = "unused"):
    from trimtab.config import load_config

    sets = ["log.progress=false", "train.eval_every=0", "checkpoint.every=0", "train.compile=false"]
    sets.append(f"train.precision={args.precision}")
    if args.experts:
        sets.append(f"model.moe.n_experts={args.experts}")
    steps = {"max_steps": args.warmup + args.steps}
    return load_config(preset=args.preset, overrides={"out": out, "train": steps}, sets=sets)


def _exported(cfg) -> dict:
    """config.json of the class trimtab's export picks for this model (vocab resolved first)."""
    from trimtab.hf.architectures import export_class, to_hf_config

    arch = export_class(cfg.model, {}, biased=False)
    if arch is None:
        sys.exit("this model exports as remote code (hf/remote): no transformers class to compare with")
    return to_hf_config(cfg.model, arch, {}, "float32")


def run_trimtab(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        return timed_fit(_config(args, out), args.warmup)


def _trimtab_loop(cfg, hf: dict):
    """trimtab's model of the function `hf` describes (round trip: dropless, no z-loss), and its
    step loss: trimtab's chunked cross-entropy plus the balance loss, weighted like the tokens."""
    import torch

    from trimtab.hf.architectures import to_model_config
    from trimtab.model import build_model
    from trimtab.training.loss import cross_entropy_sum

    torch.manual_seed(cfg.train.seed)
    model = build_model(to_model_config(hf, "bench"))

    def loss(micro, batch):
        ce = cross_entropy_sum(model.hidden(micro.inputs), model.lm_head.weight, micro.targets) / batch.n_targets
        aux = model.aux_loss()
        return ce if aux is None else ce + micro.n_targets / batch.n_targets * aux

    return model, loss


def _hf(cfg, hf: dict, impl: str):
    """The exported class with `impl` experts and its router logits on (so the balance loss is
    paid for, as the exported router_aux_loss_coef asks), and its step loss."""
    import torch
    import transformers

    fields = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    conf = transformers.AutoConfig.for_model(hf["model_type"], **fields, output_router_logits=True)
    torch.manual_seed(cfg.train.seed)
    model = transformers.AutoModelForCausalLM.from_config(conf, experts_implementation=impl, dtype=torch.float32)
    assert model.config._experts_implementation == impl, model.config._experts_implementation

    def loss(micro, batch):
        # transformers shifts labels itself: labels are the inputs, -100 where masked.
        labels = torch.cat([micro.inputs[:, :1], micro.targets[:, :-1]], dim=1)
        n = torch.tensor(batch.n_targets)  # token-normalised over the step, like trimtab
        return model(input_ids=micro.inputs, labels=labels, use_cache=False, num_items_in_batch=n).loss

    return model, loss


def _grouped_mm_path(model) -> str:
    """Whether transformers' grouped_mm runs torch's kernel or its own fallback for these weights
    (private helper: 'unknown' if it moved)."""
    import torch

    try:
        from transformers.integrations.moe import _can_use_grouped_mm

        w = next(p for n, p in model.named_parameters() if "experts" in n and p.ndim == 3)
        return "native" if _can_use_grouped_mm(torch.zeros(1, w.shape[-1]), w, None) else "fallback"
    except Exception:
        return "unknown"


def _stepper(model, loss, batches, cfg):
    """step(i): one optimizer step of `model` on batches[i] -> its tokens. The loops' AdamW,
    clipping and autocast (the config's precision where it names one, else transformers' fp32)."""
    import torch

    precision = _precision("fp32" if cfg.train.precision == "auto" else cfg.train.precision)
    o = cfg.optim
    opt = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=True
    )
    model.train()

    def step(i: int) -> int:
        batch = batches[i]
        for micro in batch.micro:
            with precision.autocast():
                step_loss = loss(micro, batch)
            step_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return batch.n_tokens

    step.precision = precision.name
    return step


def _loop(model, loss, batches, cfg, warmup: int, prof=None) -> dict:
    """Train on `batches`, marking each step's end (_measure.step_rate); `prof` runs after `warmup` steps."""
    return time_steps(_stepper(model, loss, batches, cfg), len(batches), warmup, prof)


def _build(variant: str, cfg, hf: dict):
    return _hf(cfg, hf, variant.removeprefix("hf-")) if variant.startswith("hf-") else _trimtab_loop(cfg, hf)


def run_interleaved(args: argparse.Namespace) -> dict[str, dict]:
    """The four variants in this one process, a step of each in turn (throughput.interleaved_fit)."""
    cfg = _config(args)
    cfg, batches = _batches(cfg, args.warmup + args.steps)  # with the tokenizer's vocabulary
    hf = _exported(cfg)
    loops = {v: _build(v, cfg, hf) for v in VARIANTS[1:]}
    steppers = {v: _stepper(model, loss, batches, cfg) for v, (model, loss) in loops.items()}
    with tempfile.TemporaryDirectory() as out:
        result = interleaved_fit(_config(args, out), args.warmup, steppers)
    for v, step in steppers.items():
        result[v]["precision"] = step.precision
    result["hf-grouped_mm"]["grouped_mm"] = _grouped_mm_path(loops["hf-grouped_mm"][0])
    result["hf-grouped_mm"]["class"] = hf["architectures"][0]
    return result


# Inclusive CPU time of ops that do not nest in one another: where the step goes, by part (on
# CPU, torch's grouped_mm is a loop of aten::mm, one per expert, so aten::mm leads the self-time table).
PARTS = {
    "grouped matmuls, fwd + bwd": ("aten::_grouped_mm",),
    "attention, fwd + bwd": ("aten::_scaled_dot_product",),
    "sort by expert": ("aten::sort",),
    "optimizer step": ("Optimizer.step#",),
}


def _profile(model, loss, batches, cfg, warmup: int) -> dict:
    """Top ops of trimtab-loop's timed steps by self CPU time (per step, share of the total)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    result = _loop(model, loss, batches, cfg, warmup, prof)
    events = prof.key_averages()
    total, steps = sum(e.self_cpu_time_total for e in events), len(batches) - warmup
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    rows = [[e.key, e.self_cpu_time_total / 1000 / steps, e.self_cpu_time_total / total, e.count / steps] for e in top]
    parts = {
        part: sum(e.cpu_time_total for e in events if e.key.startswith(prefixes)) / total
        for part, prefixes in PARTS.items()
    }
    return {**result, "top_ops": rows, "parts": parts}


def child(args: argparse.Namespace) -> None:
    from trimtab.training.runtime import peak_rss_mb

    if args.threads:  # before any work: a busy machine slows multi-threaded torch several fold
        __import__("torch").set_num_threads(args.threads)
    if args.variant == "interleaved":
        result = run_interleaved(args)
    elif args.variant == "trimtab":
        result = run_trimtab(args)
    else:
        cfg = _config(args)
        cfg, batches = _batches(cfg, args.warmup + args.steps)  # with the tokenizer's vocabulary
        hf = _exported(cfg)
        model, loss = _build(args.variant, cfg, hf)
        measure = _profile if args.variant == "profile" else _loop
        result = measure(model, loss, batches, cfg, args.warmup)
        result["class"] = hf["architectures"][0]
        if args.variant == "hf-grouped_mm":
            result["grouped_mm"] = _grouped_mm_path(model)
    result["peak_rss_mb"] = peak_rss_mb()
    emit(result)


def _run_child(args: argparse.Namespace, variant: str) -> dict:
    """Run `variant` (one, "interleaved" or "profile") in a fresh process; its RESULT and the
    other processes' share of the CPUs meanwhile."""
    cmd = [sys.executable, __file__, "--child", variant, "--preset", args.preset, "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), "--experts", str(args.experts), "--threads", str(args.threads)]
    cmd += ["--precision", args.precision]
    return run_child(cmd, variant, ROOT)


def parent(args: argparse.Namespace) -> None:
    """Each repetition one process running the four variants step by step in turn; then one short
    process per variant for its own peak RSS."""
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        result = _run_child(args, "interleaved")
        for variant in VARIANTS:
            runs[variant].append(r := {**result[variant], "other_cpu": result["other_cpu"]})
            print(
                f"rep {rep} {variant:14s} {r['tokens_per_s']:8.0f} tok/s {r['ms_per_step']:8.1f} ms/step  "
                f"other processes {r['other_cpu']:.0%} of the CPUs",
                flush=True,
            )
    short = argparse.Namespace(**{**vars(args), "steps": RSS_STEPS, "warmup": 1})
    rss = {v: _run_child(short, v)["peak_rss_mb"] for v in VARIANTS}
    profiled = _run_child(args, "profile") if args.profile else None
    body = report(args, runs, rss, profiled)
    precision = precisions({v: rs[0]["precision"] for v, rs in runs.items()})
    other = [r["other_cpu"] for r in runs["trimtab"]]  # one process per repetition runs all four
    publish(heading(args), body, precision=precision, other_cpu=other, dry_run=args.dry_run)


def heading(args: argparse.Namespace) -> str:
    """One section per shape (preset, expert count, threads), so each run replaces only its own."""
    return f"## MoE training step (bench/moe_step.py --preset {args.preset}{_flags(args)})"


def _flags(args: argparse.Namespace) -> str:
    flags = "".join(f" --{k} {getattr(args, k)}" for k in ("experts", "threads") if getattr(args, k))
    return flags + (f" --precision {args.precision}" if args.precision != "auto" else "")


def report(args: argparse.Namespace, runs: dict[str, list[dict]], rss: dict[str, float], profiled: dict | None) -> str:
    hf = runs["hf-grouped_mm"][0]
    lines = [
        f"Exported class {hf['class']}; transformers {__import__('transformers').__version__}; "
        f"{args.steps} timed steps after {args.warmup} warm-up (tokens/s: a step's mean tokens over the median "
        f"step time), {args.reps} repetitions, each one process running the four variants a step of each in "
        "turn (the Trainer's, then the loops' in rotating order), so every ratio compares steps taken at "
        "the same moments of the machine; peak RSS from a separate "
        f"{RSS_STEPS}-step process per variant. transformers' grouped_mm ran {hf.get('grouped_mm')} (torch's "
        "kernel or transformers' fallback). Ratios pair repetition i, median with a bootstrap 95% interval.",
        "",
        "| variant | precision | tokens/s (median) | all reps | ms/step (median) | peak RSS MB "
        "| other processes' CPU share |",
        "|---|---|---|---|---|---|---|",
    ]
    for v, rs in runs.items():
        tps, ms = (statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "ms_per_step"))
        each = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in rs)
        loads = ", ".join(f"{r['other_cpu']:.0%}" for r in rs)
        lines.append(f"| {v} | {rs[0]['precision']} | {tps:,.0f} | {each} | {ms:,.1f} | {rss[v]:,.0f} | {loads} |")
    lines += ["", *_ratio_lines({v: [r["tokens_per_s"] for r in rs] for v, rs in runs.items()}, args.precision)]
    if profiled:
        lines += ["", *_profile_table(profiled)]
    return "\n".join(lines) + "\n"


def _ratio_lines(tps: dict[str, list[float]], precision: str) -> list[str]:
    same = "same loop" if precision == "auto" else f"same loop, both {precision}"
    product = "Trainer at the preset's defaults" if precision == "auto" else f"Trainer, {precision}"
    claims = [
        (f"trimtab-loop / hf-grouped_mm ({same})", "trimtab-loop", "hf-grouped_mm", 1.0),
        (f"trimtab-loop / hf-eager ({same})", "trimtab-loop", "hf-eager", 1.5),
        (f"trimtab ({product}) / hf-grouped_mm", "trimtab", "hf-grouped_mm", 1.0),
        (f"trimtab ({product}) / hf-eager", "trimtab", "hf-eager", 1.5),
    ]
    lines = []
    for name, a, b, target in claims:
        ratio = paired_ratio(tps[a], tps[b])
        line = f"- {name}: **{ratio}**; target >= {target:g}x: {ratio.verdict(target)}"
        lines.append(line + (f"; as parity: {ratio.within(0.05)}" if target == 1.0 else ""))
    for a in ("trimtab-loop", "trimtab"):
        least = min(x / y for x, y in zip(tps[a], tps["hf-grouped_mm"], strict=True))
        lines.append(
            f"- smallest {a} / hf-grouped_mm pair ratio: {least:.3f} "
            f"(> 1 in every repetition: {'yes' if least > 1 else 'no'})"
        )
    return lines


def _profile_table(p: dict) -> list[str]:
    rest = 1 - sum(p["parts"].values())
    parts = ", ".join(f"{part} {share:.0%}" for part, share in p["parts"].items())
    return [
        f"Where trimtab-loop's step goes (torch.profiler, CPU; {p['ms_per_step']:,.1f} ms/step while "
        f"profiled): by part (inclusive CPU time) {parts}, the rest (other matmuls: attention projections, "
        f"dense FFN, router, lm head; dispatch, combine, norms, loss, clipping) {rest:.0%}; top ops by self "
        "CPU time:",
        "",
        "| op | self CPU ms/step | share | calls/step |",
        "|---|---|---|---|",
        *(f"| `{op}` | {ms:,.2f} | {share:.1%} | {calls:g} |" for op, ms, share, calls in p["top_ops"]),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="debug-moe")
    parser.add_argument("--experts", type=int, default=0, help="override model.moe.n_experts (0: the preset's)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per variant (0: torch's default)")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"], help="see above")
    parser.add_argument("--profile", action="store_true", help="add trimtab-loop's top ops by self CPU time")
    parser.add_argument("--dry-run", action="store_true", help="1 warm-up + 1 step, 1 rep, debug-moe; print only")
    parser.add_argument("--child", dest="variant", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.dry_run:
        ns.preset, ns.steps, ns.warmup, ns.reps = "debug-moe", 1, 1, 1
    if ns.warmup < 1 or ns.steps < 1:
        parser.error("--warmup and --steps must be >= 1 (the clock starts at the end of the warm-up)")
    child(ns) if ns.variant else parent(ns)
