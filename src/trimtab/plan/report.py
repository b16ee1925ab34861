"""`trimtab plan`: the whole plan for a run config, as text for a person and JSON for tools."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trimtab.config import RunConfig, load_config
from trimtab.errors import ConfigError
from trimtab.hardware import Precision, gpu_named
from trimtab.model.catalog import ModelSize, model_size
from trimtab.plan.chinchilla import (
    BudgetPlan,
    DataPlan,
    _human,
    budget_plan,
    count_dataset_tokens,
    data_plan,
    nearest_preset,
)
from trimtab.plan.layout import RECOMPUTE, LayoutPlan, plan_layout
from trimtab.plan.layout_text import format_layout
from trimtab.plan.memory import (
    STATE_BYTES,
    Hardware,
    MemoryPlan,
    assumed_mfu,
    detect_hardware,
    hours,
    memory_plan,
    named_gpu,
    run_mfu,
)
from trimtab.plan.resilience import ResiliencePlan, format_resilience, resilience_plan
from trimtab.rundir import write_atomic


@dataclass(kw_only=True)
class Plan:
    preset: str
    model: ModelSize
    tokens_per_param: float
    optimal_tokens: int  # tokens_per_param x the compute parameter count
    optimal_tokens_total_params: int  # the same rule on total parameters (differs for MoE)
    optimal_tokens_non_embedding: int  # ... on non-embedding (active) parameters (Kaplan et al.'s count)
    batch_tokens: int
    tokens: int  # the planned run: optimal, bounded by the data's epochs when the data is known
    steps: int
    flops: float  # flops_per_token x tokens
    flops_6nd: float  # 6 x compute params x tokens, the usual shorthand
    run_steps: int  # the configured run (train.max_steps, or train.epochs over the data when it is known)
    run_tokens: int
    run_flops: float
    train_epochs: float  # train.epochs (0: train.max_steps sets the configured run)
    data: DataPlan | None
    memory: MemoryPlan
    hardware: Hardware
    mfu: float
    mfu_source: str  # plan/memory.py assumed_mfu's
    hours: float | None
    run_hours: float | None
    budget: BudgetPlan | None = None
    layout: LayoutPlan | None = None  # on a GPU of hardware.GPUS: mesh, micro-batch, checkpointing
    launch: str = ""  # what the layout's torchrun line runs
    resilience: ResiliencePlan | None = None  # more than one device: checkpoint interval, expected ETTR
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_plan(
    cfg: RunConfig,
    *,
    dataset_tokens: int | None = None,
    data_path: str | None = None,
    budget_flops: float | None = None,
    budget_hours: float | None = None,
    hardware: Hardware | None = None,
    gpus_per_node: int = 8,
    launch: str = "",
) -> Plan:
    """The plan for `cfg`. Data: `dataset_tokens`, or counted at `data_path`; budget: FLOPs or
    hours on `hardware` (default: this machine, through hardware.py); on GPUs, the parallel
    layout over hardware.devices of them, `gpus_per_node` to a node."""
    _check_inputs(dataset_tokens, budget_flops, budget_hours)
    hw = hardware or detect_hardware(cfg.train.precision)
    size = model_size(cfg, _tokenizer_vocab(cfg))
    mfu, mfu_source = run_mfu(cfg, hw, size.total) or _recomputed(assumed_mfu(cfg, hw), cfg)
    plan = _sized_plan(cfg, size, hw, mfu, mfu_source, dataset_tokens, data_path)
    if budget_flops or budget_hours:
        plan.budget = _budget(size, hw, mfu, plan.batch_tokens, plan.tokens_per_param, budget_flops, budget_hours)
    if hw.kind == "cuda" and gpu_named(hw.name) and hw.memory_bytes:
        plan.layout = plan_layout(cfg, hw, gpus_per_node)
        plan.launch = launch or f"trimtab train --preset {cfg.preset}"
    if hw.devices > 1:
        state = size.total * (STATE_BYTES["weights"] + STATE_BYTES["optimizer"])
        plan.resilience = resilience_plan(hw.devices, state, _step_s(plan))
    plan.notes = _notes(plan)
    return plan


def _recomputed(mfu: tuple[float, str], cfg: RunConfig) -> tuple[float, str]:
    """An assumed MFU of the model's FLOPs under activation checkpointing: a re-run's are not counted."""
    return mfu[0] / RECOMPUTE[cfg.train.activation_checkpointing], mfu[1]


def _sized_plan(
    cfg: RunConfig,
    size: ModelSize,
    hw: Hardware,
    mfu: float,
    mfu_source: str,
    dataset_tokens: int | None,
    data_path: str | None,
) -> Plan:
    """The plan's sizes, without its budget, layout, resilience or notes: the compute-optimal tokens
    (plan.tokens_per_param per compute parameter), bounded by the data's epochs when the data is
    known; the configured run (train.max_steps, or train.epochs over the data); their FLOPs, memory
    and hours at `mfu`."""
    k, batch = cfg.plan.tokens_per_param, cfg.train.batch_tokens
    optimal = max(1, round(k * size.compute_params))  # a tiny plan.tokens_per_param rounded to 0 tokens
    counted = _dataset_tokens(cfg, dataset_tokens, data_path)
    run_steps = _run_steps(cfg, optimal, counted[0] if counted else None)
    run_tokens = run_steps * batch
    data = data_plan(optimal, run_tokens, *counted, k) if counted else None
    if data is not None and cfg.data.pack and data.dataset_tokens < cfg.data.seq_len + 1:
        data.warnings.append(_no_row(cfg, data.dataset_tokens))
    tokens = data.recommended_tokens if data is not None else optimal
    flops = float(size.flops_per_token) * tokens
    run_flops = float(size.flops_per_token) * run_tokens
    non_embedding = size.active_non_embedding if size.compute_params_kind == "active" else size.non_embedding
    return Plan(
        preset=cfg.preset,
        model=size,
        tokens_per_param=k,
        optimal_tokens=optimal,
        optimal_tokens_total_params=round(k * size.total),
        optimal_tokens_non_embedding=round(k * non_embedding),
        batch_tokens=batch,
        tokens=tokens,
        steps=math.ceil(tokens / batch),
        flops=flops,
        flops_6nd=6.0 * size.compute_params * tokens,
        run_steps=run_steps,
        run_tokens=run_tokens,
        train_epochs=cfg.train.epochs,
        run_flops=run_flops,
        data=data,
        memory=memory_plan(cfg, size.total, hw, size.non_embedding),
        hardware=hw,
        mfu=mfu,
        mfu_source=mfu_source,
        hours=hours(flops, hw, mfu),
        run_hours=hours(run_flops, hw, mfu),
    )


def _dataset_tokens(cfg: RunConfig, dataset_tokens: int | None, data_path: str | None) -> tuple[int, str] | None:
    """The data's tokens and how they were known: `dataset_tokens`, or counted at `data_path`; None
    when neither gives a count."""
    if data_path is not None:
        dataset_tokens, source = count_dataset_tokens(cfg, data_path)
        if not dataset_tokens:  # the data section would divide by it: said, not dropped
            raise ConfigError(f"--data {data_path} leaves 0 training tokens ({source}): {_more_data(cfg)}")
    else:
        source = "given with --dataset-tokens"
    return (dataset_tokens, source) if dataset_tokens else None


def _more_data(cfg: RunConfig) -> str:
    """The settings that leave training more of the data (data/packing.py _hold_out)."""
    if cfg.data.eval_source or not cfg.data.eval_fraction:
        return "add data"
    return (
        f"lower data.eval_fraction (now {cfg.data.eval_fraction:g}: it holds out whole documents, "
        "at least one), give data.eval_source, or add data"
    )


def _no_row(cfg: RunConfig, tokens: int) -> str:
    """Packed training data shorter than one row: training stops at its start (data/packing.py build_splits)."""
    return (
        f"{tokens:,} training tokens are not enough for one packed row of data.seq_len+1={cfg.data.seq_len + 1}: "
        f"training would stop at its start; lower data.seq_len, set data.pack=false, {_more_data(cfg)}"
    )


def _run_steps(cfg: RunConfig, optimal: int, dataset_tokens: int | None) -> int:
    """The configured run's steps as training resolves them (training/run_length.py, resolve_max_steps):
    train.epochs passes over the data when set (it wins over train.max_steps), auto's Chinchilla
    budget, or train.max_steps. train.epochs over data the plan was not given: train.max_steps',
    and the notes say the length is unknown."""
    train = cfg.train
    if train.epochs > 0 and dataset_tokens:
        return max(1, math.ceil(train.epochs * dataset_tokens / train.batch_tokens))
    if train.max_steps == "auto":
        return max(1, math.ceil(optimal / train.batch_tokens))
    return int(train.max_steps)


def _steps_line(plan: Plan) -> str:
    """steps x batch_tokens as a true product: whole steps round the planned tokens up, said when they do."""
    trained = plan.steps * plan.batch_tokens
    rounded = f" (the {plan.tokens:,} planned, rounded up to whole steps)" if trained != plan.tokens else ""
    return f"  steps           {plan.steps:,} x train.batch_tokens {plan.batch_tokens:,} = {trained:,} tokens{rounded}"


def _step_s(plan: Plan) -> float | None:
    """One optimizer step's seconds: the proposed layout's estimate where there is one (its
    communication counted), else the plan's time at the assumed MFU over its steps."""
    if plan.layout is not None and plan.layout.best is not None:
        return plan.layout.best.step_s
    return plan.run_hours * 3600 / plan.run_steps if plan.run_hours else None


def _check_inputs(dataset_tokens: int | None, budget_flops: float | None, budget_hours: float | None) -> None:
    for name, value in (
        ("--dataset-tokens", dataset_tokens),
        ("--budget-flops", budget_flops),
        ("--budget-hours", budget_hours),
    ):
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    if budget_flops and budget_hours:
        raise ConfigError("give one budget: --budget-flops or --budget-hours")


def _tokenizer_vocab(cfg: RunConfig) -> int | None:
    """The vocabulary of data.tokenizer, which sets the model's when model.vocab_size is 0."""
    if cfg.model.vocab_size or not cfg.data.tokenizer:
        return None
    from trimtab.data.tokenizer import configured_tokenizer

    return configured_tokenizer(cfg.data).vocab_size


def _budget(
    size: ModelSize, hw: Hardware, mfu: float, batch: int, k: float, flops: float | None, budget_hours: float | None
) -> BudgetPlan:
    rate = hw.peak_flops * mfu * hw.devices if hw.peak_flops else None
    if flops is None:
        if rate is None:
            raise ConfigError(
                f"--budget-hours needs a peak FLOP/s and {hw.name} has none "
                f"({hw.peak_source}); give --budget-flops or --gpu NAME"
            )
        flops = budget_hours * 3600 * rate
    plan = budget_plan(size, flops, budget_hours or (flops / rate / 3600 if rate else None), batch, k)
    plan.nearest_preset = nearest_preset(plan.optimal_params, size.family in ("moe", "hybrid"))
    return plan


def _notes(plan: Plan) -> list[str]:
    size, k = plan.model, plan.tokens_per_param
    notes = [
        f"Chinchilla rule (Hoffmann et al. 2022): ~{k:g} tokens per parameter, counting all "
        f"parameters including embeddings (as Hoffmann et al. did); on non-embedding parameters "
        f"(Kaplan et al. 2020's count) it would be {plan.optimal_tokens_non_embedding:,} tokens"
    ]
    if size.compute_params_kind == "active":
        notes.append(
            f"MoE: the rule uses the ACTIVE parameters ({size.active:,} of {size.total:,}): training "
            f"compute per token is ~6 x N_active and the {k:g}x rule is the compute-optimal split of "
            f"C = 6ND, so N_active is the N the compute sees. On total parameters it would ask for "
            f"{plan.optimal_tokens_total_params:,} tokens. MoE scaling laws (Clark et al. 2022; "
            "Krajewski et al. 2024) move the optimum with the expert count: a starting point"
        )
    if plan.train_epochs and plan.data is None:
        notes.append(
            f"train.epochs={plan.train_epochs:g} sets the run's length from its data, which this plan was not "
            f"given: the configured run above is train.max_steps', which train.epochs overrides; give --data PATH "
            "or --dataset-tokens N to plan the epochs"
        )
    elif plan.run_tokens < 0.5 * plan.tokens or plan.run_tokens > 2 * plan.tokens:
        notes.append(
            f"the configured run, {_configured(plan)}, trains {plan.run_tokens / plan.tokens:.2g}x the planned "
            f"tokens: {_follow(plan)} to follow the plan{_within_budget(plan)}"
        )
    return notes


def _within_budget(plan: Plan) -> str:
    """With a budget the plan's length may be far past it (a 3-minute budget, a 5-hour plan): the
    note names the run the budget pays for too, which its own section only counts."""
    if plan.budget is None or plan.budget.preset_steps >= plan.steps:
        return ""
    return f", or train.max_steps={plan.budget.preset_steps:,} to stay within the budget"


def _configured(plan: Plan) -> str:
    """What sets the configured run's length: train.epochs over the data when both are known."""
    if plan.train_epochs and plan.data is not None:
        return f"train.epochs {plan.train_epochs:g} ({plan.run_steps:,} steps)"
    return f"train.max_steps {plan.run_steps:,}"


def _follow(plan: Plan) -> str:
    """The setting that gives the planned tokens: train.epochs wins over train.max_steps, so while
    it is set, advice to change train.max_steps would change nothing."""
    if plan.train_epochs and plan.data is not None:
        return f"set train.epochs={plan.tokens / plan.data.dataset_tokens:.3g}"
    return f"set train.max_steps={plan.steps}"


def format_plan(plan: Plan) -> str:
    s, m, hw = plan.model, plan.memory, plan.hardware
    sparse = f"   active {s.active:,} (non-embedding {s.active_non_embedding:,})" if s.active != s.total else ""
    lines = [
        f"trimtab plan: preset {plan.preset} ({s.family})",
        "",
        "Model",
        f"  parameters      total {s.total:,}   non-embedding {s.non_embedding:,}{sparse}",
        f"  FLOPs per token {s.flops_per_token:,} (training, forward + backward, seq_len {s.seq_len})",
        "",
        "Compute-optimal plan",
        f"  tokens          {plan.optimal_tokens:,} = {plan.tokens_per_param:g} x {s.compute_params:,} "
        f"{s.compute_params_kind} parameters",
    ]
    if plan.data:
        lines += _data_lines(plan.data, plan.tokens)
    lines += [
        _steps_line(plan),
        f"  FLOPs           {plan.flops:.3g} (flops_per_token x tokens; 6ND gives {plan.flops_6nd:.3g})",
        f"  configured run  {_configured(plan)} = {plan.run_tokens:,} tokens, {plan.run_flops:.3g} FLOPs",
        "",
        f"Memory per device (estimate; {m.micro_batch_tokens:,}-token micro-batch, activations "
        f"{m.activation_bytes} bytes{f', checkpointing {m.checkpointing}' if m.checkpointing != 'off' else ''}"
        f"{f', FSDP over {m.shards}' if m.shards > 1 else ''})",
        f"  weights {_gb(m.weights)}  gradients {_gb(m.gradients)}  AdamW moments {_gb(m.optimizer)}  "
        f"activations {_gb(m.activations)}" + (f"  autocast weight copies {_gb(m.casts)}" if m.casts else ""),
        f"  total {_gb(m.total)}"
        + (
            "" if m.fits is None else f" of {_gb(m.device_memory)} on {hw.name}: {'fits' if m.fits else 'does NOT fit'}"
        ),
        "",
        f"Time on {hw.devices} x {hw.name} (peak {_peak(hw)}, MFU {plan.mfu:.0%}: {plan.mfu_source})",
        f"  planned run     {_hours(plan.hours)}",
        f"  configured run  {_hours(plan.run_hours)}",
    ]
    if hw.precision_source:  # on a CPU with native bf16, a step of this model timed (or its cached timing)
        lines.append(f"  precision       {hw.precision}: {hw.precision_source}")
    if hw.devices > 1 and plan.layout is not None and (b := plan.layout.best) is not None:  # communication counted
        lines.append(
            f"  with the layout {_hours(plan.run_steps * b.step_s / 3600)} for the configured run "
            f"(its step estimate below, MFU ~{b.mfu:.0%}; the checkpoint interval counts in these steps)"
        )
    if plan.budget:
        lines += _budget_lines(plan.budget, s, plan.tokens_per_param)
    if plan.layout:
        lines += [""] + format_layout(plan.layout, plan.launch)
    if plan.resilience:
        lines += [""] + format_resilience(plan.resilience)
    lines += ["", "Notes"] + [f"  - {n}" for n in plan.notes]
    return "\n".join(lines)


def _data_lines(d: DataPlan, tokens: int) -> list[str]:
    bounded = f", bounded to {d.recommended_epochs:.0f} ({tokens:,} tokens)" if d.recommended_epochs < d.epochs else ""
    lines = [
        f"  dataset         {d.dataset_tokens:,} tokens ({d.source})",
        f"  epochs          {d.epochs:.2f} for the optimal tokens{bounded}; the configured run: {d.run_epochs:.2f}",
        f"  fresh-token worth {d.effective_tokens:,.0f} of {tokens:,} (Muennighoff et al. 2023)",
    ]
    return lines + [f"  WARNING: {w}" for w in d.warnings]


def _budget_lines(b: BudgetPlan, s: ModelSize, k: float) -> list[str]:
    when = f" ({_hours(b.hours)})" if b.hours else ""
    return [
        "",
        f"Budget {b.flops:.3g} FLOPs{when}",
        f"  compute-optimal N = sqrt(C / (6 x {k:g})) = {_human(b.optimal_params)} {s.compute_params_kind} "
        f"parameters on D = {_human(b.optimal_tokens)} tokens (nearest preset: {b.nearest_preset or 'none'})",
        f"  this preset: {b.preset_tokens:,.0f} tokens = {b.preset_steps:,} steps, "
        f"{b.preset_tokens_per_param:.3g} tokens per parameter",
        f"  {b.verdict}",
    ]


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _peak(hw: Hardware) -> str:
    return f"{hw.peak_flops / 1e12:.3g} TFLOP/s, {hw.peak_source}" if hw.peak_flops else f"unknown: {hw.peak_source}"


def _hours(h: float | None) -> str:
    if h is None:
        return "unknown (no peak FLOP/s for this device; try --gpu NAME)"
    if h < 1 / 60:
        return f"{h * 3600:.1f} s"
    years = h / (24 * 365.25)
    if years >= 2:  # a large preset on a CPU: "34259303950.0 days" reads as noise, years to 3 digits do not
        return f"{years:.3g} years"
    return f"{h * 60:.1f} min" if h < 1 else f"{h:.1f} h" if h < 48 else f"{h / 24:.1f} days"


def save_plan(plan: Plan, out: str | Path) -> tuple[Path, Path]:
    """plan.json and plan.txt in `out`, each written atomically."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = (out / "plan.json", out / "plan.txt")
    for path, text in zip(paths, (json.dumps(plan.as_dict(), indent=1), format_plan(plan) + "\n")):
        write_atomic(path, text)
    return paths


def plan_command(
    config: str | None,
    preset: str | None,
    sets: list[str],
    out: str | None,
    *,
    dataset_tokens: float | None = None,
    data: str | None = None,
    budget_flops: float | None = None,
    budget_hours: float | None = None,
    gpu: str | None = None,
    devices: int = 1,
    gpus_per_node: int = 8,
    emit: str | None = None,
    precision_of: Callable[[RunConfig], Precision] | None = None,
) -> str:
    """What `trimtab plan` does: resolve the config, plan, save (with `emit`, a cluster launch
    file too: plan/launch.py); returns the text to print. `precision_of`: what a run of the config
    trains in on this machine (the CLI's: a CPU's bf16 kept only where the model's step is faster),
    so the plan's peak, activation width and autocast copies are the run's."""
    if devices < 1:  # the flag's two names: which one was typed is not known here
        raise ConfigError(f"--gpus/--devices must be >= 1, got {devices}")
    cfg = load_config(config, preset=preset, sets=sets)
    if gpu:
        hardware = named_gpu(gpu, devices)
    else:
        precision = precision_of(cfg) if precision_of else None
        hardware = detect_hardware(cfg.train.precision, devices, precision)
    tokens = None if dataset_tokens is None else round(dataset_tokens)  # the CLI reads 1e9 as a float
    plan = make_plan(
        cfg,
        dataset_tokens=tokens,
        data_path=data,
        budget_flops=budget_flops,
        budget_hours=budget_hours,
        hardware=hardware,
        gpus_per_node=gpus_per_node,
        launch=f"trimtab train {config}" if config else "",
    )
    json_path, txt_path = save_plan(plan, out or cfg.run_dir)
    saved = f"saved {json_path} and {txt_path}"
    if emit:
        from trimtab.plan.launch import launch_file

        name, text = launch_file(plan, emit, config, str(cfg.run_dir))
        kept = _keep_previous(json_path.parent / name, text)
        write_atomic(json_path.parent / name, text)
        saved += f", and {json_path.parent / name} ({emit})" + (f"; the one before kept as {kept}" if kept else "")
    return f"{format_plan(plan)}\n\n{saved}"


def _keep_previous(path: Path, text: str) -> Path | None:
    """A launch file there already that differs from `text` (its EDIT lines filled in for a site,
    a planned layout edited), renamed to the first free NAME.N.bak rather than overwritten."""
    if not path.is_file() or path.read_text() == text:
        return None
    n = 1
    while (kept := path.with_name(f"{path.name}.{n}.bak")).exists():
        n += 1
    path.rename(kept)
    return kept
