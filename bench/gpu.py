"""GPU training speed: bf16 MFU of a preset's whole training step, trimtab vs a plain loop over
the same model, eager and torch.compile'd.

    python bench/gpu.py [--preset dense-1b] [--steps 8] [--warmup 3] [--reps 3]
                        [--set model.n_layers=4 ...]   # e.g. moe-7b-shaped layers that fit one GPU
    python bench/gpu.py --moe-impl padded ...           # MoE layers' expert layout (default auto)
    python bench/gpu.py --load a.json b.json ...        # report saved repetitions (--save), run nothing
    python bench/gpu.py --profile prof.txt ...          # where trimtab's step goes: prof.txt, prof.json
    python bench/gpu.py --dry-run                       # on a CPU: debug preset, 1 step, no report

Variants, each in its own subprocess (so peak memory is its own), run interleaved `--reps` times:

    trimtab          trimtab.training.Trainer.fit (the product: bf16 autocast, chunked fused
                     cross-entropy, fused AdamW, the orchestrator on), train.compile=false
    trimtab-compile  the same with train.compile=true
    trimtab-fp8      train.precision=fp8: the linear layers' matmuls in float8 through torchao
                     (train.fp8_recipe: --set train.fp8_recipe=rowwise), the rest as trimtab
    trimtab-fp8-compile  the same with train.compile=true (float8's scaling fuses under compile)
    plain            a bare loop over the same model and batches: bf16 autocast, full-logits
                     F.cross_entropy, fused AdamW, clip; no orchestrator, no wrapping

In one process trimtab's parallel layer wraps nothing (distributed.tp=1, world 1: Parallel.wrap
returns the model itself or its compiled form), so trimtab / plain is the whole cost of the stack
around the step: the parallel layer, the hooks and the orchestrator.

MFU = tokens/s x Transformer.flops_per_token(seq_len) / the GPU's dense bf16 peak
(hardware.GPUS; 989 TFLOP/s for an H100 SXM). Time is wall time between step ends after a CUDA
synchronize (the trainer's loss read syncs every step). Results go to BENCHMARKS.md.

--profile PATH times nothing: one trimtab process runs its `--steps` steps after the warm-up
under torch.profiler (CPU and CUDA activity; the CPU's alone on a CPU, with --dry-run the
debug-moe preset) and writes PATH, key_averages' table of the top 40 ops by CUDA time (self CPU
time on a CPU), and PATH with suffix .json: the top ops by self device time (each one's ms per
step, calls per step and share of all kernel time), the top kernels, and the named ranges (the
MoE layers' "moe.route", "moe.sort", "moe.permute", "moe.experts", "moe.unpermute",
"moe.combine", "moe.stats", forward only: their backward kernels count under the ops' names;
the fused loss, "LinearCrossEntropy", its gradients included; "Optimizer.step#...") with their
total device time per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _benchfile import publish  # bench/_benchfile.py, next to this file
from _measure import Contention, emit, paired_ratio, run_child

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("trimtab", "trimtab-compile", "plain")  # and trimtab-fp8, trimtab-fp8-compile (sm89+)


def _config(args: argparse.Namespace, out: str, compile_: bool, fp8: bool = False):
    from trimtab.config import load_config

    steps = args.warmup + args.steps
    sets = [
        "log.progress=false",
        "train.eval_every=0",
        "checkpoint.every=0",
        f"train.max_steps={steps}",
        f"train.compile={str(compile_).lower()}",
        f"train.batch_tokens={args.batch_tokens}",
        f"train.micro_batch_tokens={args.micro_batch_tokens}",
        f"data.max_bytes={args.data_bytes}",
        *(["train.precision=fp8"] if fp8 else []),
        *args.set,
    ]
    if args.dry_run:
        sets += ["train.device=cpu"]
    return load_config(preset=args.preset, overrides={"out": out}, sets=sets)


def run_trimtab(args: argparse.Namespace, compile_: bool, fp8: bool = False) -> dict:
    import torch

    from trimtab.training.hooks import Hook
    from trimtab.training.setup import setup
    from trimtab.training.trainer import Trainer

    class Clock(Hook):
        def __init__(self, prof=None):
            self.marks: list[tuple[float, int]] = []
            self.prof = prof  # a torch.profiler.profile over the timed steps (--profile)

        def on_step_end(self, run, out):
            _sync()
            self.marks.append((time.perf_counter(), run.tokens))
            if self.prof is not None and len(self.marks) == args.warmup:
                self.prof.start()
            elif self.prof is not None and len(self.marks) == args.warmup + args.steps:
                self.prof.stop()  # before the end-of-run checkpoint

    prof = _profiler(torch) if args.profile else None
    with tempfile.TemporaryDirectory() as out:
        cfg = _config(args, out, compile_, fp8)
        clock = Clock(prof)
        trainer = Trainer(setup(cfg), hooks=[clock])
        _set_moe_impl(trainer.model, args.moe_impl)
        start = time.perf_counter()
        summary = trainer.fit()
        flops = trainer.flops_per_token
    timed = clock.marks[args.warmup - 1 :]
    (t0, n0), (t1, n1) = timed[0], timed[-1]
    result = _result(torch, (n1 - n0) / (t1 - t0), t0 - start, flops, [b[0] - a[0] for a, b in zip(timed, timed[1:])])
    if prof is not None:
        _write_profile(prof, Path(args.profile), args.steps, torch.cuda.is_available())
    return result | {"cold_start_s": summary["compile"]["cold_start_s"]}


def _profiler(torch):
    from torch.profiler import ProfilerActivity, profile

    # CPU activity on CUDA too: without it the table has kernels only, no aten ops or named ranges
    cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    return profile(activities=[ProfilerActivity.CPU, *cuda])


def _write_profile(prof, path: Path, steps: int, cuda: bool) -> None:
    """PATH: key_averages' table; PATH.json: the top ops, kernels and named ranges (docstring).
    The table first: it is the more robust of the two across torch versions."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    sort = "cuda_time_total" if cuda else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(events.table(sort_by=sort, row_limit=40, max_name_column_width=80) + "\n")

    def self_us(e) -> float:  # the device's time on CUDA, the CPU's on a CPU
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    def total_us(e) -> float:
        return e.device_time_total if cuda else e.cpu_time_total

    def annotation(e) -> bool:
        return bool(getattr(e, "is_user_annotation", False))

    on_device = [e for e in events if e.device_type != DeviceType.CPU and not annotation(e)]
    # as the table's "Self CUDA time total": the kernels', memcpys' and memsets' own time
    total = sum(e.self_device_time_total for e in on_device) if cuda else sum(e.self_cpu_time_total for e in events)
    per_step = max(steps, 1)

    def row(e, time_us: float) -> dict:
        ms, calls = time_us / 1000 / per_step, e.count / per_step
        return {"name": e.key, "ms_per_step": ms, "calls_per_step": calls, "share": time_us / total if total else 0.0}

    host = [e for e in events if e.device_type == DeviceType.CPU]
    ranges = [e for e in host if e.key.startswith(("moe.", "LinearCrossEntropy", "Optimizer."))]
    summary = {
        "time": "CUDA" if cuda else "CPU",
        "steps": steps,
        "total_ms_per_step": total / 1000 / per_step,
        "ops": [row(e, self_us(e)) for e in sorted(host, key=self_us, reverse=True)[:30]],
        "kernels": [row(e, e.self_device_time_total) for e in sorted(on_device, key=self_us, reverse=True)[:20]],
        "ranges": [row(e, total_us(e)) for e in sorted(ranges, key=total_us, reverse=True)],
    }
    path.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")


def run_plain(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    from throughput import _batches  # bench/throughput.py: the trainer's loader over the corpus
    from trimtab.model import build_model

    cfg = _config(args, "unused", False)
    cfg, batches = _batches(cfg, args.warmup + args.steps)
    device = torch.device("cpu" if args.dry_run else "cuda")
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model).to(device)
    model.set_activation_checkpointing(cfg.train.activation_checkpointing)  # as the trainer does
    _set_moe_impl(model, args.moe_impl)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, fused=True)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    start = time.perf_counter()
    ends = []
    for batch in batches:
        for micro in batch.micro:
            inputs, targets = micro.inputs.to(device), micro.targets.to(device)
            with torch.autocast(device.type, dtype=dtype, enabled=not args.dry_run):
                logits = model(inputs)
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
                loss = loss / batch.n_targets
                aux = model.aux_loss()  # MoE balance and z losses: the same objective as trimtab's
                objective = loss if aux is None else loss + micro.n_targets / batch.n_targets * aux
            objective.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # a host sync: the step has finished on the GPU
        ends.append(time.perf_counter())
    timed = ends[args.warmup - 1 :]
    n = sum(b.n_tokens for b in batches[args.warmup :])
    step_s = [b - a for a, b in zip(timed, timed[1:])]
    return _result(torch, n / (timed[-1] - timed[0]), timed[0] - start, model.flops_per_token(cfg.data.seq_len), step_s)


def _set_moe_impl(model, impl: str) -> None:
    """Every MoE layer's expert layout (model.moe: auto | grouped | padded)."""
    from trimtab.model.moe import MoE

    for module in model.modules():
        if isinstance(module, MoE):
            module.impl = impl


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _result(torch, tokens_per_s: float, warmup_s: float, flops_per_token: int, step_s: list[float]) -> dict:
    from trimtab.hardware import gpu_named

    found = gpu_named(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    peak = found[1].peak_flops if found else None
    return {
        "date": time.strftime("%Y-%m-%d"),
        "tokens_per_s": tokens_per_s,
        "step_s": step_s,
        "warmup_s": warmup_s,
        "mfu": tokens_per_s * flops_per_token / peak if peak else None,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }


def child(args: argparse.Namespace) -> None:
    emit(_variant(args))


def _variant(args: argparse.Namespace) -> dict:
    if args.variant == "plain":
        return run_plain(args)
    return run_trimtab(args, compile_=args.variant.endswith("-compile"), fp8="-fp8" in args.variant)


def parent(args: argparse.Namespace) -> None:
    if args.profile:
        return profile_trimtab(args)
    if args.load:
        runs = _loaded(args.load)
    else:
        runs = _run_all(args)
    runs = {v: rs for v, rs in runs.items() if rs}  # a variant a time limit cut before it ended: none
    first = next(iter(runs.values()))[0]  # saved repetitions (--load) carry their own date, device and torch
    other = [r["other_cpu"] for rs in runs.values() for r in rs if r.get("other_cpu") is not None]
    publish(
        _heading(args),
        report(args, runs),
        precision="fp32 (a CPU dry run)" if args.dry_run and first["device"] == "cpu" else "bf16 autocast",
        other_cpu=other or None,
        dry_run=args.dry_run,
        date=first.get("date"),
        on=None if first["device"] == "cpu" else f"{first['device']} ({platform.machine()} host)",
        torch_version=first["torch"],
    )


def _loaded(paths: list[str]) -> dict[str, list[dict]]:
    """The repetitions saved by earlier invocations (--save), variant by variant."""
    runs: dict[str, list[dict]] = {}
    for path in paths:
        for variant, results in json.loads(Path(path).read_text()).items():
            runs.setdefault(variant, []).extend(results)
    return runs


def profile_trimtab(args: argparse.Namespace) -> None:
    """--profile: one trimtab process, its timed steps under torch.profiler; prints the top ops."""
    path = Path(args.profile).resolve()
    result = _run_child(args, "trimtab", [f"--profile={path}"])
    print(f"trimtab under the profiler: {result['tokens_per_s']:,.0f} tokens/s (slowed by it); {path}")
    summary = json.loads(path.with_suffix(".json").read_text())
    print(f"{summary['time']} time per step: {summary['total_ms_per_step']:.1f} ms; top ops by self time:")
    for op in summary["ops"][:15] + summary["ranges"]:
        ms, calls = op["ms_per_step"], op["calls_per_step"]
        print(f"  {op['name'][:60]:60s} {ms:9.2f} ms {calls:7.1f} calls {op['share']:6.1%}")


def _run_child(args: argparse.Namespace, variant: str, extra: list[str] = ()) -> dict:
    """Run `variant` in a fresh process with args' settings; its RESULT (exits if it failed)."""
    if args.dry_run:
        return _in_process(args, variant, extra)
    passthrough = [f"--set={s}" for s in args.set] + (["--dry-run"] if args.dry_run else [])
    for name in ("preset", "steps", "warmup", "batch_tokens", "micro_batch_tokens", "data_bytes", "moe_impl"):
        passthrough.append(f"--{name.replace('_', '-')}={getattr(args, name)}")
    cmd = [sys.executable, __file__, "--child", variant, *passthrough, *extra]
    return run_child(cmd, variant, ROOT, echo=True)  # a stage cut by its time limit still logs each child's progress


def _in_process(args: argparse.Namespace, variant: str, extra: list[str]) -> dict:
    """A dry run's variant in this process, as its child would run it: a dry run checks that each runs, not what
    it measures, and a fresh interpreter per variant cost ~2.5 s of CPU importing torch and trimtab. Its console
    lines go to stderr, as the child's did (run_child keeps only the RESULT line of a child's stdout)."""
    own = {arg.removeprefix("--").split("=", 1)[0]: arg.split("=", 1)[1] for arg in extra}  # --profile=PATH
    with Contention() as busy, contextlib.redirect_stdout(sys.stderr):
        result = _variant(argparse.Namespace(**{**vars(args), **own, "variant": variant}))
    return {**result, "other_cpu": busy.other}


def _run_all(args: argparse.Namespace) -> dict[str, list[dict]]:
    variants = args.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(args.reps):
        for variant in variants:
            result = _run_child(args, variant)
            runs[variant].append(result)
            mfu = f"MFU {result['mfu']:.1%}" if result["mfu"] else ""
            print(f"rep {rep} {variant:16s} {result['tokens_per_s']:10,.0f} tok/s {mfu}", flush=True)
            if args.save:  # after every run: a time limit that cuts the benchmark short keeps them
                Path(args.save).write_text(json.dumps(runs))
    return runs


def _heading(args: argparse.Namespace) -> str:
    flags = [f"--preset {args.preset}", *(f"--set {s}" for s in args.set)]
    flags += [f"--moe-impl {args.moe_impl}"] if args.moe_impl != "auto" else []
    return f"## GPU training step (`bench/gpu.py {' '.join(flags)}`)"


def report(args: argparse.Namespace, runs: dict[str, list[dict]]) -> str:
    lines = [
        f"{args.batch_tokens:,} tokens per step in micro-batches of "
        f"{args.micro_batch_tokens:,}; {args.steps} timed steps after {args.warmup} warm-up steps; each "
        "repetition a fresh process. Step times: the fastest and slowest timed step of all repetitions. "
        "Cold start: the trainer's first step less its steady step (compile time, for the compiled row).",
        "",
        "| variant | tokens/s (median) | each repetition | step s (min-max) | MFU (median) | warm-up s "
        "| cold start s | peak GPU memory GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    med = {v: statistics.median(r["tokens_per_s"] for r in rs) for v, rs in runs.items()}
    for v, rs in runs.items():
        each = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in rs)
        mfus = [r["mfu"] for r in rs if r["mfu"]]
        mfu = f"{statistics.median(mfus):.1%}" if mfus else "-"
        mem = max((r["peak_mem_gb"] or 0) for r in rs)
        warm = statistics.median(r["warmup_s"] for r in rs)
        steps = [t for r in rs for t in r.get("step_s", [])]
        spread = f"{min(steps):.3f}-{max(steps):.3f}" if steps else "-"
        colds = [r["cold_start_s"] for r in rs if r.get("cold_start_s") is not None]
        cold = f"{statistics.median(colds):.1f}" if colds else "-"
        lines.append(f"| {v} | {med[v]:,.0f} | {each} | {spread} | {mfu} | {warm:.1f} | {cold} | {mem:.1f} |")
    lines.append("")
    pairs = (("trimtab", "plain"), ("trimtab-compile", "trimtab"), ("trimtab-fp8", "trimtab"))
    for a, b in (*pairs, ("trimtab-fp8-compile", "trimtab-compile")):
        if a in runs and b in runs and len(runs[a]) == len(runs[b]):  # repetition i of each, paired
            ratio = paired_ratio([r["tokens_per_s"] for r in runs[a]], [r["tokens_per_s"] for r in runs[b]])
            lines.append(f"- {a} / {b}, tokens/s: **{ratio}**")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="dense-1b")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=65536)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--data-bytes", type=int, default=24_000_000, help="builtin corpus bytes to read")
    parser.add_argument("--set", action="append", default=[], help="a config override, key=value")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--moe-impl", default="auto", choices=("auto", "grouped", "padded"), help="MoE expert layout")
    parser.add_argument("--load", nargs="+", help="report these --save files' repetitions instead of running")
    parser.add_argument("--save", help="also write the repetitions' results to this JSON file")
    parser.add_argument("--profile", metavar="PATH", help="profile trimtab's timed steps to PATH and PATH.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, debug preset, 1 step: checks it runs")
    parser.add_argument("--child", dest="variant", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.dry_run and ns.variant is None and not ns.load:  # with --load: report, write nothing
        ns.preset, ns.steps, ns.warmup, ns.reps = "debug-moe" if ns.profile else "debug", 1, 1, 1
        ns.batch_tokens, ns.micro_batch_tokens, ns.data_bytes = 512, 256, 300_000
        ns.variants = "trimtab,plain"
    child(ns) if ns.variant else parent(ns)
