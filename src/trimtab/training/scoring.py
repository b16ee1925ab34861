"""Scoring rows one by one: each row's mean loss per target on the current weights.

The orchestrator's data attribution (which rows of a bad stretch are bad) compares the rows of
flagged steps with held-out rows scored the same way, so a model that is merely worse than usual
shifts both alike. Evaluation mode, no gradients; the loss goes through the same chunked
cross-entropy as training, one row at a time, so no [B, T, V] logits are ever held.
"""

from __future__ import annotations

from collections import Counter

import torch

from trimtab.data import IGNORE_INDEX, MicroBatch, Rows
from trimtab.training.loss import cross_entropy_sum
from trimtab.training.runtime import read_scalars


@torch.no_grad()
def row_losses(model, forward, precision, micro_batches: list[MicroBatch], device: torch.device) -> list[float]:
    """Each row's mean loss per target (micro-batch order, rows in order); one device read."""
    model.eval()
    losses = []
    for micro in micro_batches:
        targets = micro.targets.to(device)
        with precision.autocast():
            hidden = forward(micro.inputs.to(device))  # [B, T, D]
            for b in range(targets.shape[0]):
                n = (targets[b] != IGNORE_INDEX).sum().clamp(min=1)
                losses.append(cross_entropy_sum(hidden[b : b + 1], model.lm_head.weight, targets[b : b + 1]) / n)
    return read_scalars(losses)


def sources_of(rows: Rows, indices: list[int]) -> dict[str, int]:
    """How many of the rows come from each source (a row spanning documents counts for each)."""
    counts = Counter(source for i in indices for source in set(rows.sources(i)))
    return dict(counts.most_common())
