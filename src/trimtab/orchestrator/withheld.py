"""The withheld-updates guard: training that no longer trains is an instability, whatever rule withheld it.

Each rule that withholds an update (the update gate's spike, the data watch, a skip) answers its own
step, and no rule sees that together they stopped training. Debug-moe, a person's `ctl scale-lr 30`
at step 13: the raised LR damaged the weights, every later step's loss stood over the spike ceiling,
and the data watch claimed each spike as its rows' (attribution.py), so the ladder never climbed:
86 of 100 updates withheld, the weights frozen (val_loss 6.17 at steps 50 and 100; a clean twin
4.44 at 50), summary.json "completed". So when more than half of the last
orchestrator.withheld_window steps had their updates withheld, the guard finds an instability of its
own: the last good checkpoint is restored with the LR cut (x above_start.lr_factor, under the
schedule's: a raise above it, a person's too, is taken back, and a person's is named loudly, since an
LR that lets no update through is not beyond question); with no good checkpoint, this incident's
rollbacks spent, or the LR at orchestrator.min_lr_scale, the run saves and stops with exit 3 and the
reason, never "completed" with frozen weights. The window starts over after a rollback. The cut is
given back as the ladder's are (ladder.py quiet: x2 at a time after a quiet window, up to the
schedule's, a person's raise not included; trouble after a second give-back keeps the cut): what withheld
the updates may have been a fault or a stretch of data, not the LR.

A step whose every row the row gate left out (training/row_gate.py: targets that look like random
tokens, a model-free test, and score far above the recent rows) is not counted: it had nothing to
train on, its rows are left out for the run already, and the weights are those that scored the clean
steps before it, so a rollback replays nothing better and the cut only slows the clean steps after
(outliers.py all_gated answers its spike the same way). Debug, 120 steps, `bad_batch@15:15` (every
row of steps 15-29 gated): the guard rolled back at step 25 with the LR x0.1, given back x2 every 20
steps, val 4.438 against 4.171 clean (+6.4%; seeds 1, 2: +10.2%, +11.1%); not counted, 4.236 (+1.5%;
seeds 1, 2: +1.3%, +1.5%; 12 of the 15 updates made up, `make_up.max_fraction`). Such steps are
journaled one by one (rule row_gate, skip_data) and made up. Past two windows of them in a row they count
again: a stream that stays all garbage is a run that does not train (the guard's rollback, then its stop,
exit 3), not one that "completed" with frozen weights. Past one window, a 25-step stretch (200 steps,
`bad_batch@25:25`: 5 counted) and the spike rule's 5 withheld steps after it (the first clean losses over a
trend extrapolated across the frozen steps) made 11 of 20: the guard's rollback with the LR x0.1, val 4.252
against 3.841 past two (3.834 clean).
"""

from __future__ import annotations

from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.remedies import Remedy, lr_cut

WITHHELD_RULE = "withheld"
PERSON_LR = ("scale_lr", "set_lr")  # a person's LR commands (trimtab ctl)
STRENGTH = 0.9  # a count, not a threshold on noise: the updates were withheld or not


class WithheldUpdates:
    """The last `withheld_window` steps' withheld flags; its state is the policy's (checkpointed)."""

    def __init__(self, cfg: OrchestratorConfig):
        self.window = cfg.withheld_window
        self.steps: dict[str, bool] = {}  # step (a string: JSON keys) -> its update withheld
        self.gated = 0  # steps in a row whose every row the row gate left out

    def observe(self, m: StepMetrics) -> Finding | None:
        """A finding when most of the window's updates were withheld."""
        self.steps = {s: w for s, w in self.steps.items() if m.step - self.window < int(s) < m.step}
        self.gated = self.gated + 1 if all_rows_gated(m) else 0
        if 0 < self.gated <= 2 * self.window:  # the data's, left out already: not training that fails to train
            return None
        self.steps[str(m.step)] = m.skipped
        withheld = sum(self.steps.values())
        if 2 * withheld <= self.window:
            return None
        self.steps = {}  # answered: the next finding needs a window of its own
        return Finding(
            rule=WITHHELD_RULE,
            family="instability",
            step=m.step,
            evidence={"withheld": withheld, "window": self.window},
            summary=f"{withheld} of the last {self.window} updates withheld: training does not train",
            strength=STRENGTH,
        )

    def shift(self) -> None:
        """A rollback: the steps counted from here are new ones."""
        self.steps, self.gated = {}, 0

    def state_dict(self) -> dict[str, Any]:
        return {"steps": dict(self.steps), "gated": self.gated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.gated = dict(state.get("steps", {})), int(state.get("gated", 0))


def all_rows_gated(m: StepMetrics) -> bool:
    """The row gate left out every row of the step: its update had nothing to train on."""
    return bool(m.rows) and not set(m.rows) - set(m.gated_rows)


def person_lr(f: Finding, decisions: list[Any]) -> Finding:
    """`f`, naming the last LR a person set (trimtab ctl: a journaled "manual" decision), if any."""
    person = next((d for d in reversed(decisions) if d.rule == "manual" and d.action in PERSON_LR), None)
    if person is not None:
        f.evidence["person_lr"] = {"step": person.step, "action": person.action, "params": dict(person.params)}
        f.summary += f" (the LR a person set at step {person.step} included)"
    return f


def answer_withheld(policy: Any, f: Finding, view: Any) -> Remedy:
    """The guard's finding: roll back with the LR cut under the schedule's; else stop (exit 3).
    `policy`: the InstabilityLadder (its rollback count, _rolled_back and _give_up)."""
    cfg, ev = policy.cfg, f.evidence
    frozen = f"{ev['withheld']} of the last {ev['window']} updates were withheld: the weights hardly moved"
    person = ev.get("person_lr")
    loud = (
        f"; the LR is a person's (trimtab ctl {person['action']} at step {person['step']}), cut all the same: "
        "an LR at which no update gets through is not beyond question"
        if person
        else ""
    )
    cut = lr_cut(cfg.above_start.lr_factor / max(view.lr_scale, 1.0), view, cfg)
    if cut is None:
        return policy._give_up(view, f"{frozen}, and the LR is at orchestrator.min_lr_scale already{loud}")
    if policy.rollbacks >= cfg.max_rollbacks or not view.has_good_checkpoint:
        return policy._give_up(view, f"{frozen}{loud}")
    step, target, lr_scale = f.step, view.last_good, view.lr_scale

    def commit() -> None:
        policy._rolled_back(step, target, broken=False)
        policy.lr_too_high_at = step  # rows' high losses are the model's for a while
        policy.ladder.last_step = step  # the quiet window before a give-back counts from here, as its probation
        policy._owe(cut, lr_scale, ceiling=1.0)  # given back once quiet, never past the schedule's

    return Remedy(
        action="rollback",
        params={"to": "last_good", "skip_rows": [], "lr_factor": cut},
        reasoning=f"{frozen}, whatever rule withheld them, so the run is not training: restore the last good "
        f"checkpoint with the LR x{cut:.3g} (under the schedule's x{cfg.above_start.lr_factor:g}; given back x2 "
        f"at a time after orchestrator.lr_restore_after quiet steps, up to the schedule's){loud}",
        commit=commit,
    )
