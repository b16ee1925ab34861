"""A layout plan (plan/layout.py) as text: the proposed layout with its memory, step time and the
launch line that runs it, why it won (for each setting, the best layout with each other value),
and the alternatives, fastest first; for `trimtab plan` and `trimtab doctor`. Apart from the
search and its estimates, which hold the arithmetic (the module docstring of layout.py).
"""

from __future__ import annotations

from trimtab.plan.layout import Layout, LayoutPlan


def format_layout(plan: LayoutPlan, command: str) -> list[str]:
    """The proposal, why, and the alternatives, for `trimtab plan` and `trimtab doctor`;
    `command` is what the launch line runs (e.g. "trimtab train --preset dense-70b")."""
    net = f", network {plan.network / 1e9:.0f} GB/s" if plan.network != plan.link else ""
    lines = [
        f"Parallel layout on {plan.gpus} x {plan.gpu} ({plan.gpus_per_node} per node; link "
        f"{plan.link / 1e9:.0f} GB/s{net} per GPU; estimates: plan/layout.py)"
    ]
    b = plan.best
    if b is None:
        if not plan.candidates:  # no layout was even tried: the GPUs outnumber the batch's rows, not memory
            lines.append(
                f"  nothing fits: {plan.gpus} GPUs are more than train.batch_tokens has rows for; use fewer GPUs "
                "or raise train.batch_tokens"
            )
        else:
            need = f"about {plan.gpus_needed} GPUs" if plan.gpus_needed else f"no number of {plan.gpu}s"
            lines.append(f"  nothing fits: {need} would hold it with the parallelism trimtab has today")
        lines += [f"  - {r}" for r in plan.reasons]
        smallest = plan.candidates[0] if plan.candidates else None
        if smallest:
            lines.append(f"  the leanest layout needs {_memory(smallest)} per GPU with a single row")
        if smallest and smallest.buffer_bytes > smallest.memory_bytes / 4:
            lines.append(
                "  FSDP gathers a whole block on every GPU, however many there are; only splitting inside "
                "a block lowers that: tensor parallelism (distributed.tp) and, for MoE layers, expert "
                "parallelism (distributed.ep)"
            )
        return lines
    replicas = "one replica" if b.dp == 1 else f"{b.dp} replicas under {'FSDP2' if b.strategy == 'fsdp' else 'DDP'}"
    nodes = -(-plan.gpus // plan.gpus_per_node)
    launcher = f"torchrun --nnodes {nodes} --nproc_per_node {plan.gpus_per_node} -m " if plan.gpus > 1 else ""
    stages = f"pp {b.pp} x " if b.pp > 1 else ""
    lines += [
        f"  proposed   {stages}tp {b.tp} x dp {b.dp} ({replicas}{_experts(b)}), activation checkpointing "
        f"{b.checkpointing}; micro-batch {b.micro_batch_tokens:,} tokens x "
        f"{b.accumulation} per replica per step",
        f"  memory     {_memory(b)} per GPU",
        f"  step       ~{_secs(b.step_s)}: compute {_secs(b.compute_s)} + tensor-parallel {_secs(b.tp_comm_s)} "
        + (f"+ pipeline bubble {_secs(b.bubble_s)} + sends {_secs(b.pp_comm_s)} " if b.pp > 1 else "")
        + (f"+ expert-parallel {_secs(b.ep_comm_s)} " if b.ep > 1 else "")
        + f"+ data-parallel exposed {_secs(b.dp_comm_s)}, MFU ~{b.mfu:.0%}",
        f"  run it     {launcher}{command} " + " ".join(f"--set {s}" for s in b.settings()),
        "  why",
    ]
    lines += [f"    - {line}" for line in _why(plan)]
    lines.append(
        "  alternatives (fastest first)  pp  tp   dp   ep  strategy  ckpt           micro   memory GiB   step s   MFU"
    )
    for c in plan.candidates[:8]:
        micro = f"{c.micro_batch_tokens:>10,}" if c.fits else "   no fit "
        lines.append(
            f"{'':31}{c.pp:>2}  {c.tp:>2} {c.dp:>4} {c.ep:>4}  {c.strategy if c.dp > 1 else '-':8}  "
            f"{c.checkpointing:9}"
            f" {micro}  {c.memory_bytes / 2**30:>10.1f}  "
            + (f"{c.step_s:>7.3g}  {c.mfu:>4.0%}" if c.fits else f"{'-':>7}  {'-':>4}")
        )
    return lines


def _why(plan: LayoutPlan) -> list[str]:
    """For each setting, the best layout with each other value of it: what the choice won."""
    b, lines = plan.best, []
    keys = [("pipeline", "pp"), ("tensor parallel", "tp"), ("expert parallel", "ep"), ("data parallel", "strategy")]
    for name, key in [*keys, ("checkpointing", "checkpointing")]:
        others = {}
        for c in plan.candidates:  # fastest first: the first with a value is its best
            value = getattr(c, key)
            if value != getattr(b, key) and value not in others and (key != "strategy" or c.dp > 1):
                others[value] = "does not fit" if not c.fits else f"{_secs(c.step_s)} ({c.step_s / b.step_s:.2f}x)"
        if others:
            shown = ", ".join(f"{_value(key, v)}: {t}" for v, t in others.items())
            lines.append(f"{name}: {_value(key, getattr(b, key))} ({_secs(b.step_s)}) over {shown}")
    return lines + plan.reasons


def _value(key: str, value: object) -> str:
    return f"{key}={value}" if key in ("tp", "ep", "pp") else str(value)


def _experts(c: Layout) -> str:
    return f"; every {c.ep} share one copy of the experts" if c.ep > 1 else ""


def _memory(c: Layout) -> str:
    buffers = f" + FSDP buffers {c.buffer_bytes / 2**30:.1f}" if c.buffer_bytes else ""
    return (
        f"{c.memory_bytes / 2**30:.1f} GiB (model state {c.state_bytes / 2**30:.1f}{buffers} + activations "
        f"{c.activation_bytes / 2**30:.1f})"
    )


def _secs(s: float) -> str:
    return f"{s * 1000:.3g} ms" if s < 1 else f"{s:.3g} s"
