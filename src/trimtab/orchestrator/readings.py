"""A step's readings for the monitors: what the orchestrator copies off the device in one read
(device_values), how it turns the copies into a StepMetrics (step_metrics; its fields row_means, gated_rows,
moe_loads, mod_layers), and the memory share no copy is needed for (memory_fraction)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from trimtab.hardware import ram_bytes
from trimtab.orchestrator.monitors import StepMetrics

if TYPE_CHECKING:
    from trimtab.training.state import StepOutput
    from trimtab.training.view import RunView


def device_values(out: StepOutput, moe: bool) -> dict[str, Any]:
    """The step's values still on the device, to read in one copy with the others (to_host)."""
    return {
        "loss": out.loss,
        "grad_norm": out.grad_norm,
        "skipped": out.skipped if out.skipped is not None else False,
        "overflow": out.overflow if out.overflow is not None else False,
        "mod": out.mod["means"][:, 0].mean() if out.mod else None,
        "mod_layers": out.mod["means"][:, 0] if out.mod else None,
        "moe": {"counts": out.moe["counts"], "means": out.moe["means"]} if moe and out.moe else None,
        "rows": out.row_losses,
        "gain": out.update_gain,
    }


def step_metrics(
    run: RunView, o: StepOutput, values: dict[str, Any], seconds: float, memory: float | None, top_k: dict[int, int]
) -> StepMetrics:
    """One step as the monitors see it, from its values read off the device (device_values, to_host),
    its time and memory share (every rank's largest) and the MoE layers' top_k. Its loss is that of the
    rows the update trained (StepMetrics.trained_loss): the row gate's stand in the step's loss as scored,
    and a step whose garbage was left out is judged on what it trained on, as the update gate judged it."""
    m = StepMetrics(
        step=o.step,
        loss=values["loss"],
        grad_norm=values["grad_norm"],
        skipped=bool(values["skipped"]),
        skip_by=o.skip_by,
        overflow=bool(values["overflow"]),
        tokens_per_s=o.batch.n_tokens / max(seconds, 1e-9),
        lr=o.lr,
        scheduled_lr=o.scheduled_lr,
        lr_scale=o.lr_scale,
        progress=o.step / max(run.total_steps, 1),
        memory_frac=memory,
        micro_batch_tokens=o.micro_batch_tokens,
        checkpointing=run.activation_checkpointing,
        changes=o.changes,
        world=run.world,
        phase=o.phase,
        rows=o.batch.rows,
        row_losses=row_means(o.batch.rows, values["rows"]),
        # what the gate did (gates_rows turns it off): journaled even if paused since the step
        gated_rows=gated_rows(o.batch.rows, values["rows"]),
        row_parts=run.row_parts(o.batch.rows),  # the rows rule judges a row among its source's
        moe=moe_loads(o, values["moe"], top_k),
        mod_capacity=values["mod"],
        mod_layers=mod_layers(o, values["mod_layers"]),
        update_gain=values["gain"],
        rl=getattr(o.batch, "health", None),  # an RL step's figures (rl/step.py)
    )
    trained = m.trained_loss()
    m.loss = trained if trained is not None else m.loss  # None: every row gated, the step withheld
    return m


def row_means(rows: list[int], host: list[list[float]] | None) -> dict[int, tuple[float, int]] | None:
    """Each row's (mean loss per target in nats, targets) from the step's read [R, 2] (summed
    loss, targets; a row's first place holds it, training.runtime.RowLosses; a third column, the
    gate's, is gated_rows'); rows without targets left out."""
    if host is None:
        return None
    means: dict[int, tuple[float, int]] = {}
    for row, (summed, count, *_) in zip(rows, host):
        if count > 0 and row not in means:
            means[row] = (summed / count, int(count))
    return means


def gated_rows(rows: list[int], host: list[list[float]] | None) -> list[int]:
    """The rows the row gate left out of the step's update (training/row_gate.py), from the same
    read: its third column, summed over the ranks (> 0 where any rank gated the row); none
    without it (no gate, no row losses)."""
    return sorted({row for row, values in zip(rows, host or ()) if len(values) > 2 and values[2] > 0})


def mod_layers(out: StepOutput, host: list[float] | None) -> list[tuple[int, float]] | None:
    """Each Mixture-of-Depths layer's (layer, capacity) from the step's read values."""
    return None if host is None else list(zip(out.mod["layers"], host))


def moe_loads(out: StepOutput, host: dict[str, Any] | None, top_k: dict[int, int]) -> list[tuple] | None:
    """Each MoE layer's (layer, load shares, dropped fraction, top_k) from the step's read values."""
    if host is None:
        return None
    rows = []
    for layer, counts, means in zip(out.moe["layers"], host["counts"], host["means"]):
        total = sum(counts) or 1.0
        rows.append((layer, [c / total for c in counts], means[0], top_k.get(layer, 1)))  # means: dropped, ...
    return rows


def device_memory(device: torch.device) -> int | None:
    """The memory a step must fit in: the device's (CUDA), or the machine's RAM (CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return ram_bytes()


def machine(world: int, device: torch.device) -> list[int | None]:
    """What an out-of-memory error depends on (OutOfMemory.ran_out_on): processes, memory per device."""
    return [world, device_memory(device)]


def memory_fraction(device: torch.device) -> float | None:
    """Share of device memory the allocator holds (CUDA), or of machine RAM this process uses
    (CPU, Linux); no device sync either way."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device) / torch.cuda.get_device_properties(device).total_memory
    total = ram_bytes()
    try:
        with open("/proc/self/statm") as fh:
            rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
    return rss / total if total else None
