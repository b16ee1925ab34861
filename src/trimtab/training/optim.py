"""AdamW with decay / no-decay groups, and learning-rate schedules as pure functions of the step.

A schedule never holds state: `lr_at(step, total, cfg)` is the whole truth, so resume is exact
from the step counter alone and a person can plot any schedule ahead of time.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from trimtab.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay; embeddings, norms and biases do not (decaying an embedding pulls rare
    tokens' rows to zero; decaying norm gains fights the normalisation)."""
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 and id(p) not in embed_ids else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    # The fused kernel is one launch for all parameters (CUDA, and CPU since torch 2.4).
    fused = cfg.fused == "true" or (cfg.fused == "auto" and device.type in ("cuda", "cpu"))
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused
    )


CYCLIC = ("triangular", "triangular2", "exp_range")  # Smith 2017: between lr x min_lr_ratio and lr


def lr_at(
    step: int, total: int, cfg: OptimConfig, warm_from: float = 0.0, warmup: int | None = None, behind: int = 0
) -> float:
    """Learning rate for optimizer step `step` (0-based) of a schedule `total` steps long; the
    warm-up rises linearly from `warm_from` (0: a fresh run; an extended run's final LR when it
    re-warms, training/schedule.py) to cfg.lr over `warmup` steps (None: cfg.warmup_steps).

    The warm-up counts updates applied, not steps: `behind` updates withheld during it (the update
    gate, fp16's overflow) hold it back as many steps, as Megatron-LM steps its scheduler only after
    a successful update. Counted in steps, the updates applied after them met LRs ahead of them:
    debug, 40 steps, updates 3-4 withheld, val_loss 0.05-0.30 higher (mean 0.15) than held back, in
    each of 6 paired seeds (docs/orchestrator.md). Past its end the schedule is the step's (the
    warm-up's last updates meet it: the lower of the two)."""
    warm = warmup_length(total, cfg, warmup)
    low, top = cfg.lr * cfg.min_lr_ratio, warmup_top(cfg)
    applied = max(step - behind, 0)
    if applied < warm:  # linear warmup to its top: (top - warm_from) / warm per update applied
        ramp = warm_from + (top - warm_from) * (applied + 1) / warm
        return ramp if step < warm else min(ramp, _after_warmup(step, warm, total, low, cfg))
    return _after_warmup(step, warm, total, low, cfg)


def warmup_top(cfg: OptimConfig) -> float:
    """The LR a warm-up rises to. A cyclic schedule's ends where its first cycle starts, at the cycle's
    low end: warmed to lr, it fell 10x (min_lr_ratio 0.1) in one step after the warm-up, then climbed back."""
    return cfg.lr * cfg.min_lr_ratio if cfg.schedule in CYCLIC else cfg.lr


def warmup_length(total: int, cfg: OptimConfig, warmup: int | None = None) -> int:
    """The warm-up's steps of a schedule `total` steps long (lr_at): never the whole of it."""
    return min(cfg.warmup_steps if warmup is None else warmup, max(total - 1, 0))


def _after_warmup(step: int, warm: int, total: int, low: float, cfg: OptimConfig) -> float:
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule in CYCLIC:
        return _cyclic(step - warm, low, cfg)
    span = max(total - warm, 1)
    progress = min((step - warm) / span, 1.0)
    if cfg.schedule == "cosine":  # Loshchilov & Hutter 2017 (SGDR), single cycle
        return low + 0.5 * (cfg.lr - low) * (1 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - low) * progress
    # wsd: warmup-stable-decay (Hu et al. 2024, MiniCPM): flat, then linear decay over the tail.
    decay_start = 1.0 - cfg.decay_fraction
    if progress <= decay_start:
        return cfg.lr
    return cfg.lr - (cfg.lr - low) * (progress - decay_start) / cfg.decay_fraction


def _cyclic(step: int, low: float, cfg: OptimConfig) -> float:
    """Cyclical LR (Smith 2017): triangle between low and lr, half-period cycle_steps."""
    cycle = step // (2 * cfg.cycle_steps)
    x = abs(step / cfg.cycle_steps - 2 * cycle - 1)  # 1 at the cycle edges, 0 at the peak
    amplitude = (cfg.lr - low) * max(0.0, 1 - x)
    if cfg.schedule == "triangular2":
        amplitude /= 2**cycle
    elif cfg.schedule == "exp_range":
        amplitude *= cfg.gamma**step
    return low + amplitude


def optimizer_moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's per-parameter state tensors (AdamW's exp_avg, exp_avg_sq): what a finiteness check
    covers beside the weights. The 0-d step counts are left out: on the host beside moments on the device,
    and never NaN."""
    return [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim]


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """What the training state holds that a finiteness check covers, by part as a refusal names it: the
    weights, the floating buffers (MoE expert_bias), the optimizer's moments (a NaN moment resumed poisons
    the next update). The one list of the save's, the snapshot's and RunView.weights_finite's checks."""
    return {
        "the weights": list(model.parameters()),
        "the buffers": [b for b in model.buffers() if b.is_floating_point()],
        "the optimizer's moments": optimizer_moments(optimizer),
    }


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def carry_state(
    old: torch.optim.Optimizer,
    new: torch.optim.Optimizer,
    replaced: dict[int, tuple[torch.nn.Parameter, list[int | None]]],
) -> None:
    """Move AdamW state from `old` to `new` after parameters were replaced (expert surgery).

    `replaced` maps id(old parameter) -> (its new parameter, rows): row i of the new tensor (dim 0)
    continues old row rows[i], or starts from zero moments where rows[i] is None. Parameters that
    were not replaced keep their state as is; every state shares the old step count, so bias
    correction stays consistent (Adam's step is per parameter but the same for all here).
    """
    new_of = {id(new_p): (old_id, rows) for old_id, (new_p, rows) in replaced.items()}
    old_params = {id(p): p for group in old.param_groups for p in group["params"]}
    for group in new.param_groups:
        for p in group["params"]:
            if id(p) in new_of:
                old_id, rows = new_of[id(p)]
                source = old.state.get(old_params.get(old_id))
                if source:
                    new.state[p] = {k: _take_rows(v, rows) if v.ndim else v.clone() for k, v in source.items()}
            elif id(p) in old_params and old_params[id(p)] in old.state:
                new.state[p] = old.state[old_params[id(p)]]


def _take_rows(tensor: torch.Tensor, rows: list[int | None]) -> torch.Tensor:
    out = tensor.new_zeros((len(rows), *tensor.shape[1:]))
    for i, r in enumerate(rows):
        if r is not None:
            out[i] = tensor[r]
    return out
