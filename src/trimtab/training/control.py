"""Control: the one surface through which the orchestrator, a hook or a person changes a running job.

Every intervention is a request, checked against the action table (training/actions.py) when it
is made; the trainer, never a hook, applies the queue at its points of the loop: after the step's
hooks (before evaluation and checkpointing), after a phase's end check, after an evaluation, and
at once after an out-of-memory error (before it retries the same batch) or a failed save (before
the save returns), so nothing changes in the middle of a step. Hooks hold `Requests`
(run.control): request() alone.

EFFECTS, at the bottom, names each action's effect: checked against the action table when this
module is imported, so an action without an effect (or an effect without an action) fails at
once, not when it is first requested.

The knobs an intervention sets (LR multiplier, grad clip, weight decay, micro-batch budget, run
length) live in TrainState and are checkpointed, so a resumed run keeps them; a rollback restores
weights, optimizer and data position but keeps the knobs, since they are the correction (save the
RL knobs rule rl_reward names, `knobs`: turned by RL's rules on a falling policy, they are not). The
knobs' logic lives here: the trainer only calls apply_knobs() when it builds a new optimizer or
loader. Reinforcement learning's knobs and their effects are rl_control.py's (RLKnobs, a part of Control).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from trimtab.checkpoint import prune
from trimtab.data import BatchLoader
from trimtab.errors import ConfigError, TrimtabError
from trimtab.resilience.elastic import leave_job, node_count, node_rank
from trimtab.snapshots import drop_superseded
from trimtab.training import surgery
from trimtab.training.actions import ACTIONS, MOE_KNOBS, PUT_BACK, RL_ONLY, action
from trimtab.training.optim import build_optimizer
from trimtab.training.rl_control import RLKnobs
from trimtab.training.schedule import apply_lengths
from trimtab.training.setup import model_sizes
from trimtab.training.state import Rewound
from trimtab.words import counted

if TYPE_CHECKING:
    from trimtab.training.trainer import Trainer

Done = Callable[[str], None]
Applying = Callable[[str, bool], AbstractContextManager[None]]


class Requests:
    """What a hook holds of Control (`run.control`): request() and nothing else; the trainer
    applies the requests at its points of the loop."""

    __slots__ = ("_request",)

    def __init__(self, control: Control):
        object.__setattr__(self, "_request", control.request)

    def request(self, name: str, on_done: Done | None = None, **params: Any) -> None:
        """Queue action `name` with its parameters (Control.request): checked now (ConfigError);
        what it changed goes to `on_done` when the loop applies it ("failed: ..." when it could not)."""
        self._request(name, on_done, **params)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"run.control is read-only: request changes with run.control.request(...), not {name}=")


class Control(RLKnobs):
    def __init__(self, trainer: Trainer, applying: Applying | None = None):
        self._trainer = trainer
        # each effect runs in applying(name, mid_step): the trainer's emergency save's watch (training/emergency.py)
        self._applying = applying or (lambda name, mid_step: nullcontext())
        self._queue: list[tuple[str, dict[str, Any], Done | None]] = []
        self.skip_next = False  # read by the next step's update gate
        self.skip_by = ""  # who asked for it (skip_step's `by`): the step that withholds it says so (StepOutput)
        self.applied = 0  # actions applied so far: a monitor rebases when the run was changed
        self.rewound = Rewound()  # this session's work that rollbacks undid: the summary counts it

    # ------------------------------------------------------------------ requests

    def request(self, name: str, on_done: Done | None = None, **params: Any) -> None:
        """Queue action `name` with its parameters: checked now (ConfigError), applied by apply(),
        which reports what changed to `on_done` ("failed: ..." when it could not be done)."""
        params = action(name).check(params)
        if name in AT_ONCE:
            line = EFFECTS[name](self, **params)
            if on_done:
                on_done(line)
            return
        self._queue.append((name, params, on_done))

    def apply(self, mid_step: bool = False) -> list[str]:
        """Apply the queued requests in order; returns one line per change made. Each under the emergency
        save's watch (training/emergency.py applying): `mid_step`, an out-of-memory retry's, inside a step."""
        done = []
        while self._queue:
            name, params, on_done = self._queue.pop(0)
            try:
                if name in RL_ONLY and not self._trainer.cfg.rl.enabled:
                    raise ConfigError(f"{name}: a knob of reinforcement learning, which this run has not (trimtab rl)")
                with self._applying(name, mid_step):
                    line = EFFECTS[name](self, **params)
            except TrimtabError as exc:  # e.g. no checkpoint to roll back to: say so, go on
                line = f"failed: {exc}"
            done.append(line)
            self.applied += 1
            if on_done:
                on_done(line)
        return done

    # ------------------------------------------------------------------ the knobs

    def grad_clip(self) -> float:
        t = self._trainer
        return t.phases[t.state.phase].optim.grad_clip if t.state.grad_clip is None else t.state.grad_clip

    def apply_knobs(self) -> None:
        """Knobs that live in objects the trainer rebuilds (optimizer, loader), applied again."""
        t = self._trainer
        if t.state.micro_batch_tokens:
            t.loader.micro_batch_tokens = t.state.micro_batch_tokens
        if t.state.activation_checkpointing:
            t.model.set_activation_checkpointing(t.state.activation_checkpointing)
        if t.state.weight_decay is not None:
            t.optimizer.param_groups[0]["weight_decay"] = t.state.weight_decay  # the decay group
        self.apply_rl_knobs()

    def apply_lengths(self) -> None:
        t = self._trainer
        t.total_steps = apply_lengths(t.phases, t.state.phase_steps, t.state.length_delta)

    # ------------------------------------------------------------------ effects, one per action (EFFECTS)

    def _skip_step(self, by: str = "hook") -> str:
        self.skip_next, self.skip_by = True, by  # read by the next step's update gate
        return "the next update will be withheld"

    def _scale_lr(self, factor: float) -> str:
        state = self._trainer.state
        old = state.lr_scale
        state.lr_scale = old * factor
        return f"lr multiplier {old:.3g} -> {state.lr_scale:.3g}"

    def _set_lr(self, value: float) -> str:
        # The schedule keeps its shape from the new level: the multiplier is value / scheduled; in a
        # warm-up, value / the LR it rises to (schedule.set_lr_level), the value being the LR it reaches
        t = self._trainer
        level, scheduled = t.set_lr_level(), t.scheduled_lr()
        done = self._scale_lr(value / (level * t.state.lr_scale))
        if level != scheduled:
            done += f" (in the warm-up: it rises to {value:.3g}, {scheduled / level * value:.3g} now)"
        return done

    def _emergency_lr_reduction(self, factor: float) -> str:
        return self._scale_lr(factor)

    def _rollback(
        self,
        to: str | int,
        skip_rows: list[int] | None = None,
        lr_factor: float | None = None,
        knobs: list[list[Any]] | None = None,
    ) -> str:
        t = self._trainer
        if isinstance(to, int) and to > t.state.step:  # a typo (500 for 50) would restore the newest checkpoint
            raise ConfigError(f"rollback {to}: the run is at step {t.state.step}; name a step at or before it")
        before = replace(t.state)  # the restore replaces the state: the figures it undoes
        done = t.rollback(to)
        self.rewound.add(before, t.state)
        if isinstance(t.loader, BatchLoader):  # the restored step's budget, not one this session replaces
            t.loader.budget_before = None
        if skip_rows:
            done += f"; {self._skip_data(skip_rows)}"
        if lr_factor:  # the knobs survive the restore: the cut holds for the replayed steps
            done += f"; {self._scale_lr(lr_factor)}"
        if self.skip_next:  # asked for the next step of the branch undone: it withheld the replay's first, unjudged
            self.skip_next = False
            done += (
                f"; the skip-step asked with it is dropped (by {self.skip_by}: the step it was to withhold is not "
                "trained on this branch, and the replay's first is no step it judged; ask again if still wanted)"
            )
        return done + "".join(f"; {line}" for line in self._put_back(knobs or []) + self.keep_rl_difficulty())

    def _put_back(self, turns: list[list[Any]]) -> list[str]:
        """Knobs turned after the step restored, back to what its policy ran with. `turns`:
        [step, action, before, after] in the order made; each knob's walked back from its value now
        while each turn set the value the next found (one no turn set is a person's: it stays), to
        the value before the first turn after the restored step (one at that step is in its
        checkpoint: applied before the save). Here, not when it was decided: the turns queued
        before this rollback (a rule's at the same step) are applied by now."""
        t = self._trainer
        back = {}
        for name in dict.fromkeys(turn[1] for turn in turns):
            now = PUT_BACK[name](t.view)
            for step, knob, before, after in reversed(turns):
                if knob != name:
                    continue
                if after != now:
                    break
                now = before
                if step > t.state.step:
                    back[name] = before
        return [EFFECTS[name](self, before) for name, before in back.items() if before != PUT_BACK[name](t.view)]

    def _skip_data(self, rows: list[int]) -> str:
        added = self._trainer.loader.skip_rows(rows)
        already = len(set(rows)) - added
        return f"{counted(added, 'row')} left out of training" + (f" ({already} more already were)" if already else "")

    def _set_micro_batch_tokens(self, tokens: int) -> str:
        """Micro-batch budget; the step's rows (the optimization batch) stay the same."""
        t = self._trainer
        # Before a resumed run's first step the loader already holds this session's configured
        # budget: a person's edit of it replaces the one the checkpoint's steps ran with.
        old = t.loader.micro_batch_tokens
        if isinstance(t.loader, BatchLoader) and t.loader.budget_before:  # RL's and DPO's loaders keep none
            old, t.loader.budget_before = t.loader.budget_before, None  # a second change replaces this one
        tokens = max(min(tokens, t.loader.batch_tokens), t.phases[t.state.phase].data.seq_len)
        t.loader.micro_batch_tokens = t.state.micro_batch_tokens = tokens
        return f"micro-batch {old} -> {tokens} tokens"

    def _set_activation_checkpointing(self, mode: str) -> str:
        """What each block keeps for its backward (model/recompute.py); gradients stay the same."""
        t = self._trainer
        old = t.model.checkpointing
        t.model.set_activation_checkpointing(mode)
        t.state.activation_checkpointing = mode
        # a resumed run's model is built in the config's mode already (the decision's summary says
        # the mode it trained with): "full -> full" would read as nothing done
        return f"activation checkpointing {mode}" if old == mode else f"activation checkpointing {old} -> {mode}"

    def _set_grad_clip(self, value: float) -> str:
        old, self._trainer.state.grad_clip = self.grad_clip(), value
        return f"grad clip {old:g} -> {value:g}"

    def _set_weight_decay(self, value: float) -> str:
        old = self._trainer.optimizer.param_groups[0]["weight_decay"]
        self._trainer.state.weight_decay = value
        self.apply_knobs()
        return f"weight decay {old:g} -> {value:g}"

    def _save_checkpoint(self, keep: int | None = None) -> str:
        """Save now; with `keep`, first free space: all but the newest `keep` checkpoints and the
        essential ones (the last good, the best evaluation's, a reference policy's) are deleted. The line says
        what happened, a failed save included."""
        t = self._trainer
        t.finish_save()  # a checkpoint still being written is neither pruned nor written twice
        freed = "" if keep is None else self.free_room(keep)[1]
        if not t.save(wait=True):
            raise TrimtabError(f"{freed}the checkpoint at step {t.state.step} could not be written")
        return f"{freed}checkpoint at step {t.state.step}"

    def free_room(self, keep: int) -> tuple[int, str]:
        """The disk rule's freeing: all but the newest `keep` checkpoints and the essential ones deleted, and a
        stop's snapshot a good checkpoint superseded; how many checkpoints went, and the words for what did."""
        t = self._trainer
        gone = t.dist.from_main(prune, t.cfg.run_dir, keep, t.essential_checkpoints())
        freed = f"deleted {counted(len(gone), 'older checkpoint')}; " if gone else ""
        lean = t.cfg.checkpoint.snapshot_every
        if stale := t.dist.from_main(drop_superseded, t.cfg.run_dir, t.last_good, lean):  # a stop's, now superseded
            freed += f"deleted the superseded snapshot {', '.join(p.name for p in stale)}; "
        return len(gone), freed

    def _stop(self, reason: str, exit_code: int = 0) -> str:
        self._trainer.request_stop(reason, exit_code)
        return f"stopping: {reason}" + (f" (exit code {exit_code})" if exit_code else "")

    def _exclude_node(self, node: int) -> str:
        """Save, then end `node`'s part of an elastic job: its ranks leave (resilience/elastic.py)
        once every rank has the checkpoint; the others' next collective fails and torchrun's
        agents restart them on the nodes left, from this checkpoint."""
        t = self._trainer
        if node >= node_count():
            nodes = counted(node_count(), "node")
            raise TrimtabError(f"exclude_node: no node {node} in this job ({nodes} under torchrun)")
        if not t.save(wait=True):
            raise TrimtabError(f"the checkpoint at step {t.state.step} could not be written: node {node} stays")
        t.dist.from_main(lambda: None)  # every rank past the save before any leaves
        if node_rank() == node:
            t.watchdog.stop(exit_record=f"excluded at step {t.state.step} (exclude_node)")
            leave_job()
        return f"checkpoint at step {t.state.step}; node {node} leaves the job"

    def _set_checkpoint_every(self, steps: int) -> str:
        """Steps between checkpoints from now on (TrainState, so a resume keeps it)."""
        state = self._trainer.state
        old, state.checkpoint_every = self.checkpoint_every(), steps
        return f"checkpoint every {old} -> {counted(steps, 'step')}"

    def checkpoint_every(self) -> int:
        """Steps between checkpoints: the knob, else checkpoint.every (0: only at the end)."""
        t = self._trainer
        return t.state.checkpoint_every or t.cfg.checkpoint.every

    def _set_total_steps(self, steps: int, by: str | None = None) -> str:
        """The run's length, through the pretraining phase (the live planner's shorten / extend):
        its LR schedule is a function of the phase length, so it stretches or shrinks to the new
        end; a finetuning phase after it moves with it. `by`: "make_up", steps for withheld updates,
        counted apart (TrainState.made_up) so a resume's new train.max_steps keeps them."""
        t = self._trainer
        if t.state.phase != 0:
            raise ConfigError("the run length can only change during pretraining (phase 0)")
        old = t.total_steps
        if t.phases[0].steps + steps - old < max(t.state.step, 1):
            raise ConfigError(f"set_total_steps: {steps} would end pretraining before the current step {t.state.step}")
        t.state.length_delta += steps - old
        if by == "make_up":
            t.state.made_up += steps - old
        self.apply_lengths()
        return f"total steps {old} -> {t.total_steps}"

    # Mixture-of-Experts: surgery and knobs

    def _surgery(self, op: str, layer: int, expert: int | None) -> str:
        t = self._trainer
        moe = surgery.moe_layer(t.model, layer, t.dist.world, t.dist.mesh.ep, t.dist.mesh.tp, t.dist.mesh.pp)

        def rebuild():
            return build_optimizer(t.model, t.phases[t.state.phase].optim, t.device)

        t.optimizer, line = surgery.expert_surgery(moe, t.optimizer, rebuild, op, expert)
        self.apply_knobs()
        self.recount()
        return f"layer {layer}: {line}"

    def recount(self) -> None:
        """The run's sizes (summary.json's parameter counts, MFU's FLOPs per token) counted again after
        its experts changed: surgery, or a checkpoint loaded with other counts than the model held."""
        t = self._trainer
        t.sizes = model_sizes(t.model, t.cfg.data.seq_len)  # a whole model (Checkpointing._load)
        t.flops_per_token = t.sizes["flops_per_token"]

    def _add_expert(self, layer: int, source: int | None = None) -> str:
        return self._surgery("add", layer, source)

    def _prune_expert(self, layer: int, expert: int) -> str:
        return self._surgery("prune", layer, expert)

    def _reinit_expert(self, layer: int, expert: int) -> str:
        return self._surgery("reinit", layer, expert)

    def _reset_router(self, layer: int, expert: int) -> str:
        t = self._trainer
        moe = surgery.moe_layer(t.model, layer, t.dist.world, t.dist.mesh.ep, t.dist.mesh.tp, t.dist.mesh.pp)
        return f"layer {layer}: {surgery.reset_router(moe, t.optimizer, expert)}"

    def _set_knob(self, layers: list[tuple[int, Any]], kind: str, knob: str, value: float, layer: int | None) -> str:
        """Set `knob` on `layer` of `layers` (index, module), or on all of them when None."""
        chosen = [m for i, m in layers if layer is None or i == layer]
        if not chosen:
            raise ConfigError(f"no {kind} layer{'' if layer is None else f' {layer}'} in this model")
        old = getattr(chosen[0], knob)
        for module in chosen:
            setattr(module, knob, float(value))
        return f"{knob} {old:g} -> {value:g} ({f'all {kind} layers' if layer is None else f'layer {layer}'})"

    def _moe_knob(self, name: str, value: float, layer: int | None) -> str:
        return self._set_knob(self._trainer.model.moe_layers(), "MoE", MOE_KNOBS[name], value, layer)

    def _set_capacity_factor(self, value: float, layer: int | None = None) -> str:
        return self._moe_knob("set_capacity_factor", value, layer)

    def _set_router_temperature(self, value: float, layer: int | None = None) -> str:
        return self._moe_knob("set_router_temperature", value, layer)

    def _set_balance_coef(self, value: float, layer: int | None = None) -> str:
        return self._moe_knob("set_balance_coef", value, layer)

    def _set_mod_capacity(self, value: float, layer: int | None = None) -> str:
        layers = self._trainer.model.mod_layers()
        line = self._set_knob(layers, "MoD", "target", value, layer)
        for _, router in layers:  # the current capacity follows the new target (or its warm-up)
            router.set_step(self._trainer.state.step)
        return f"MoD capacity {line.removeprefix('target ')}"


# Each action of the table (training/actions.py) -> its effect. skip_step takes effect when it is
# requested (AT_ONCE): the next step's update gate reads it.
EFFECTS: dict[str, Callable[..., str]] = {
    "skip_step": Control._skip_step,
    "scale_lr": Control._scale_lr,
    "set_lr": Control._set_lr,
    "emergency_lr_reduction": Control._emergency_lr_reduction,
    "rollback": Control._rollback,
    "skip_data": Control._skip_data,
    "set_micro_batch_tokens": Control._set_micro_batch_tokens,
    "set_activation_checkpointing": Control._set_activation_checkpointing,
    "set_grad_clip": Control._set_grad_clip,
    "set_weight_decay": Control._set_weight_decay,
    "save_checkpoint": Control._save_checkpoint,
    "stop": Control._stop,
    "add_expert": Control._add_expert,
    "prune_expert": Control._prune_expert,
    "reinit_expert": Control._reinit_expert,
    "reset_router": Control._reset_router,
    "set_capacity_factor": Control._set_capacity_factor,
    "set_router_temperature": Control._set_router_temperature,
    "set_balance_coef": Control._set_balance_coef,
    "set_mod_capacity": Control._set_mod_capacity,
    "set_rl_temperature": Control._set_rl_temperature,
    "set_entropy_bonus": Control._set_entropy_bonus,
    "set_overlong_filter": Control._set_overlong_filter,
    "set_overlong_penalty": Control._set_overlong_penalty,
    "set_verifier_timeout": Control._set_verifier_timeout,
    "set_generation_rows": Control._set_generation_rows,
    "set_max_staleness": Control._set_max_staleness,
    "set_dynamic_sampling": Control._set_dynamic_sampling,
    "set_rl_difficulty": Control._set_rl_difficulty,
    "set_total_steps": Control._set_total_steps,
    "set_checkpoint_every": Control._set_checkpoint_every,
    "exclude_node": Control._exclude_node,
}
AT_ONCE = frozenset({"skip_step"})


def check_effects(effects: dict[str, Callable[..., str]] = EFFECTS) -> None:
    """Every action of the table has an effect here, and every effect an action, with the same
    parameter names; ImportError otherwise (called below, at import)."""
    missing, stray = sorted(set(ACTIONS) - set(effects)), sorted(set(effects) - set(ACTIONS))
    if missing or stray:
        raise ImportError(
            f"training/control.py EFFECTS: no effect for action(s) {missing}; effects for no action {stray} "
            "(training/actions.py is the table of actions)"
        )
    for name, effect in effects.items():
        takes = list(inspect.signature(effect).parameters)[1:]  # after self
        wants = [p.name for p in ACTIONS[name].params]
        if takes != wants:
            raise ImportError(f"training/control.py EFFECTS: {name}'s effect takes {takes}, the action table {wants}")


check_effects()
