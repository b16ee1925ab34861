"""Summed next-token cross entropy, computed in token chunks.

Shapes: N tokens, D d_model, V vocab, C chunk.

Logits for a whole micro-batch are one [N, V] fp32 tensor (128 MB at N=8192, V=4096); glibc
maps every allocation above 32 MB fresh from the kernel, and the page faults cost ~10% of a CPU
step. Chunks of C tokens keep each logits block small enough to be reused from the heap. The
result and its gradient are identical to the unchunked loss.

Under tensor parallelism `hidden` is a replicated DTensor and the head's rows are sharded over
the vocabulary (distributed/tensor.py): each rank computes its [C, V/tp] block of logits and the
cross entropy all-reduces the maxima, the sums of exponentials and the target logits instead of
gathering the logits (torch's loss_parallel; Megatron-LM's vocab-parallel cross entropy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
CHUNK_TOKENS = 1024


def cross_entropy_sum(
    hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, chunk: int = CHUNK_TOKENS
) -> torch.Tensor:
    """hidden [B, T, D], head weight [V, D], targets [B, T] (-100 ignored) -> summed loss (0-d, fp32)."""
    h, t = hidden.flatten(0, 1), targets.flatten()
    total = None
    for start in range(0, h.shape[0], chunk):
        logits = F.linear(h[start : start + chunk], head).float()  # [C, V] (sharded: [C, V/tp] per rank)
        part = F.cross_entropy(logits, t[start : start + chunk], ignore_index=IGNORE_INDEX, reduction="sum")
        total = part if total is None else total + part
    if total is None:
        return hidden.new_zeros((), dtype=torch.float32)
    to_local = getattr(total, "to_local", None)  # a DTensor under tensor parallelism
    return to_local() if to_local else total  # (the same value on every rank)
