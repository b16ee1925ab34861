"""Scoring rows one by one: each row's mean loss per target on the current weights.

The orchestrator's data attribution (which rows of a bad stretch are bad) compares the rows of
flagged steps with held-out rows scored the same way, so a model that is merely worse than usual
shifts both alike. Evaluation mode, no gradients; the loss goes through the same chunked
cross-entropy as training, so no [B, T, V] logits are ever held.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

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


@contextmanager
def untouched(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """A read of the model (RunView's scoring) that leaves the run exactly as it was: every
    module's train / eval mode (a scoring forward runs in eval; a hook may read inside a step,
    in update_gate, before the re-run's forward: that must not run in eval), the routed layers'
    last-forward state (MoE and Mixture-of-Depths `stats` and `aux_loss`: an eval forward
    overwrites them, and add_expert picks the expert it splits from the MoE stats when no load
    was counted) and the random number generators (the CPU's, and a GPU's). The MoE
    `load` and the balancing bias are written by training forwards and steps only."""
    modes = [(m, m.training) for m in model.modules()]
    routed = [layer for _, layer in model.moe_layers()] + [router for _, router in model.mod_layers()]
    last = [(layer.aux_loss, layer.stats) for layer in routed]
    # the CPU's generator always; a GPU's too (another accelerator's draws no read makes: none in eval)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type="cuda"):
        try:
            yield
        finally:
            for module, mode in modes:
                module.training = mode  # each module's own: train(mode) would set its children too
            for layer, (aux, stats) in zip(routed, last):
                layer.aux_loss, layer.stats = aux, stats
