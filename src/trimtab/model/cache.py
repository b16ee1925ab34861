"""Preallocated key/value cache for incremental decoding.

Shape legend: B batch, K kv heads, L max cached length, T new tokens, E head dim.

A Mixture-of-Depths layer writes keys only for the tokens it processes; `keep` says which. A batch
of prompts of different lengths is left-padded (`pad`): `valid` marks the positions that hold a
real token, and no real token attends to the others. RoPE scores depend only on the distance
between two positions, so a left-padded row attends exactly as the same row alone would.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer K/V tensors [B, K, L, E], filled left to right.

    `pos` is the number of positions already cached; the model writes the new tokens' keys and
    values at [pos, pos + T) in every layer and then calls `advance(T)` once per forward.
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.keep: list[torch.Tensor | None] = [None] * n_layers  # [B, L] per Mixture-of-Depths layer
        self.valid: torch.Tensor | None = None  # [B, L] bool: False at a left pad (None: no pads)
        self.max_len = max_len
        self.pos = 0

    def pad(self, pads: list[int]) -> None:
        """Row b begins with pads[b] positions of padding (before any token is cached)."""
        device = self.k[0].device
        self.valid = torch.arange(self.max_len, device=device) >= torch.tensor(pads, device=device)[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, K, T, E] at the current offset; return all cached K/V [B, K, pos+T, E]."""
        end = self.pos + k.shape[2]
        self.k[layer][:, :, self.pos : end] = k
        self.v[layer][:, :, self.pos : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def mark(self, layer: int, keep: torch.Tensor) -> torch.Tensor:
        """Record which of the T new positions have keys in `layer` (keep [B, T] bool: a
        Mixture-of-Depths layer skips the rest); return the mask of all positions [B, pos+T]."""
        if self.keep[layer] is None:
            ones = torch.ones(keep.shape[0], self.max_len, dtype=torch.bool, device=keep.device)
            self.keep[layer] = ones if self.valid is None else self.valid.clone()
        end = self.pos + keep.shape[1]
        # a left pad the predictor chose is no key either: it was, and a left-padded row's real tokens attended
        # to its padding (debug-mod trained 150 steps, 4 prompts of 3-20 tokens: log-probabilities 0.48 off the
        # row's own, greedy tokens other than alone; RL's importance ratios off by as much)
        self.keep[layer][:, self.pos : end] = keep if self.valid is None else keep & self.valid[:, self.pos : end]
        return self.keep[layer][:, :end]

    def advance(self, n: int) -> None:
        self.pos += n

    def reset(self) -> None:
        self.pos = 0
