"""Rollout routing replay (R3; Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers", arXiv 2510.11370): the experts a Mixture-of-Experts
policy chose for each token while generating are imposed on the training forward over the same
tokens. A Mixture-of-Depths policy's routing is replayed likewise: generation routes each token
by the block's causal predictor, and the replayed training forward by the decisions generation
made (the top-k at the training capacity would send other tokens through: debug-mod, CPU, fp32,
5-8% of the response tokens off the clip range on-policy, 0 replayed; the predictor asked again
flips a near-tie at 0 as a router's top-k does, below).

Why: generation decodes a token at a time on the KV cache while training runs whole sequences,
so their matmuls round differently; a dense policy's log-probabilities then differ by ~1e-7, but
a router's top-k turns a near-tie flipped by that rounding into another expert and the token's
log-probability moves by far more (debug-moe on a CPU in fp32, a few RL steps in: importance
ratios up to 1.12 against 1.0000005 for the dense preset; `rl/ratio_max`). The objective then
treats the policy's own samples as off-policy, clips them and trains against noise. Replayed,
both passes route alike: the gates stay the router's probabilities of the replayed experts, so
the router is trained as it would have been.

Shapes: B rows, P the longest prompt (left-padded), L MoE layers, M Mixture-of-Depths layers, k
experts per token, n a sequence's input positions (its prompt and response less the last token), W
a micro-batch's width.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from trimtab.model import Transformer

if TYPE_CHECKING:  # rl/rollout.py imports this module
    from trimtab.rl.rollout import Rollout


class Routes:
    """What the MoE layers chose during one generation of `rows` rows: per layer, the prefill's
    [B * P, k] then each decode step's [B, k]; and the Mixture-of-Depths layers' decisions
    (`depth`), the same with k = 1 (processed or not)."""

    def __init__(self, layers: list[list[torch.Tensor]], rows: int, depth: list[list[torch.Tensor]] = ()) -> None:
        self.layers, self.rows, self.depth = layers, rows, list(depth)
        self._host: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}  # "layers" / "depth": read once

    def sequence(self, row: int, pad: int, n: int) -> np.ndarray | None:
        """Row `row`'s choices at its first `n` input positions (its prompt after `pad` padding
        positions, then its fed tokens): int16 [L, n, k]; None without MoE layers."""
        return _row(self._hosted("layers"), row, pad, n) if self.layers else None

    def decisions(self, row: int, pad: int, n: int) -> np.ndarray | None:
        """Row `row`'s Mixture-of-Depths decisions at its first `n` input positions, as sequence's: bool
        [M, n]; None without such layers."""
        return _row(self._hosted("depth"), row, pad, n)[..., 0].astype(bool) if self.depth else None

    def _hosted(self, kind: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """`kind`'s records on the host: one device read per layer and step for the whole batch."""
        if kind not in self._host:
            self._host[kind] = [self._gather(records) for records in getattr(self, kind)]
        return self._host[kind]

    def _gather(self, records: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        """[B, P, k] and [steps, B, k], int16 on the host."""
        k = records[0].shape[1]
        prefill = records[0].view(self.rows, -1, k).to("cpu", torch.int16).numpy()
        steps = torch.stack(records[1:]) if len(records) > 1 else records[0].new_zeros(0, self.rows, k)
        return prefill, steps.to("cpu", torch.int16).numpy()


def _row(host: list[tuple[np.ndarray, np.ndarray]], row: int, pad: int, n: int) -> np.ndarray:
    return np.stack([np.concatenate([prefill[row, pad:], steps[:, row]])[:n] for prefill, steps in host])


@contextmanager
def recording(model: Transformer, rows: int, on: bool = True) -> Iterator[Routes | None]:
    """While on, every MoE layer of `model` keeps the experts it chooses for a batch of `rows`
    rows, and every Mixture-of-Depths layer its decisions; yields their Routes (None for a model
    with neither, or when off)."""
    experts = [layer for _, layer in model.moe_layers()] if on else []
    depth = [router for _, router in model.mod_layers()] if on else []
    if not experts and not depth:
        yield None
        return
    for layer in experts + depth:
        layer.recorded = []
    try:
        yield Routes([layer.recorded for layer in experts], rows, [router.recorded for router in depth])
    finally:
        for layer in experts + depth:
            layer.recorded = None


def collate_rollouts(rollouts: list[Rollout], width: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A micro-batch's rollouts' recorded routing: their MoE choices [B, W, L, k] (collate) and their
    Mixture-of-Depths decisions bool [B, W, M] (positions past a sequence's end: not processed); each None
    where generation recorded none (routing replay off, no such layers, a batch queued before decisions were)."""
    experts = collate([r.experts for r in rollouts], width) if rollouts[0].experts is not None else None
    if any(r.depth is None for r in rollouts):
        return experts, None
    depth = torch.zeros(len(rollouts), width, rollouts[0].depth.shape[0], dtype=torch.bool)
    for b, r in enumerate(rollouts):
        depth[b, : r.depth.shape[1]] = torch.from_numpy(r.depth).transpose(0, 1)
    return experts, depth


def collate(routes: list[np.ndarray], width: int) -> torch.Tensor:
    """Sequences' choices [L, n_b, k] as one micro-batch's [B, W, L, k] (long): positions past a
    sequence's end (padding, never a target) take experts 0 .. k-1."""
    L, _, k = routes[0].shape
    out = torch.arange(k).expand(len(routes), width, L, k).clone()
    for b, r in enumerate(routes):
        out[b, : r.shape[1]] = torch.from_numpy(r.astype(np.int64)).transpose(0, 1)
    return out


@contextmanager
def replaying(
    model: Transformer, experts: torch.Tensor | None, depth: bool = False, decided: torch.Tensor | None = None
) -> Iterator[None]:
    """Impose `experts` [B, W, L, k] on the MoE layers over a micro-batch's forward and backward
    (activation checkpointing routes again in the backward), and with `depth`, generation's
    routing on the Mixture-of-Depths layers: each token through a block or not as generation
    decided (`decided` [B, W, M], recorded), or without a record as the causal predictor decides,
    not by top-k at the training capacity; nothing when neither."""
    if depth and model.mod_layers():
        device = model.lm_head.weight.device
        for i, (_, router) in enumerate(model.mod_layers()):
            router.replay = True
            router.decided = None if decided is None else decided[:, :, i].to(device, non_blocking=True)
        try:
            with replaying(model, experts):
                yield
        finally:
            for _, router in model.mod_layers():
                router.replay, router.decided = False, None
        return
    if experts is None:
        yield
        return
    layers = [layer for _, layer in model.moe_layers()]
    B, W, L, k = experts.shape
    if L != len(layers):
        raise ValueError(f"routing replay: {L} layers recorded, the model has {len(layers)} MoE layers")
    device = model.lm_head.weight.device
    for i, layer in enumerate(layers):
        layer.replay = experts[:, :, i].reshape(B * W, k).to(device, non_blocking=True)
    try:
        yield
    finally:
        for layer in layers:
            layer.replay = None
