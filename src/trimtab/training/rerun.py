"""Re-running an anomalous step before deciding what it was, as Megatron-LM's rerun state machine
does in its validate_results mode.

When the update gate flags a step (a non-finite or spiking loss or gradient norm: the
orchestrator's gate, docs/orchestrator.md), the trainer computes the step's gradients again from
the same weights on the same rows (Trainer._rerun; no optimizer step has run). The same result
again means the cause is reproducible: the data, or the weights; the update stays withheld and the
orchestrator's usual path follows (the rows attributed, the LR cut if it persists). A different
result means the first computation was wrong: a transient fault (a flipped bit in a device's
memory or arithmetic, a flaky link), and the re-run's gradients are the step's: it trains as if
nothing happened, and the orchestrator journals the fault (rule `rerun`).

Cost: one more forward and backward on a flagged step only, and one host read of the gate's flag
per step (`resilience.rerun`; off: the flag stays on the device). The training forward draws no
random numbers, so a re-run on the same device is exact; TOLERANCE covers GPU kernels whose
reductions are not deterministic (atomics), and sits far below what a fault does to a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from trimtab.distributed.group import all_gather_floats
from trimtab.training.runtime import RouterStats, RowLosses

TOLERANCE = 1e-3  # relative: non-deterministic GPU reductions differ by ~1e-6; a fault by orders of magnitude


@dataclass
class Gradients:
    """One computation of a step's gradients (they are in the parameters' .grad), with what it
    measured, on device."""

    loss: torch.Tensor  # 0-d: the token-normalised loss of the whole step (summed over ranks)
    aux: torch.Tensor | None  # 0-d: the weighted auxiliary losses
    routers: RouterStats
    rows: RowLosses | None
    grad_norm: torch.Tensor  # 0-d: the pre-clip global norm
    local_sq: torch.Tensor | None = None  # 0-d: this rank's own gradient's sum of squares (DDP)


def compare(first: Gradients, again: Gradients) -> dict[str, Any]:
    """The verdict on a re-run (`transient` when the two computations differ, else `reproducible`)
    with both values of the loss and the gradient norm."""
    values = {
        "loss": [float(first.loss), float(again.loss)],
        "grad_norm": [float(first.grad_norm), float(again.grad_norm)],
    }
    same = all(_same(a, b) for a, b in values.values())
    return {"verdict": "reproducible" if same else "transient", **values}


def ranks_that_differ(first: Gradients, again: Gradients) -> list[int]:
    """The ranks whose own gradient differed between the two computations (every rank gathers
    both sums of squares: two floats each): the device that computed the step wrong. Empty
    where no rank's own gradient was measured (one process, FSDP2, tensor parallelism)."""
    if first.local_sq is None or again.local_sq is None:
        return []
    rows = all_gather_floats([float(first.local_sq), float(again.local_sq)])
    return [rank for rank, (a, b) in enumerate(rows) if not _same(a, b)]


def _same(a: float, b: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b  # the same infinity, or NaN twice
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1e-12)
