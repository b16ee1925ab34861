"""The run's length and learning-rate schedule across its phases, and what changing a length means.

A run is a sequence of phases (pretraining, then an optional finetune), each with its own schedule
over its own length (optim.lr_at). A length changes in four ways, each with defined semantics:

- the live planner (Control's set_total_steps) during pretraining: the schedule stretches or
  shrinks to the new end; the change (TrainState.length_delta) is kept on resume while the config
  keeps pretraining's length;
- a person resuming with another `train.max_steps` / `finetune.steps` before that phase ended:
  the same, the schedule is a function of the phase's length. The new `train.max_steps` means
  what it means on a fresh run: the phase's length, whatever the live planner or `trimtab ctl`
  had made of the old one (`ctl total-steps 60`, then `--max-steps 70`, trains to 70: the
  person's newest word, not 70 + 20), plus the steps orchestrator.make_up added for updates the
  gate withheld (TrainState.made_up), which a fresh run of that length would have added too: they
  keep its promise of that many updates, and its cap (make_up.max_fraction of the new length)
  still counts them;
- a person extending a phase that had already ended (a finished run asked to go on): the added
  steps re-warm from the LR the phase ended at to its peak over `optim.warmup_steps`, at most a
  quarter of them (rewarm_steps), then follow the configured schedule, its decay included, to the
  new end. Continuing at the final (minimum) LR barely trains, and jumping to the stretched
  schedule's mid-run LR is a shock; re-warming and re-decaying is what Ibrahim et al. 2024
  ("Simple and Scalable Strategies to Continually Pre-train Large Language Models") found to
  recover the LR's benefit without a loss spike;
- a person adding a phase after the others (a finetune after pretraining), or dropping one the
  run has not started: the phases to come change; one the run is in or past cannot be dropped.

Such a re-warm is a `restart`, [phase, start step, warm_from LR], kept in the checkpoint; a
person's change is reported (and journaled by the orchestrator) as a configuration change.
"""

from __future__ import annotations

from itertools import accumulate, zip_longest
from typing import Any, Protocol

from trimtab.config import OptimConfig, RunConfig
from trimtab.errors import ConfigError
from trimtab.training.optim import lr_at, warmup_length, warmup_top
from trimtab.training.state import StepOutput

KEYS = ("train.max_steps", "finetune.steps")  # the config key of each phase's length


class PhaseLike(Protocol):
    start: int
    steps: int
    optim: OptimConfig


def configured_lengths(cfg: RunConfig) -> list[int]:
    """Each phase's length as the config asks (the planner's changes come on top)."""
    return [cfg.train.max_steps] + ([cfg.finetune.steps] if cfg.finetune.steps else [])


def fixed_lengths(cfg: RunConfig) -> list[int] | None:
    """configured_lengths where the config alone gives them; None where pretraining's depends on
    the data (train.epochs) or the model (max_steps: auto): the run resolves it at start-up."""
    return configured_lengths(cfg) if cfg.train.epochs <= 0 and cfg.train.max_steps != "auto" else None


def apply_lengths(phases: list[PhaseLike], lengths: list[int], delta: int) -> int:
    """Set each phase's length (pretraining's moved by the planner's `delta`) and start; returns
    the run's total steps."""
    start = 0
    for i, phase in enumerate(phases):
        phase.start, phase.steps = start, lengths[i] + (delta if i == 0 else 0)
        start += phase.steps
    return start


def rewarm_steps(added: int, optim: OptimConfig) -> int:
    """The re-warm of `added` steps extending an ended phase: optim.warmup_steps, but at most a
    quarter of them, so the rest decays to the new end (a re-warm as long as the extension would
    end it at its peak); 0, under 4 steps: too few to re-warm and decay, they go on at the LR the
    phase ended at (a jump to the peak for a step or two would be the shock a re-warm avoids)."""
    return min(optim.warmup_steps, added // 4)


def phase_lr(phase: PhaseLike, index: int, step: int, restarts: list[list[Any]], behind: list[int] = ()) -> float:
    """The configured LR of global step `step` (0-based) in phase `index`: the phase's schedule over
    its length, or over a re-warm segment after an extension (rewarm_steps). `behind`: [a segment's
    start, the updates withheld during its warm-up] (TrainState.warm_behind), which hold it back."""
    start, end, warm_from, warmup = _segment(phase, index, step, restarts)
    if warmup == 0:  # an extension too short to re-warm: it goes on at the LR the phase ended at
        return warm_from
    return lr_at(step - start, end - start, phase.optim, warm_from, warmup, behind=_late(behind, start))


def set_lr_level(phase: PhaseLike, index: int, step: int, restarts: list[list[Any]], behind: list[int] = ()) -> float:
    """The configured LR a person's `ctl set-lr` replaces (Control._set_lr; the multiplier becomes value / it):
    step `step`'s, or inside a warm-up the LR the warm-up rises to. Reckoned from the warm-up's LR of the
    moment, the shape kept from it multiplied the rest of the warm-up: `set-lr 1e-3` at step 2 of debug's
    (a tenth of the way up) set a multiplier of 10, and the LR reached 10x the value set."""
    start, end, _, warmup = _segment(phase, index, step, restarts)
    warm = warmup_length(end - start, phase.optim, warmup)
    if warmup != 0 and step - start - _late(behind, start) < warm:
        return warmup_top(phase.optim)
    return phase_lr(phase, index, step, restarts, behind)


def note_withheld(state: Any, phase: PhaseLike, out: StepOutput) -> None:
    """After step `out` of the state's phase: if its update, due in a warm-up, was withheld (read
    only then), the warm-up is one more update behind (optim.lr_at). The count is the segment's, in
    the state, so a rollback restores it with the step and a resume goes on with it."""
    step = out.step - 1  # 0-based, as phase_lr's
    start, end, _, warmup = _segment(phase, state.phase, step, state.restarts)
    late = _late(state.warm_behind, start)
    if step - start - late < warmup_length(end - start, phase.optim, warmup) and _withheld(out):
        state.warm_behind = [start, late + 1]


def _late(behind: list[int], start: int) -> int:
    """The updates withheld during the warm-up of the segment that starts at `start` (TrainState.warm_behind)."""
    return behind[1] if len(behind) == 2 and behind[0] == start else 0


def _withheld(out: StepOutput) -> bool:
    """Whether the step's update was withheld: by the update gate, or by fp16's scaler on an overflow.
    A host read (steps past the warm-ups never pay it), but for a step the re-run's read found
    unflagged (no scaler there)."""
    if out.withheld is not None:
        return out.withheld
    for flag in (out.skipped, out.overflow):
        if flag is not None and bool(flag):
            return True
    return False


def _segment(phase: PhaseLike, index: int, step: int, restarts: list[list[Any]]) -> tuple[int, int, float, int | None]:
    """The schedule segment step `step` falls in: its start, end, the LR it warms from, and its
    warm-up (lr_at's `warmup`: None, the phase's own, optim.warmup_steps; a re-warm's rewarm_steps)."""
    segments = [(phase.start, 0.0)] + sorted((s, w) for p, s, w in restarts if p == index)
    i = max(j for j, (start, _) in enumerate(segments) if start <= step)
    start, warm_from = segments[i]
    end = segments[i + 1][0] if i + 1 < len(segments) else phase.start + phase.steps
    return start, end, warm_from, None if i == 0 else rewarm_steps(end - start, phase.optim)


def reconcile(state: Any, phases: list[PhaseLike], lengths: list[int]) -> list[dict[str, Any]]:
    """A resumed run whose config asks for other phase lengths than it was trained with: add the
    re-warm restarts, record the new lengths in `state` (phase_steps, restarts) and return the
    changes, one dict per phase (key, old, new, effect; 0: no such phase) for the console and the
    journal. A phase added after the others, or one dropped before it started, is such a change."""
    old = state.phase_steps or lengths
    changes = []
    ran = [n + (state.length_delta if i == 0 else 0) for i, n in enumerate(old)]  # each phase's length as trained
    old_ends = list(accumulate(ran))
    for index, (before, after) in enumerate(zip_longest(old, lengths)):
        if before == after:
            continue
        made_up = getattr(state, "made_up", 0) if index == 0 else 0  # kept on top (module docstring)
        _check_change(state, index, before, after, old_ends, len(lengths))
        if before is None:
            effect = "a new phase after the others"
        elif after is None:
            effect = f"the phase had not started (the run is at step {state.step}): it is dropped"
        elif state.step >= old_ends[index] and after + made_up > ran[index]:
            effect = _rewarm(state, phases[index], index, ran[index], after + made_up, old_ends[index])
        else:
            effect = "the schedule stretches or shrinks to the new end"
        if index == 0 and state.length_delta:  # the person's new length is the length (module docstring)
            effect += _delta_replaced(state.length_delta, made_up, ran[0], after)
            state.length_delta = made_up
        changes.append({"key": KEYS[index], "old": before or 0, "new": after or 0, "effect": effect})
    state.phase_steps = list(lengths)
    return changes


def _delta_replaced(delta: int, made_up: int, ran: int, after: int) -> str:
    """What becomes of set_total_steps' `delta` to pretraining's old length (`ran` steps as trained) when a
    resume names another one, `after`: replaced, but for orchestrator.make_up's `made_up` steps."""
    text = ""
    if delta != made_up:
        text = f"; it replaces set_total_steps' {delta - made_up:+d} to the old one ({ran} steps)"
    if made_up:
        text += (
            f"; the {made_up:+d} orchestrator.make_up added for withheld updates stay on top, as on a fresh run: "
            f"{after + made_up} steps"
        )
    return text


def _check_change(
    state: Any, index: int, before: int | None, after: int | None, old_ends: list[int], phases: int
) -> None:
    """ConfigError where phase `index`'s length may not change from `before` to `after` (None: no
    such phase): a phase the run has gone past, or one it trains in that the config drops, or a
    current phase cut short of the step reached while another phase follows it."""
    key = KEYS[index]
    if (after is None and state.phase >= index) or (before is not None and state.phase > index):
        where = "past" if state.phase > index else "in"
        raise ConfigError(
            f"config key '{key}' changed from {before or 0} to {after or 0}, but this run is already {where} that "
            f"phase (at step {state.step}); keep it, or start a new run with train.init_from"
        )
    if before is not None and after is not None and index == state.phase and index + 1 < phases:
        kept = getattr(state, "made_up", 0) if index == 0 else 0  # make-up's steps stay (module docstring)
        if old_ends[index] - before - (state.length_delta - kept if index == 0 else 0) + after < state.step:
            raise ConfigError(
                f"config key '{key}' = {after} would end this phase before step {state.step}, which the run "
                "has reached, with another phase after it; give it at least that many steps"
            )


def _rewarm(state: Any, phase: PhaseLike, index: int, before: int, after: int, old_end: int) -> str:
    """A phase that had ended at `old_end` extended from `before` to `after` steps: its re-warm
    restart added to state.restarts; returns the change's effect."""
    old_phase = _Phase(start=old_end - before, steps=before, optim=phase.optim)
    warm_from = phase_lr(old_phase, index, old_end - 1, state.restarts)
    state.restarts.append([index, old_end, warm_from])
    added, warm = after - before, rewarm_steps(after - before, phase.optim)
    if not warm:
        return f"the phase had ended at step {old_end}: its {added} added steps go on at its final lr {warm_from:.3g}"
    return (
        f"the phase had ended at step {old_end}: its {added} added steps re-warm from lr {warm_from:.3g} to "
        f"{phase.optim.lr:.3g} over {warm} steps, then follow the {phase.optim.schedule} schedule to the new end"
    )


class _Phase:
    def __init__(self, start: int, steps: int, optim: OptimConfig) -> None:
        self.start, self.steps, self.optim = start, steps, optim
