"""The figures the trainer reports: each log line's metrics and the summary a session ends with."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from trimtab.peaks import beaten_peak
from trimtab.training.runtime import mod_metrics, moe_metrics, peak_rss_mb, read_scalars
from trimtab.training.services.signals import stop_exit

if TYPE_CHECKING:
    from trimtab.training.trainer import Trainer


def step_metrics(trainer: Trainer, lr: float) -> dict[str, Any]:
    """The log line's figures over the steps since the last one (the trainer then starts a new window)."""
    losses, norms, skipped = trainer.window.read()
    tps = trainer.window.tokens / max(trainer.window.seconds, 1e-9)
    # the window's means over its finite steps: one NaN step (skipped by the orchestrator) made the
    # whole window read "loss nan" while the steps around it trained finite; said apart instead
    finite = [(loss, norm) for loss, norm in zip(losses, norms) if math.isfinite(loss) and math.isfinite(norm)]
    metrics = {
        "step": trainer.state.step,
        "phase": trainer.phases[trainer.state.phase].name,
        "loss": sum(loss for loss, _ in finite) / len(finite) if finite else math.nan,
        "grad_norm": sum(norm for _, norm in finite) / len(finite) if finite else math.nan,
        "grad_norm_max": max((norm for _, norm in finite), default=math.nan),
        "lr": lr,
        "lr_scale": trainer.state.lr_scale,
        # the schedule's own LR: lr / lr_scale is not it when something else moved the LR (lr_spike)
        "lr_scheduled": trainer.last_step_out.scheduled_lr,
        "skipped_steps": skipped,
        "micro_batch_tokens": trainer.loader.micro_batch_tokens,
        "tokens": trainer.state.tokens,
        "tokens_per_s": tps,
        "step_time": trainer.window.seconds / len(losses),
        "epoch": trainer.loader.epoch,
        "peak_rss_mb": peak_rss_mb(),
        **trainer.loader.metrics(),  # a mixture's share of each source so far; an RL step's figures
    }
    if len(finite) < len(losses):
        metrics["nonfinite_steps"] = len(losses) - len(finite)  # their loss or gradient norm NaN or inf
    metrics.update(gain_metrics(trainer.window.gains))
    if trainer.cfg.rl.enabled:
        metrics["rl/temperature"] = trainer.rl_temperature  # rule rl_signal's knob
        metrics["rl/entropy_coef"] = trainer.rl_entropy_coef  # rule rl_entropy's
        if (timeout := getattr(trainer.loader, "verifier_timeout_s", None)) is not None:
            metrics["rl/verifier_timeout_s"] = timeout  # rule rl_verifier's knob
            metrics["rl/overlong_filter"] = float(trainer.loader.overlong_filter)  # rule rl_length's
            metrics["rl/overlong_buffer"] = trainer.loader.overlong_buffer
    if trainer.scaler is not None:  # fp16's loss scale (train.loss_scale)
        metrics["loss_scale"] = trainer.scaler.get_scale()
    if trainer.peak_flops:
        metrics["mfu"] = mfu(trainer, tps)
    out = trainer.last_step_out
    if out.aux_loss is not None:
        metrics["aux_loss"] = out.aux_loss.item()
    if out.moe is not None:
        metrics.update(moe_metrics(out.moe))
    if out.mod is not None:
        metrics.update(mod_metrics(out.mod))
    if trainer.device.type == "cuda":
        metrics["cuda_max_alloc_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return metrics


def gain_metrics(gains: list) -> dict[str, float]:
    """The window's update gains (training/gain.py; measured where a rule asks for them: above_start over a
    phase's first 15 steps) as the log line's `update_gain` (their mean, as `loss` is) and `update_gain_min`
    (the worst: one overshooting update, under 0, among sound ones); none where no step was measured, or only
    withheld updates (their gain inf or NaN: nothing was predicted)."""
    finite = [g for g in read_scalars(gains) if math.isfinite(g)] if gains else []
    if not finite:
        return {}
    return {"update_gain": sum(finite) / len(finite), "update_gain_min": min(finite)}


def run_summary(trainer: Trainer, step0: int, tokens0: int, train_seconds0: float, wall0: float) -> dict[str, Any]:
    """This session's figures: tokens/s over its steps, seconds including eval and saving. Its steps
    are those it trained, a rollback's included: the state counts only those it kept."""
    done = trainer.state.step >= trainer.total_steps and not trainer.exit_code  # a stop at the end that gave up
    rewound = trainer.control.rewound
    tokens = trainer.state.tokens - tokens0 + rewound.tokens
    tps = tokens / max(trainer.state.train_seconds - train_seconds0 + rewound.seconds, 1e-9)
    summary = {
        "status": "completed" if done else f"{'gave up' if trainer.exit_code else 'stopped'} ({trainer.stop_reason})",
        "exit_code": 0 if done else trainer.exit_code or stop_exit(trainer.stop_reason),
        "run_dir": str(trainer.cfg.run_dir),
        "step": trainer.state.step,
        "total_steps": trainer.total_steps,
        "tokens": trainer.state.tokens,
        "steps_this_session": trainer.state.step - step0 + rewound.steps,
        # of those: trained again after a rollback (a restart's: orchestrator/restarts.py adds them)
        "steps_replayed": rewound.replayed(trainer.state.step),
        "seconds": time.perf_counter() - wall0,
        "tokens_per_s": tps,
        "params": trainer.sizes["params"],
        "non_embedding_params": trainer.sizes["non_embedding_params"],
        "active_params": trainer.sizes["active_params"],
        "device": str(trainer.device),
        "precision": trainer.precision.name,
        "precision_reason": trainer.precision.reason,
        "val_loss": trainer.last_eval.get("val_loss"),
        "val_ppl": trainer.last_eval.get("val_ppl"),
        "skipped_records": sum(p.skipped_records for p in trainer.phases),
        "compile": trainer.step_times.summary(trainer.compile),
        # an RL run's held-out rewards, a DPO run's held-out pairs
        **{k: v for k, v in trainer.last_eval.items() if k.startswith(("rl/", "dpo/"))},
    }
    if trainer.weights_kept is not None:  # the disk rule's stop kept the weights alone (checkpointing.py _keep_weights)
        summary["weights_kept"] = trainer.weights_kept
    if trainer.peak_flops:
        summary["mfu"] = mfu(trainer, tps)
        summary["peak_flops_source"] = trainer.peak_source
    return summary


def mfu(trainer: Trainer, tokens_per_s: float) -> float:
    """The share of each device's peak the run's model FLOPs use, at most 1. The tokens are every
    rank's, the peak one device's. A rate above the peak means the peak was wrong: a CPU's cached
    one was measured on a busy machine and is raised to the run's (peaks.beaten_peak)."""
    achieved = tokens_per_s * trainer.flops_per_token / trainer.dist.world
    if achieved > trainer.peak_flops:
        trainer.peak_flops, trainer.peak_source = beaten_peak(
            trainer.precision, achieved, trainer.peak_flops, trainer.peak_source
        )
    return min(1.0, achieved / trainer.peak_flops)
