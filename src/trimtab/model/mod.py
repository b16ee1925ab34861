"""Mixture-of-Depths routing around a block (Raposo et al. 2024, arXiv 2404.02258).

Shape legend: B batch, T time, S key length (cached + new), D d_model, k tokens processed per
sequence (ceil(capacity * T)).

A block is x -> x + f(x) (f: attention then feed-forward). A MoD block lets only some tokens
through f; the rest ride the residual unchanged, so their attention, feed-forward, keys and
values cost nothing:

    training   a linear router scores each token; the top-k per sequence (k = ceil(capacity *
               T)) are gathered in causal order, run through f as a shorter sequence (each keeps
               its rotary position), and scattered back as x + sigmoid(score) * f(x). The
               sigmoid gate puts the router on the loss's gradient path (the paper multiplies by
               the raw score; the sigmoid keeps the sign and scale of f bounded).
    inference  top-k over the sequence is not causal: whether token t is chosen depends on
               the scores of later tokens. A small predictor (an MLP on the detached block
               input, paper section 3.5, "auxiliary MLP predictor") is trained with BCE to guess
               top-k membership, and decides alone at eval and generation time: token t is
               processed iff predictor(x_t) > 0. That decision uses x_t only, so prefill, cached
               decoding and a full eval forward agree token for token.

Keys and values exist only for processed tokens. In inference all T tokens go through f with an
attention mask that hides skipped keys (a skipped query sees itself, so no row is empty, and its
output is discarded); the KV cache keeps a per-layer `keep` mask over positions. When no token
in the forward is processed (the common case of a skipped decode step), f is not run at all.

Capacity is a plain attribute, per layer: `target` (config or the orchestrator) and `capacity`
(the current value, warmed up linearly from 1.0 to the target over warmup_steps by set_step).
Under torch.compile the warm-up's chosen tokens are masked, not gathered (`_warming`): k changes
every step, and a gathered [B, k] was a new shape and a guard on the capacity's value each step,
a recompile each step (debug-mod: 49 s a step on 2 CPU cores). Eager keeps the gather, which
computes only the k tokens where the mask computes all T.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trimtab.model.cache import KVCache
from trimtab.model.layers import compute_dtype
from trimtab.model.recompute import in_recompute

# f(x, rope, mask, cache, layer) -> the block's residual update, same shape as x
Residual = Callable[[torch.Tensor, tuple, torch.Tensor | None, KVCache | None, int], torch.Tensor]


class DepthRouter(nn.Module):
    """Router [1, D] and causal predictor (D -> D/8 -> 1) of one MoD block.

    After each training forward: `aux_loss` (predictor_loss_coef * BCE, or None) and `stats`
    (0-d tensors on device: capacity, predictor accuracy, mean gate of the processed tokens)."""

    def __init__(self, d_model: int, capacity: float, warmup_steps: int, predictor_loss_coef: float):
        super().__init__()
        self.router = nn.Linear(d_model, 1, bias=False)
        hidden = max(8, d_model // 8)
        self.predictor = nn.Sequential(
            nn.Linear(d_model, hidden, bias=False), nn.SiLU(), nn.Linear(hidden, 1, bias=False)
        )
        self.target = float(capacity)
        self.warmup_steps = warmup_steps
        self.predictor_loss_coef = float(predictor_loss_coef)
        self.capacity = 1.0 if warmup_steps else self.target
        self.warming = self.capacity > self.target  # a bool, not the floats: one recompile when it flips
        self.aux_loss: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}
        # RL's routing replay (rl/replay.py): a training forward routes by the causal predictor, as
        # generation did, instead of by top-k at the capacity; by generation's own decisions where
        # recorded: `recorded` collects each generating forward's [B * T, 1], `decided` [B, T] imposes them
        self.replay = False
        self.recorded: list[torch.Tensor] | None = None
        self.decided: torch.Tensor | None = None

    def set_step(self, step: int) -> None:
        """Capacity at optimizer step `step`: linear from 1.0 down to `target` over warmup_steps."""
        left = max(0.0, 1.0 - step / self.warmup_steps) if self.warmup_steps else 0.0
        self.capacity = self.target + (1.0 - self.target) * left
        self.warming = self.capacity > self.target

    def tokens(self, T: int) -> int:
        """Tokens per sequence a training forward processes."""
        return max(1, min(T, math.ceil(self.capacity * T)))

    def forward(
        self,
        x: torch.Tensor,
        f: Residual,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None,
        layer: int,
        idle: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """x + the gated f(x) of the tokens routed through; `idle(tokens)` is told when f runs on none of them."""
        if self.training and cache is None and not self.replay:
            return self._top_k(x, f, rope, layer)
        return self._predicted(x, f, rope, cache, layer, idle)

    def _top_k(self, x: torch.Tensor, f: Residual, rope: tuple, layer: int) -> torch.Tensor:
        B, T, D = x.shape
        low = x.to(compute_dtype(x))  # cast once for the router and the predictor: each kept its own
        score = self.router(low).squeeze(-1).float()  # [B, T]
        if self.warming and torch.compiler.is_compiling():
            return self._warming(x, low, score, f, rope, layer)
        k = self.tokens(T)  # fixed once warmed up: a static shape
        if k == T:  # capacity 1 (warm-up start): every token, no gather
            self._record(low, score, torch.ones_like(score))
            return x + torch.sigmoid(score).unsqueeze(-1).to(x.dtype) * f(x, rope, None, None, layer)
        idx = score.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values  # [B, k], causal order
        chosen = torch.zeros_like(score).scatter_(1, idx, 1.0)
        self._record(low, score, chosen)
        cos, sin = rope  # [T, 1, E] -> [B, k, 1, E]: each token keeps its position
        rows = idx.unsqueeze(-1).expand(B, k, D)
        xs = x[torch.arange(B, device=x.device).unsqueeze(-1), idx]  # [B, k, D]: gather's backward would keep x
        gate = torch.sigmoid(score.gather(1, idx)).unsqueeze(-1).to(x.dtype)
        # Causal among the chosen: sorted by position, so is_causal on the short sequence is right.
        return x.scatter(1, rows, xs + gate * f(xs, (cos[idx], sin[idx]), None, None, layer))

    def _warming(
        self, x: torch.Tensor, low: torch.Tensor, score: torch.Tensor, f: Residual, rope: tuple, layer: int
    ) -> torch.Tensor:
        """_top_k at a capacity that changes every step, in static shapes for torch.compile: f runs
        on all T tokens and an attention mask keeps the same top-k, so the result is the gather's
        (a chosen query sees the chosen keys up to itself, at their own positions; the others'
        outputs are dropped). `capacity` is read only in tensor arithmetic, so torch.compile makes
        it a graph input after its first change instead of guarding on each value, as ceil() did."""
        B, T, _ = x.shape
        rank = score.argsort(dim=-1, descending=True).argsort(dim=-1)  # [B, T]: 0 = the highest score
        # an integer rank r < ceil(c T) iff r < c T; rank 0 always, as tokens() keeps at least one
        chosen = (rank < self.capacity * T) | (rank == 0)
        self._record(low, score, chosen.float())
        pos = torch.arange(T, device=x.device)
        visible = (pos <= pos[:, None]) & (chosen[:, None, :] | (pos == pos[:, None]))  # [B, T, T]
        update = torch.sigmoid(score).unsqueeze(-1).to(x.dtype) * f(x, rope, visible.unsqueeze(1), None, layer)
        return x + torch.where(chosen.unsqueeze(-1), update, torch.zeros((), dtype=update.dtype, device=x.device))

    def _predicted(
        self,
        x: torch.Tensor,
        f: Residual,
        rope: tuple,
        cache: KVCache | None,
        layer: int,
        idle: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        # [B, T]: from x_t alone, so causal; replayed, generation's: its x_t, decoded on the KV cache, rounds
        # otherwise than a whole sequence's, and a near-tie at 0 flips (rl/replay.py)
        chosen = self.predictor(x).squeeze(-1) > 0 if self.decided is None else self.decided
        if self.recorded is not None:
            self.recorded.append(chosen.reshape(-1, 1))
        offset = cache.pos if cache is not None else 0
        keep = cache.mark(layer, chosen) if cache is not None else chosen  # [B, S]
        # a full forward under torch.compile runs f anyway: bool() here would split the graph
        anything = (cache is None and torch.compiler.is_compiling()) or bool(chosen.any())
        score = self.router(x).squeeze(-1).float() if self.training or anything else None
        if self.training:  # replayed: no top-k for the predictor to learn; the share processed
            # set before the return below: a micro-batch that processes nothing would leave the last
            # forward's aux_loss (its graph freed by that step's backward) for the trainer to add
            self.aux_loss = None
            gate = (torch.sigmoid(score.detach()) * chosen).sum() / chosen.sum().clamp(min=1)
            share = chosen.float().mean()
            self.stats = {"capacity": share, "predictor_acc": torch.ones_like(share), "gate": gate}
        if not anything:  # nothing to process: no compute, no keys written
            if idle is not None:
                idle(B * T)
            return x
        q_pos = torch.arange(offset, offset + T, device=x.device)
        k_pos = torch.arange(offset + T, device=x.device)
        causal = k_pos <= q_pos[:, None]  # [T, S]
        visible = causal & (keep[:, None, :] | (k_pos == q_pos[:, None]))  # [B, T, S]
        update = torch.sigmoid(score).unsqueeze(-1).to(x.dtype) * f(x, rope, visible.unsqueeze(1), cache, layer)
        return x + torch.where(chosen.unsqueeze(-1), update, torch.zeros((), dtype=update.dtype, device=x.device))

    def _record(self, x: torch.Tensor, score: torch.Tensor, chosen: torch.Tensor) -> None:
        """The predictor's BCE on top-k membership (on the detached input: it must not steer the
        model, paper section 3.5), and stats; no host sync."""
        logits = self.predictor(x.detach()).squeeze(-1).float()
        bce = F.binary_cross_entropy_with_logits(logits, chosen)
        if in_recompute():  # computed again for what their backward saves; the forward's are kept
            return
        self.aux_loss = self.predictor_loss_coef * bce if self.predictor_loss_coef > 0 else None
        gate = (torch.sigmoid(score.detach()) * chosen).sum() / chosen.sum()
        self.stats = {
            "capacity": score.new_ones(()) * self.capacity,  # not new_tensor(): no guard on the float
            "predictor_acc": ((logits > 0) == (chosen > 0)).float().mean().detach(),
            "gate": gate,
        }
