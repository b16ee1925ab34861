"""Scoring rows one by one: each row's mean loss per target on the current weights.

The orchestrator's data attribution (which rows of a bad stretch are bad) compares the rows of
flagged steps with held-out rows scored the same way, so a model that is merely worse than usual
shifts both alike. Evaluation mode, no gradients; the loss goes through the same chunked
cross-entropy as training, so no [B, T, V] logits are ever held.
"""

from __future__ import annotations

from collections import Counter

import torch

from trimtab.data import IGNORE_INDEX, MicroBatch, Rows
from trimtab.training.loss import cross_entropy_sum
from trimtab.training.runtime import read_scalars


@torch.no_grad()
def row_losses(model, forward, precision, micro_batches: list[MicroBatch], device: torch.device) -> list[float]:
    """Each row's mean loss per target (micro-batch order, rows in order); one device read. One
    loss call per micro-batch: the chunked loss keeps each token's loss (token_losses), summed per row."""
    model.eval()
    losses = []
    for micro in micro_batches:
        targets = micro.targets.to(device)
        tokens = torch.zeros(targets.numel(), dtype=torch.float32, device=device)
        with precision.autocast():
            cross_entropy_sum(forward(micro.inputs.to(device)), model.lm_head.weight, targets, token_losses=tokens)
        counted = (targets != IGNORE_INDEX).sum(1).clamp(min=1)  # [B]
        losses.extend(tokens.view(targets.shape).sum(1) / counted)
    return read_scalars(losses)


def sources_of(rows: Rows, indices: list[int]) -> dict[str, int]:
    """How many of the rows come from each source (a row spanning documents counts for each)."""
    counts = Counter(source for i in indices for source in set(rows.sources(i)))
    return dict(counts.most_common())
