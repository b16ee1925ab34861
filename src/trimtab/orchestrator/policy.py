"""Policy: findings -> decisions. Every finding, whatever its family, goes through Policy.plan,
which dispatches on the family; instability climbs an escalation ladder with cooldowns and
bounded retries (ladder.py). Other families have one remedy each (orchestrator/remedies.py):
plateau -> raise the LR within limits, an unexplained LR -> bring it back, memory -> halve the
micro-batch, throughput -> log, fp16 overflow storm -> cut the LR, MoE and MoD health, a failed
save, the run's length, early stopping, a failed evaluation, withheld updates made up
(make_up.py). A person's commands (`trimtab ctl`) and config changes found on resume are not
findings: core.py journals them as theirs (mode manual). What a remedy changes in the policy is
in its `commit`, run only when it is applied (advice changes nothing). Confidence = evidence
strength x the track record of this remedy for this rule in this run (a Beta(3, 1) prior on
"recovered", updated by the outcomes of applied decisions).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator import evaluation, fallbacks, make_up, remedies, rl_remedies
from trimtab.orchestrator.attribution import DataAttribution
from trimtab.orchestrator.ladder import InstabilityLadder, Ladder
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.remedies import Remedy
from trimtab.orchestrator.rl_reward import KnobTurns, put_back
from trimtab.orchestrator.withheld import WITHHELD_RULE, WithheldUpdates, answer_withheld
from trimtab.training.actions import PUT_BACK

# Policy state restored from a checkpoint as saved (older checkpoints: the defaults of __init__)
STATE = (
    "last_lr_change",
    "lr_debt",
    "lr_ceiling",
    "lr_below",
    "last_restore",
    "restore_failed",
    "probe_baseline",
    "start_probe",
    "fresh_probe",
    "phase_start",
    "lr_too_high_at",
    "too_high_gain",
    "rollbacks",
    "rollback_at",
    "broken_at",
    "last_rollback_to",
    "updated_at",
    "closed_at",
    "unstable_at",
    "early_rollbacks",
    "end_rollbacks",
    "raised",
)


def _replicas(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    return Remedy(
        action="rollback",
        params={"to": f.evidence["agreed_step"]},
        reasoning="DDP averages gradients, not weights, so replicas that differ stay apart and every step "
        "trains a mix of them: restore the newest checkpoint from when they agreed on every rank (a "
        "checkpoint written since may hold a corrupted copy) and train the steps again",
    )


def _checkpoint(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    return Remedy(
        action="set_checkpoint_every",
        params={"steps": f.evidence["steps"]},
        reasoning="a failure loses on average half an interval of work and each save stalls training: Young's "
        "interval sqrt(2 x stall x MTBF) minimises their sum (Young 1974); never longer than checkpoint.every",
    )


def _baseline(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    return Remedy(
        action="none",
        reasoning="different batches give the same gradient norm although their updates were withheld, so "
        "the level belongs to the weights, not to a batch, and withholding cannot change it (it holds the "
        "model where the gradient is large); the loss is not rising: follow the new level, let the updates "
        "through (clipped as ever)",
    )


# the families with one remedy each: a function of the finding, the run's view and the config
REMEDIES: dict[str, Callable[[Finding, Any, OrchestratorConfig], Remedy]] = {
    "memory": remedies.memory,
    "throughput": remedies.throughput,
    "moe": remedies.moe,
    "mod": remedies.mod,
    "disk": remedies.disk,
    "length": remedies.length,
    "convergence": lambda f, view, cfg: evaluation.early_stop(f, cfg.early_stop.enabled),
    "evaluation": lambda f, view, cfg: evaluation.failed_evaluation(f, view.total_steps),
    "make_up": make_up.remedy,
    "cluster": lambda f, view, cfg: remedies.restart(f),
    "hardware": lambda f, view, cfg: remedies.transient(f, cfg),
    "straggler": lambda f, view, cfg: remedies.straggler(f, cfg),
    "replicas": _replicas,
    "checkpoint": _checkpoint,
    "fallback": lambda f, view, cfg: fallbacks.fallback_remedy(f),
    "baseline": _baseline,
}
# the families whose remedy reads or changes the policy's own state: the Policy method that plans it
OWN = {
    "instability": "_instability",
    "plateau": "_plateau",
    "lr": "_lr",
    "fp16": "_fp16",
    "rl": "_rl",
    "data": "_watched",
}


@dataclass
class RLIncident:
    """The rollbacks of RL's open incident (rl_remedies.ROLLING_BACK's rules), counted per incident as
    the ladder counts its own (ladder.py): max_rollbacks bounds one incident's. It is over once the
    run trained past the step its last rollback was decided at, and then escalation_window steps
    without a finding of those rules (not at a good checkpoint, as the ladder's: a checkpoint is
    good by the ladder's measure, and these rules see a fall only once their windows fill)."""

    rollbacks: int = 0
    rollback_at: int = -1  # the step the last of them was decided at (-1: none)
    last_step: int = -1  # the newest finding of those rules (steps a rollback replays: moved back)
    rule: str = ""  # the rule of the last of them ('': none, or a checkpoint from before this was kept)

    def rolled_back(self, step: int, rule: str) -> None:
        self.rollbacks, self.rollback_at, self.rule = self.rollbacks + 1, step, rule

    def clear(self, step: int, window: int) -> None:
        if 0 <= self.rollback_at < step and step - self.last_step >= window:
            self.rollbacks, self.rollback_at, self.rule = 0, -1, ""


def shifted(mark: int, steps: int) -> int:
    """A step mark whose -1 means none, moved back by a rollback over `steps`: never to -1 or below."""
    return max(0, mark - steps) if mark >= 0 else -1


class Policy(InstabilityLadder):
    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg
        self.ladder = Ladder()
        self.last_lr_change = -(10**9)  # step of the last LR decision applied (cooldown / grace period)
        self.lr_debt = 1.0  # product of the ladder's LR cuts not yet given back
        self.lr_ceiling = 1.0  # the multiplier they were cut from: give-backs stop there
        self.lr_below: list[list[float]] = []  # older LR debts under that one, [debt, ceiling] each (give_back.py)
        self.last_restore = -1  # step of a give-back still on probation
        self.restore_failed = 0  # give-backs instability followed (give_back.py)
        self.probe_baseline: float | None = None  # held-out loss at the last good checkpoint
        self.start_probe: float | None = None  # held-out loss of the phase's untouched weights
        self.fresh_probe: float | None = None  # ... of calm weights since, before a good checkpoint is measured
        self.phase_start = 0  # the step the current phase started after
        self.lr_too_high_at = -(10**9)  # step of the last decisive LR cut (the LR found far too high)
        self.too_high_gain: list[float] | None = None  # [phase_start, the update gain that cut answered] (too_high.py)
        self.rollbacks = 0  # rollbacks of the open incident (ladder.py: _clear ends it)
        self.rollback_at = -1  # the step the last of them was decided at (-1: none)
        self.broken_at = -1  # ... when it was for broken weights
        self.last_rollback_to = -1  # the checkpoint step the last ladder rollback restored (-1: none)
        self.closed_at = -1  # the step the last incident with a rollback closed at (-1: none)
        # the last step whose update was applied (core.py reads it; ladder.py _same_replay), unknown as the
        # newest: no rollback is taken for a replay of what failed on the word of a view that never said
        self.updated_at = 10**9
        self.unstable_at = -(10**9)  # step of the last LR cut or rollback: rows are not judged for a while
        self.early_rollbacks: dict[str, list[float]] = {}  # step -> the loss an early spike rolled back from, ...
        self.end_rollbacks: dict[str, list[float]] = {}  # step -> the probe an end check rolled back from, ...
        self.raised: list[Any] = []  # [step, factor, what] of a person's last LR raise (raised.py)
        self.data = DataAttribution(cfg)  # which rows of a bad stretch are bad (orchestrator/attribution.py)
        self.withheld = WithheldUpdates(cfg)  # most recent updates withheld: an instability (withheld.py)
        self.rl = RLIncident()
        self.rl_knobs = KnobTurns()  # the knobs RL's rules turned: rule rl_reward's rollback puts them back

    # ------------------------------------------------------------------ decisions

    def plan(self, f: Finding, view: Any) -> Remedy:
        """What to do about finding f; `view` is the run's RunView (read only here). MoE findings'
        families are per layer ("moe/3"): their remedies are the same."""
        family = f.family.split("/")[0]
        if family in OWN:
            own = f.rule == WITHHELD_RULE  # the guard over every rule's withheld updates (withheld.py)
            remedy = answer_withheld(self, f, view) if own else getattr(self, OWN[family])(f, view)
            return self.counted(remedy) if family == "instability" and remedy.action == "rollback" else remedy
        return REMEDIES[family](f, view, self.cfg)

    def _changes_lr(self, step: int) -> None:
        self.last_lr_change = step

    def _lr(self, f: Finding, view: Any) -> Remedy:
        if f.evidence["ratio"] < f.evidence["explained"]:  # the rule's own compensation lost its cause
            why = (
                "the multiplier was lowered to compensate for an LR raised by something else, and the optimizer "
                "no longer applies that raised LR (a rollback's replay before it began, or it stopped): the "
                "compensation is given back, so the LR is the schedule's again"
            )
        else:
            why = (
                "the LR the optimizer applies differs from what the config's schedule and the journal explain: "
                "a stray writer or a schedule error, not a decision; the step was skipped and the multiplier "
                "brings the LR back to the explained level"
            )
        return Remedy(
            action="scale_lr",
            params={"factor": f.evidence["explained"] / f.evidence["ratio"]},
            reasoning=why + " (`trimtab ctl RUN scale-lr` overrides this)",
            commit=lambda: self._changes_lr(f.step),
        )

    def _fp16(self, f: Finding, view: Any) -> Remedy:
        return Remedy(
            action="scale_lr",
            params={"factor": self.cfg.fp16.lr_factor},
            reasoning="fp16 gradients overflow again and again; a lower LR keeps activations and gradients in "
            "range (bf16, where the hardware has it, avoids this entirely)",
            commit=lambda: self._changes_lr(f.step),
        )

    def _watched(self, f: Finding, view: Any) -> Remedy:
        if f.rule == "rows":
            why = (
                "these rows' losses are far above the other rows' of the last steps, and stay there: outliers "
                "again when seen once more, or already by more than text ever is; the model does not learn them "
                "as it learns the rest (garbage, a broken encoding, a corrupt record), so they are bad data even "
                "though no step spiked; leave them out of later epochs (this step's update included them)"
            )
        elif f.rule == "row_gate":
            # a fresh model scores ln(vocab): broken is a step's median past it by the gate's own gap
            middle, uniform = f.evidence.get("step_median"), math.log(max(view.vocab_size, 2))
            if middle is not None and middle >= uniform + self.cfg.row_gate.min_gap:
                return Remedy(
                    action="none",
                    reasoning=f"the step's other rows scored {middle:.2f} too, past the {uniform:.2f} "
                    "of uniform guesses over the vocabulary: a model that scores a whole step worse than random "
                    "tokens is in trouble itself (an LR far too high, damaged weights), not these rows; they were "
                    "left out of this step's update only, and are trained again when met",
                )
            why = (
                "these rows' target tokens are mostly distinct (random tokens, not text, which repeats its words) "
                "and their losses stood far above the recent rows' when this step met them, or (model-free, what "
                "the LR warm-up needs: the model scores text as random tokens there) their tokens score as uniform "
                "draws under the token frequencies of the rows trained on, where text is Zipfian: the row gate already "
                "left them out of this step's update (their targets ignored before the backward); leave them out "
                "for the rest of the run too, as bad data (orchestrator.row_gate.*)"
            )
        else:
            why = (
                "rows were left out as bad data a few steps ago, so the steps after are watched: these score as "
                "outliers against held-out rows too; leave them out"
            )
        # a step the rows rule blamed (several outliers at once): a bad stretch rarely ends on its first step
        watch = self.data.watch_more if f.evidence.get("blamed") else None
        return Remedy(action="skip_data", params={"rows": f.evidence["rows"]}, reasoning=why, commit=watch)

    def _rl(self, f: Finding, view: Any) -> Remedy:
        """RL's rules (rl_health.py), their remedies (rl_remedies.py); a rollback spends one of the RL incident's."""
        if f.rule in rl_remedies.ROLLING_BACK:
            self.rl.last_step = f.step
        remedy = rl_remedies.remedy(f, view, self.cfg, rollbacks=self.rl.rollbacks, incident=self.rl.rule)
        if remedy.action == "rollback":
            # the others' rollbacks keep them (rl_length's: the penalty is its fix; hacking's: the policy learns)
            if f.rule == "rl_reward":
                put_back(remedy, self.rl_knobs.turns, f.evidence["good_step"])
            elif f.evidence.get("kind") == "held_out_fall":  # a collapse as rl_reward's: rl_signal warmed it
                put_back(remedy, self.rl_knobs.turns, f.evidence["best_step"])
            remedy.commit = lambda: self.rl.rolled_back(f.step, f.rule)
        elif remedy.action in PUT_BACK:
            remedy.commit = self.rl_knobs.turning(remedy, view)
        return remedy

    def quiet(self, step: int, view: Any) -> Remedy | None:
        """The ladder's quiet steps (ladder.py), which may end RL's open incident too."""
        self.rl.clear(step, self.cfg.escalation_window)
        self.rl_knobs.seen = step
        return super().quiet(step, view)

    def _plateau(self, f: Finding, view: Any) -> Remedy:
        cfg = self.cfg.plateau
        target = view.lr_scale * cfg.lr_factor
        if "start" in f.evidence and (remedy := self._too_low(f, view)) is not None:
            return remedy
        if f.evidence.get("variance", 0.0) >= cfg.variance:  # found for not leaving its start alone, on a trained model
            return Remedy(
                action="none",
                reasoning="the loss has not left where the phase started, but the model was trained before "
                "(train.init_from, or its first loss under its data's unigram entropy) or its data's context-free "
                "level is unknown, so a low LR may be meant: no raise (check optim.lr)",
            )
        if f.step - self.last_lr_change < 2 * cfg.window:
            return Remedy(action="none", reasoning="the LR changed recently; give it time before raising it")
        if self.ladder.last_step >= 0 and f.step - self.ladder.last_step < 2 * cfg.window:
            return Remedy(action="none", reasoning="instability was seen recently; a higher LR would be risky")
        if target > cfg.max_lr_scale:
            return Remedy(
                action="none",
                reasoning=f"the LR multiplier would pass orchestrator.plateau.max_lr_scale={cfg.max_lr_scale:g}; "
                "a person should look at the schedule",
            )
        return Remedy(
            action="scale_lr",
            params={"factor": cfg.lr_factor},
            reasoning="the loss has stopped moving long before the planned end: a larger LR may get it out of "
            "the flat region (bounded by orchestrator.plateau.max_lr_scale)",
            commit=lambda: self._changes_lr(f.step),
        )

    def _too_low(self, f: Finding, view: Any) -> Remedy | None:
        """The loss has not left the phase's start a window after the LR's warm-up (Plateau): an LR
        far too low, where plateau's x1.5 under its 2x ceiling changes nothing (debug at 0.001x:
        raised once to 0.0015x, val 6.215 against 6.219 off, the start 6.25). Raised decisively,
        x1/above_start.lr_factor, the mirror of a cut for an LR far too high, up to 1/min_lr_scale
        (the cuts' floor mirrored); only for a model that has learned nothing yet (its start above
        the data's unigram entropy, not train.init_from) and whose LR this phase was never found far
        too high; None for any other model (_plateau's answers). The reasonings of `none` carry no
        numbers of the window: the same answer again is counted on the decision, not journaled anew."""
        ev, cfg = f.evidence, self.cfg
        unigram = view.context_free_loss()
        if unigram is None or ev["start"] <= unigram or view.cfg.train.init_from:
            return None
        stuck = "the loss has not left where the phase started a window after the LR's warm-up"
        if f.step - self.last_lr_change < cfg.plateau.window:  # a window is a raise's time
            return Remedy(action="none", reasoning=f"{stuck}, but the LR changed within the window: give it time")
        if ev["mean"] <= unigram * (1 + cfg.above_start.unigram_margin):  # where an LR too high holds it (AboveStart)
            why = "it is at the level of a model blind to context, where an LR too high holds it as well"
            return Remedy(action="none", reasoning=f"{stuck}, but {why}: no raise (check optim.lr)")
        if self.ladder.last_step >= 0 and f.step - self.ladder.last_step < 2 * cfg.plateau.window:
            return Remedy(action="none", reasoning=f"{stuck}, but instability was seen lately: a higher LR is risky")
        if self.lr_too_high_at >= self.phase_start:
            return Remedy(
                action="none",
                reasoning=f"{stuck}, but the LR was found far too high at step {self.lr_too_high_at} and cut: a raise "
                "would undo that (to lower the cut by hand: `trimtab ctl RUN scale-lr`)",
            )
        factor = min(1 / cfg.above_start.lr_factor, 1 / (cfg.min_lr_scale * view.lr_scale))
        if factor <= 1 + 1e-6:
            return Remedy(
                action="none",
                reasoning=f"{stuck}: the LR is far too low, but the multiplier is at its ceiling "
                f"({view.lr_scale:.3g}, 1/orchestrator.min_lr_scale): raise optim.lr",
            )
        return Remedy(
            action="scale_lr",
            params={"factor": factor},
            reasoning=f"the loss {ev['mean']:.3f} (mean of the last {ev['window']} steps, past any LR warm-up) has not "
            f"left the {ev['start']:.3f} the phase started at by the {ev['start'] - ev['line']:.3f} rule above_start "
            f"measures above it, and is above the {unigram:.3f} of a model blind to context (the data's unigram "
            f"entropy): the updates are too small to train it, an LR far too low; raise it x{factor:.3g} (past "
            "orchestrator.plateau.max_lr_scale, which bounds the raises for a model that learned and stopped)",
            commit=lambda: self._changes_lr(f.step),
        )

    def shift(self, steps: int) -> None:
        """A rollback moved the step counter back by `steps`: move remembered steps with it, so
        cooldowns and quiet windows count the steps actually trained."""
        self._judge_give_back()  # give_back.py: the instability that called the rollback is a give-back's failure
        ladder = self.ladder
        ladder.recent = [s - steps for s in ladder.recent]
        # a finding is kept at step 0 at the least: -1 reads as none (a finding at 9, rolled back from 10 to 0, let a
        # plateau raise through at once, and a finding below 0 was no longer moved by the next rollback)
        ladder.last_step = shifted(ladder.last_step, steps)
        self.last_lr_change -= steps
        # not judged failed, a give-back stays on probation (its LR is kept for the replay), at step 0 at the least
        self.last_restore = shifted(self.last_restore, steps)
        self.lr_too_high_at -= steps
        self.unstable_at -= steps
        self._shift_raise(steps)
        # rollback_at and broken_at stay: the replay must train past those very steps (ladder.py: _clear)
        self.fresh_probe = None  # of weights the rollback took back
        self.rl.last_step = shifted(self.rl.last_step, steps)
        self.rl_knobs.shift(steps)
        self.data.shift()
        self.withheld.shift()

    def measured(self, probe: float | None, step: int) -> None:
        """The held-out probe of a good checkpoint at `step`, the reference a diagnosis and the
        end check compare with; at the phase's start, its untouched weights' score too."""
        self.probe_baseline, self.fresh_probe = probe, None
        if step == self.phase_start:
            self.start_probe = probe

    def new_phase(self, start: int, probe: float | None) -> None:
        """A phase began after step `start` (new data, a new schedule); `probe`: its held-out score."""
        self.phase_start, self.probe_baseline, self.start_probe, self.fresh_probe = start, probe, probe, None

    # ------------------------------------------------------------------ confidence

    @staticmethod
    def confidence(strength: float, record: tuple[int, int]) -> float:
        recovered, judged = record
        return round(strength * (recovered + 3) / (judged + 4), 3)

    def state_dict(self) -> dict[str, Any]:
        return {
            "ladder": vars(self.ladder).copy(),
            **{k: dict(v) if isinstance(v := getattr(self, k), dict) else v for k in STATE},  # a save keeps its own
            "data": self.data.state_dict(),
            "withheld": self.withheld.state_dict(),
            "rl_incident": vars(self.rl).copy(),
            "rl_knobs": {"turns": [list(turn) for turn in self.rl_knobs.turns], "seen": self.rl_knobs.seen},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ladder = Ladder(**state["ladder"])
        for key in STATE:
            setattr(self, key, state.get(key, getattr(self, key)))
        self.data.load_state_dict(state.get("data", {}))
        self.withheld.load_state_dict(state.get("withheld", {}))  # older checkpoints: an empty window
        self.rl = RLIncident(**state.get("rl_incident", {}))  # older checkpoints: none open
        self.rl_knobs = KnobTurns(**state.get("rl_knobs", {}))  # older checkpoints: no turn recorded
