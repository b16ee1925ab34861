"""Control: the narrow surface through which the orchestrator, or a person, changes a running job.

Every intervention is a request; the trainer applies the queue at one point of the loop (after the
step, before evaluation and checkpointing), so nothing changes in the middle of a step. The OOM
path applies its request at once, before it retries the same batch.

The knobs an intervention sets (LR multiplier, grad clip, weight decay, micro-batch budget) live in
TrainState and are checkpointed, so a resumed run keeps them; a rollback restores weights,
optimizer and data position but keeps the knobs, since they are the correction.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trimtab.checkpoint import find_checkpoint
from trimtab.errors import ConfigError, TrimtabError

if TYPE_CHECKING:
    from trimtab.training.trainer import Trainer

# action -> the parameters it takes
PARAMS: dict[str, tuple[str, ...]] = {
    "skip_step": (),
    "scale_lr": ("factor",),
    "set_lr": ("value",),
    "emergency_lr_reduction": ("factor",),
    "rollback": ("to", "skip_rows"),
    "adjust_batch_size": ("micro_batch_tokens",),
    "adjust_grad_clip": ("value",),
    "adjust_weight_decay": ("value",),
    "save_checkpoint": (),
    "stop": ("reason",),
    "skip_data": ("rows",),
    # Mixture-of-Experts (layer: a MoE layer's index; knobs without a layer apply to all)
    "add_expert": ("layer", "source"),
    "prune_expert": ("layer", "expert"),
    "reinit_expert": ("layer", "expert"),
    "reset_router": ("layer", "expert"),
    "adjust_capacity_factor": ("value", "layer"),
    "adjust_routing_temperature": ("value", "layer"),
    "adjust_balance_coefficient": ("value", "layer"),
    # Mixture-of-Depths: the target capacity of one layer, or of all
    "adjust_mod_capacity": ("value", "layer"),
    # the run length (the live planner's shorten / extend; docs/planner.md)
    "set_total_steps": ("steps",),
}
MOE_KNOBS = ("adjust_capacity_factor", "adjust_routing_temperature", "adjust_balance_coefficient")
ACTIONS = tuple(PARAMS)


class Control:
    def __init__(self, trainer: Trainer):
        self._trainer = trainer
        self._queue: list[tuple[str, dict[str, Any]]] = []
        self.skip_next = False  # read by the next step's update gate

    # ------------------------------------------------------------------ views

    @property
    def step(self) -> int:
        return self._trainer.state.step

    @property
    def lr_scale(self) -> float:
        return self._trainer.state.lr_scale

    @property
    def scheduled_lr(self) -> float:
        """The schedule's LR for the next step, before the multiplier."""
        return self._trainer.scheduled_lr()

    @property
    def micro_batch_tokens(self) -> int:
        return self._trainer.loader.micro_batch_tokens

    @property
    def batch_tokens(self) -> int:
        return self._trainer.loader.batch_tokens

    @property
    def min_micro_batch_tokens(self) -> int:
        """One full row: a smaller budget cannot split a step any further."""
        return self._trainer.phases[self._trainer.state.phase].data.seq_len

    @property
    def rollbacks(self) -> int:
        return self._trainer.state.rollbacks

    @property
    def has_good_checkpoint(self) -> bool:
        """Whether a verified checkpoint marked good exists (reads the files: ask only when needed)."""
        return find_checkpoint(self._trainer.cfg.run_dir, "last_good") is not None

    @property
    def run_dir(self) -> Path:
        return self._trainer.cfg.run_dir

    def probe_loss(self) -> float | None:
        """The model's loss on one held-out micro-batch, now (a host read): tells a broken model
        from bad training data. None without held-out data."""
        micro = self._trainer.phases[self._trainer.state.phase].eval_micro
        return self._trainer.held_out_loss(micro[:1]) if micro else None

    def moe_knobs(self, layer: int) -> dict[str, float]:
        """A MoE layer's live settings: n_experts, top_k, capacity_factor, temperature, aux_loss_coef."""
        moe = dict(self._trainer.model.moe_layers())[layer]
        return {k: getattr(moe, k) for k in ("n_experts", "top_k", "capacity_factor", "temperature", "aux_loss_coef")}

    def mod_capacities(self) -> dict[int, tuple[float, float]]:
        """Each Mixture-of-Depths layer's (current capacity, target): they differ during warm-up."""
        return {i: (r.capacity, r.target) for i, r in self._trainer.model.mod_layers()}

    @property
    def progress(self) -> float:
        return self._trainer.state.step / max(self._trainer.total_steps, 1)

    # ------------------------------------------------------------------ requests

    def request(self, action: str, on_done: Callable[[str], None] | None = None, **params: Any) -> None:
        """Queue `action` (one of ACTIONS) with its parameters: checked now, applied by apply(),
        which reports what changed to `on_done`."""
        if action not in ACTIONS:
            raise ConfigError(f"unknown action '{action}'; one of {', '.join(ACTIONS)}")
        _check_params(action, params)
        if action == "skip_step":
            self.skip_next = True
            if on_done:
                on_done("the next update will be withheld")
            return
        self._queue.append((action, params, on_done))

    def apply(self) -> list[str]:
        """Apply the queued requests in order; returns one line per change made."""
        done = []
        while self._queue:
            action, params, on_done = self._queue.pop(0)
            try:
                line = getattr(self, f"_{action}")(**params)
            except TrimtabError as exc:  # e.g. no checkpoint to roll back to: say so, go on
                line = f"failed: {exc}"
            done.append(line)
            if on_done:
                on_done(line)
        return done

    # ------------------------------------------------------------------ effects

    def _scale_lr(self, factor: float) -> str:
        state = self._trainer.state
        old = state.lr_scale
        state.lr_scale = old * factor
        return f"lr multiplier {old:.3g} -> {state.lr_scale:.3g}"

    def _set_lr(self, value: float) -> str:
        # The schedule keeps its shape from the new level: the multiplier is value / scheduled.
        return self._scale_lr(value / (self.scheduled_lr * self.lr_scale))

    def _emergency_lr_reduction(self, factor: float = 0.1) -> str:
        return self._scale_lr(factor)

    def _rollback(self, to: str | int = "last_good", skip_rows: list[int] = ()) -> str:
        done = self._trainer.rollback(to)
        if skip_rows:
            done += f"; {self._trainer.loader.skip_rows(list(skip_rows))} rows left out of training"
        return done

    def _adjust_batch_size(self, micro_batch_tokens: int) -> str:
        return self._trainer.set_micro_batch_tokens(int(micro_batch_tokens))

    def _adjust_grad_clip(self, value: float) -> str:
        old, self._trainer.state.grad_clip = self._trainer.grad_clip(), float(value)
        return f"grad clip {old:g} -> {value:g}"

    def _adjust_weight_decay(self, value: float) -> str:
        return self._trainer.set_weight_decay(float(value))

    def _add_expert(self, layer: int, source: int | None = None) -> str:
        return self._trainer.expert_surgery("add", layer, source)

    def _prune_expert(self, layer: int, expert: int) -> str:
        return self._trainer.expert_surgery("prune", layer, expert)

    def _reinit_expert(self, layer: int, expert: int) -> str:
        return self._trainer.expert_surgery("reinit", layer, expert)

    def _reset_router(self, layer: int, expert: int) -> str:
        """Re-centre a collapsed expert's router row and selection bias (MoE.reset_router), in
        place, and zero that row's AdamW moments: built while the layer was collapsed, they would
        push the row on as before."""
        moe = dict(self._trainer.model.moe_layers()).get(layer)
        if moe is None or not 0 <= expert < moe.n_experts:
            raise ConfigError(f"reset_router: no expert {expert} in a MoE layer {layer}")
        if self._trainer.dist.world > 1:  # FSDP2 shards the router; the noise must match on every rank
            raise ConfigError("reset_router is not supported under data parallelism yet; run it in one process")
        before = float(moe.expert_bias[expert])
        moe.reset_router(expert)
        state = self._trainer.optimizer.state.get(moe.router, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key][expert].zero_()
        after = float(moe.expert_bias[expert])
        return f"layer {layer}: router reset for expert {expert} (bias {before:.3g} -> {after:.3g})"

    def _set_knob(self, layers: list[tuple[int, Any]], kind: str, knob: str, value: float, layer: int | None) -> str:
        """Set `knob` on `layer` of `layers` (index, module), or on all of them when None."""
        chosen = [m for i, m in layers if layer is None or i == layer]
        if not chosen:
            raise ConfigError(f"no {kind} layer {'' if layer is None else layer} in this model")
        old = getattr(chosen[0], knob)
        for module in chosen:
            setattr(module, knob, float(value))
        return f"{old:g} -> {value:g} ({f'all {kind} layers' if layer is None else f'layer {layer}'})"

    def _adjust_moe(self, knob: str, value: float, layer: int | None) -> str:
        return f"{knob} {self._set_knob(self._trainer.model.moe_layers(), 'MoE', knob, value, layer)}"

    def _adjust_capacity_factor(self, value: float, layer: int | None = None) -> str:
        return self._adjust_moe("capacity_factor", value, layer)

    def _adjust_routing_temperature(self, value: float, layer: int | None = None) -> str:
        return self._adjust_moe("temperature", value, layer)

    def _adjust_balance_coefficient(self, value: float, layer: int | None = None) -> str:
        return self._adjust_moe("aux_loss_coef", value, layer)

    def _adjust_mod_capacity(self, value: float, layer: int | None = None) -> str:
        layers = self._trainer.model.mod_layers()
        line = self._set_knob(layers, "MoD", "target", value, layer)
        for _, router in layers:  # the current capacity follows the new target (or its warm-up)
            router.set_step(self._trainer.state.step)
        return f"MoD capacity {line}"

    def _set_total_steps(self, steps: int) -> str:
        return self._trainer.set_total_steps(int(steps))

    def _skip_data(self, rows: list[int]) -> str:
        return f"{self._trainer.loader.skip_rows(list(rows))} rows left out of training"

    def _save_checkpoint(self) -> str:
        self._trainer.save()
        return f"checkpoint at step {self._trainer.state.step}"

    def _stop(self, reason: str = "stop requested") -> str:
        self._trainer.request_stop(reason)
        return f"stopping: {reason}"


def _check_params(action: str, params: dict[str, Any]) -> None:
    """Bad parameters fail when asked, not later inside the loop."""
    unknown = set(params) - set(PARAMS[action])
    if unknown:
        raise ConfigError(
            f"{action}: unknown parameter(s) {', '.join(sorted(unknown))}; "
            f"it takes {', '.join(PARAMS[action]) or 'none'}"
        )

    def number(name: str, low: float, high: float = float("inf")) -> None:
        value = params.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
            raise ConfigError(f"{action}: '{name}' must be a number in ({low:g}, {high:g}), got {value!r}")

    if action == "scale_lr":
        number("factor", 0)
    elif action == "set_lr":
        number("value", 0)
    elif action == "emergency_lr_reduction":
        params.setdefault("factor", 0.1)
        number("factor", 0, 1)  # always a reduction
    elif action == "adjust_batch_size":
        number("micro_batch_tokens", 0)
        if params["micro_batch_tokens"] != int(params["micro_batch_tokens"]):
            raise ConfigError("adjust_batch_size: 'micro_batch_tokens' must be a whole number of tokens")
    elif action in ("adjust_grad_clip", "adjust_weight_decay"):
        params["value"] = params.get("value", -1)
        number("value", -1e-12)
    elif action in MOE_KNOBS:
        number("value", -1e-12)
    elif action == "set_total_steps":
        number("steps", 0)
        if params["steps"] != int(params["steps"]):
            raise ConfigError("set_total_steps: 'steps' must be a whole number of steps")
    elif action == "adjust_mod_capacity":
        number("value", 0, 1 + 1e-12)
    elif action in ("add_expert", "prune_expert", "reinit_expert", "reset_router"):
        for name in ("layer", "expert" if action != "add_expert" else "source"):
            value = params.get(name)
            if (value is not None or name != "source") and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0
            ):
                raise ConfigError(f"{action}: '{name}' must be a whole number >= 0, got {value!r}")
    elif action == "rollback":
        to = params.get("to", "last_good")
        if to != "last_good" and not (isinstance(to, int) and to >= 0):
            raise ConfigError(f"rollback: 'to' must be 'last_good' or a step number, got {to!r}")
