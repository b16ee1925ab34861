"""Merge methods on tensors, as mergekit defines them (arcee-ai/mergekit, merge_methods/ and
sparsify.py), so a mergekit recipe means the same here. Each function merges one tensor (one
unit: see merge/units.py) of every input.

    linear            sum_i w_i x_i, divided by sum_i w_i when normalize (Wortsman et al. 2022,
                      "Model soups")
    slerp             spherical interpolation from the base (t = 0) to the other model (t = 1)
                      along the great circle of their directions; lerp when nearly colinear
    task_arithmetic   base + lambda * sum_i w_i (x_i - base) (Ilharco et al. 2023)
    ties              task vectors trimmed to their top-density magnitudes, a sign elected per
                      entry by the sum, only agreeing entries mixed (Yadav et al. 2023)
    dare_linear/ties  task vectors with each entry kept with probability density, rescaled to
                      the l1 norm they had (mergekit's rescale; Yu et al. 2023 drop-and-rescale)
    model_stock       base + t (mean of the others - base), t = N cos / (1 + (N - 1) cos), cos the
                      mean pairwise cosine of the task vectors (Jang et al. 2024, eq. 6)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def linear(tensors: list[Tensor], weights: list[float], normalize: bool) -> Tensor:
    stacked = torch.stack([t.float() for t in tensors])
    w = torch.tensor(weights).view(-1, *[1] * (stacked.dim() - 1))
    out = (w * stacked).sum(0)
    return out / w.sum(0) if normalize else out


def slerp(t: float, v0: Tensor, v1: Tensor, dot_threshold: float = 0.9995, eps: float = 1e-8) -> Tensor:
    a, b = v0.double(), v1.double()
    na, nb = a.norm(), b.norm()
    dot = ((a / na if na > eps else a) * (b / nb if nb > eps else b)).sum()
    if dot.abs() > dot_threshold:  # nearly colinear: the great circle is ill-defined
        return ((1 - t) * a + t * b).float()
    theta = math.acos(float(dot))
    s0 = math.sin(theta - theta * t) / math.sin(theta)
    s1 = math.sin(theta * t) / math.sin(theta)
    return (s0 * a + s1 * b).float()


def magnitude(delta: Tensor, density: float, rescale: bool) -> Tensor:
    """Keep the int(density * n) largest |entries|, at least one (mergekit sparsify.magnitude)."""
    if density >= 1:
        return delta
    k = max(1, int(density * delta.numel()))
    mask = torch.zeros(delta.numel())
    mask[delta.abs().flatten().argsort(descending=True)[:k]] = 1
    return _rescaled(delta, mask.view_as(delta), rescale)


def random_drop(delta: Tensor, density: float, rescale: bool, generator: torch.Generator) -> Tensor:
    """Keep each entry with probability density (mergekit sparsify.bernoulli)."""
    if density >= 1:
        return delta
    mask = torch.bernoulli(torch.full(delta.shape, density), generator=generator)
    return _rescaled(delta, mask, rescale)


def _rescaled(delta: Tensor, mask: Tensor, rescale: bool, eps: float = 1e-7) -> Tensor:
    """delta * mask, scaled back to delta's l1 norm when rescale (mergekit rescaled_masked_tensor)."""
    masked = delta * mask
    if not rescale:
        return masked
    before, after = delta.abs().sum(), masked.abs().sum()
    return masked if before < eps or after < eps else masked * (before / after)


def task_arithmetic(
    base: Tensor,
    deltas: list[Tensor],
    weights: list[float],
    *,
    consensus: bool,
    normalize: bool,
    lambda_: float,
) -> Tensor:
    """base + lambda * the weighted (sparsified) task vectors, mixed as mergekit's GTA: with sign
    consensus only entries agreeing with the elected sign count, and normalize divides by the
    weights that contributed (0 -> 1)."""
    stacked = torch.stack(deltas)
    w = torch.tensor(weights).view(-1, *[1] * base.dim())
    weighted = stacked * w
    if consensus:
        majority = torch.where(weighted.sum(0) >= 0, 1.0, -1.0)
        agree = (weighted.sign() == majority).float()
        mixed, divisor = (weighted * agree).sum(0), (w * agree).sum(0)
        divisor[divisor == 0] = 1
    else:
        mixed, divisor = weighted.sum(0), w.sum(0).expand_as(base).clone()
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        mixed = mixed / divisor
    return base.float() + lambda_ * mixed


def model_stock(base: Tensor, others: list[Tensor], filter_wise: bool) -> Tensor:
    """Model Stock: interpolate between the base and the others' mean by the ratio the mean
    pairwise angle of their task vectors gives (per row when filter_wise); where 1 + (N - 1) cos
    is 0 (opposed task vectors) the base, as mergekit keeps it."""
    shape = base.shape
    w0 = base.float().reshape(-1) if not filter_wise else base.float().reshape(-1, shape[-1])
    ws = [o.float().reshape(w0.shape) for o in others]
    offsets = [w - w0 for w in ws]
    cosines = []
    for i in range(len(offsets)):
        for j in range(i + 1, len(offsets)):
            norms = offsets[i].norm(dim=-1) * offsets[j].norm(dim=-1)
            cosines.append(((offsets[i] * offsets[j]).sum(-1) / norms.clamp(min=1e-6)).clamp(-1, 1))
    cos = torch.stack(cosines).mean(0).unsqueeze(-1)
    n = len(ws)
    denominator = 1 + (n - 1) * cos
    singular = denominator.abs() < 1e-6
    t = torch.where(singular, 0.0, n * cos / torch.where(singular, 1.0, denominator))
    return (t * (sum(ws) / n) + (1 - t) * w0).reshape(shape)
