"""Policy: findings -> decisions. Every finding, whatever its family, goes through Policy.plan,
which dispatches on the family; instability climbs an escalation ladder with cooldowns and
bounded retries:

    rung 0  skip the step (the update gate already withheld it on device)
    rung 1  cut the LR (x lr_cut)
    rung 2  roll back to the last good checkpoint, skip the rows behind the incident, cut the LR
    rung 3  save and stop with a clear message (max_rollbacks used up, or nothing to roll back to)

It climbs when `escalate_after` instability findings fall within `escalation_window` steps of
each other (skipping did not help), and falls back to rung 0 after a quiet window. Before the
first climb a held-out probe tells bad data (leave its rows out, the LR stays) from broken
weights (roll back at once, keeping the data; when they break again within the replay, the
rollback cuts the LR too). Other families have one remedy each (orchestrator/remedies.py):
plateau -> raise the LR within limits, an unexplained LR -> bring it back, memory -> halve the
micro-batch, throughput -> log, fp16 overflow storm -> cut the LR, MoE and MoD health, a failed
save, the run's length, early stopping, a failed evaluation, withheld updates made up
(make_up.py). A person's commands (`trimtab ctl`) and config changes found on resume are not
findings: core.py journals them as theirs (mode manual). Confidence = evidence strength x the
track record of this remedy for this rule in this run (a Beta(3, 1) prior on "recovered",
updated by outcomes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator import evaluation, make_up, remedies, rl_health
from trimtab.orchestrator.attribution import DataAttribution
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.remedies import GAVE_UP, Remedy


@dataclass
class Ladder:
    rung: int = 0
    recent: list[int] = field(default_factory=list)  # steps of findings since the last climb
    last_step: int = -1  # last finding
    rows: list[int] = field(default_factory=list)  # rows of the incident's flagged steps


class Policy:
    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg
        self.ladder = Ladder()
        self.last_lr_change = -(10**9)  # step of the last LR decision (cooldown / grace period)
        self.lr_debt = 1.0  # product of the ladder's LR cuts not yet given back
        self.last_restore = -1  # step of a give-back still on probation
        self.restore_failed = False
        self.probe_baseline: float | None = None  # held-out loss at the last good checkpoint
        self.last_broken = -1  # finding step of the last rollback for broken weights (-1: none)
        self.last_rollback_to = -1  # the checkpoint step the last ladder rollback restored (-1: none)
        self.data = DataAttribution(cfg)  # which rows of a bad stretch are bad (orchestrator/attribution.py)
        self.dispatch = {
            "instability": self._instability,
            "plateau": self._plateau,
            "lr": self._lr,
            "fp16": self._fp16,
            "memory": lambda f, view: remedies.memory(f, view, cfg),
            "throughput": lambda f, view: remedies.throughput(f, view, cfg),
            "moe": lambda f, view: remedies.moe(f, view, cfg),
            "mod": lambda f, view: remedies.mod(f, view, cfg),
            "rl": lambda f, view: rl_health.remedy(f, view, cfg),
            "disk": lambda f, view: remedies.disk(f, view, cfg),
            "length": lambda f, view: remedies.length(f, view, cfg),
            "data": self._watched,
            "convergence": lambda f, view: evaluation.early_stop(f),
            "evaluation": lambda f, view: evaluation.failed_evaluation(f),
            "make_up": lambda f, view: make_up.remedy(f, view, cfg),
            "cluster": lambda f, view: remedies.restart(f),
            "hardware": lambda f, view: remedies.transient(f, cfg),
            "replicas": lambda f, view: Remedy(
                action="rollback",
                params={"to": f.evidence["agreed_step"]},
                reasoning="DDP averages gradients, not weights, so replicas that differ stay apart and every step "
                "trains a mix of them: restore the newest checkpoint from when they agreed on every rank (a "
                "checkpoint written since may hold a corrupted copy) and train the steps again",
            ),
            "checkpoint": lambda f, view: Remedy(
                action="set_checkpoint_every",
                params={"steps": f.evidence["steps"]},
                reasoning="a failure loses on average half an interval of work and each save stalls training: Young's "
                "interval sqrt(2 x stall x MTBF) minimises their sum (Young 1974); never longer than checkpoint.every",
            ),
            "straggler": lambda f, view: remedies.straggler(f, cfg),
            "baseline": lambda f, view: Remedy(
                action="none",
                reasoning="different batches give the same gradient norm although their updates were withheld, so "
                "the level belongs to the weights, not to a batch, and withholding cannot change it (it holds the "
                "model where the gradient is large); the loss is not rising: follow the new level, let the updates "
                "through (clipped as ever)",
            ),
        }

    # ------------------------------------------------------------------ decisions

    def plan(self, f: Finding, view: Any) -> Remedy:
        """What to do about finding f; `view` is the run's RunView (read only here). MoE findings'
        families are per layer ("moe/3"): their remedies are the same."""
        return self.dispatch[f.family.split("/")[0]](f, view)

    def _lr(self, f: Finding, view: Any) -> Remedy:
        self.last_lr_change = f.step
        return Remedy(
            action="scale_lr",
            params={"factor": f.evidence["explained"] / f.evidence["ratio"]},
            reasoning="the LR the optimizer applies differs from what the config's schedule and the journal "
            "explain: a stray writer or a schedule error, not a decision; the step was skipped and the multiplier "
            "brings the LR back to the explained level (`trimtab ctl RUN scale-lr` overrides this)",
        )

    def _fp16(self, f: Finding, view: Any) -> Remedy:
        self.last_lr_change = f.step
        return Remedy(
            action="scale_lr",
            params={"factor": self.cfg.fp16.lr_factor},
            reasoning="fp16 gradients overflow again and again; a lower LR keeps activations and gradients in "
            "range (bf16, where the hardware has it, avoids this entirely)",
        )

    def _instability(self, f: Finding, view: Any) -> Remedy:
        ladder, cfg = self.ladder, self.cfg
        if f.rule == "above_start":
            return self._lr_too_high(f, view)
        ladder.recent = [s for s in ladder.recent if f.step - s < cfg.escalation_window] + [f.step]
        ladder.last_step = f.step
        ladder.rows = sorted(set(ladder.rows) | set(f.rows))
        climb = len(ladder.recent) >= cfg.escalate_after
        if f.rule == "divergence" and ladder.rung == 0:
            climb = True  # a trend is not a one-off: skipping cannot fix it
        verdict = self._diagnose(view, sudden=f.rule != "divergence") if climb and ladder.rung == 0 else None
        if verdict and verdict[0] == "data":
            remedy = self._data(view, verdict[1])
            if remedy is not None:
                return remedy
        if verdict and verdict[0] == "broken":
            return self._rollback(view, broken=verdict[1])
        if not climb:
            return Remedy(action="skip_step", reasoning="")  # the orchestrator words it from what the gate did
        ladder.rung, ladder.recent = ladder.rung + 1, []
        if ladder.rung == 1 and view.lr_scale * cfg.lr_cut < cfg.min_lr_scale:
            ladder.rung = 2  # the LR is already at its floor
        if ladder.rung == 1:
            self.last_lr_change = f.step
            factor = cfg.divergence.lr_factor if f.rule == "divergence" else cfg.lr_cut
            if f.rule != "divergence":  # a rising trend is the LR's doing: that cut is never given back
                self.lr_debt *= factor
            return Remedy(
                action="scale_lr",
                params={"factor": factor},
                reasoning=f"{cfg.escalate_after} instability findings within {cfg.escalation_window} steps: "
                "skipping alone does not help, so the LR comes down"
                if f.rule != "divergence"
                else "the loss trends upward: a lower LR is the standard remedy for divergence",
            )
        return self._rollback(view)

    def _lr_too_high(self, f: Finding, view: Any) -> Remedy:
        """Training makes the model worse than where the phase started: the LR is too high. Cut
        it decisively (x above_start.lr_factor, again while the loss does not fall), down to the
        floor; the cut is never given back (lr_debt stays: restoring would return to the cause).
        At the floor, the ladder's last rungs: a rollback, then a stop."""
        self.ladder.last_step = f.step
        self.last_lr_change = f.step
        factor = self.cfg.above_start.lr_factor
        floor = self.cfg.min_lr_scale / view.lr_scale
        if floor >= 1 - 1e-6 and "warm_grad_norm" in f.evidence:  # at the floor: a replay would repeat itself
            return Remedy(
                action="none",
                reasoning=f"the gradient norm fell to {f.evidence['grad_norm']:.3f}, under "
                f"{f.evidence['collapse']:g}x the {f.evidence['warm_grad_norm']:.3f} of the first steps: the LR is "
                f"still too high, but it is at its floor (orchestrator.min_lr_scale={self.cfg.min_lr_scale:g}); "
                "lower optim.lr",
            )
        if floor >= 1 - 1e-6:
            return self._rollback(view)
        factor = max(factor, floor)
        if "warm_grad_norm" in f.evidence:  # the LR was cut for this already, and the gradient dies away
            why = (
                f"the LR was cut for being far too high, and since then the gradient norm fell to "
                f"{f.evidence['grad_norm']:.3f}, under {f.evidence['collapse']:g}x the "
                f"{f.evidence['warm_grad_norm']:.3f} of the first steps: the model is held where an LR still too "
                f"high leaves it (the loss stalls, the gradient dies away); cut it again x{factor:g}, never to be "
                "given back"
            )
        else:
            why = (
                f"the loss has been above the {f.evidence['start']:.3f} this phase started at for "
                f"{f.evidence['patience']} steps: training makes the model worse than its untouched weights, which "
                f"is what an LR far too high does; cut it x{factor:g} (again while the loss does not fall), never "
                "to be given back"
            )
        if "warm_grad_norm" in f.evidence:  # the steps since the replay began trained at a still-too-high LR
            start = f.evidence["since"] - 1
            if view.rollbacks < self.cfg.max_rollbacks and view.has_checkpoint(start):
                self.ladder.rung, self.ladder.recent, self.ladder.rows = 0, [], []
                return Remedy(
                    action="rollback",
                    params={"to": start, "skip_rows": [], "lr_factor": factor},
                    reasoning=why + f"; the steps since step {start} trained at that LR and left the model stalled "
                    "(at the lower LR it stays there): restore that checkpoint and train them again",
                )
            return Remedy(action="scale_lr", params={"factor": factor}, reasoning=why)
        sound = 0 <= view.last_good < f.evidence["since"]  # saved before the loss left its start
        if sound and view.rollbacks < self.cfg.max_rollbacks:
            self.ladder.rung, self.ladder.recent, self.ladder.rows = 0, [], []
            return Remedy(
                action="rollback",
                params={"to": "last_good", "skip_rows": [], "lr_factor": factor},
                reasoning=why + f"; the steps since step {view.last_good} (the last good checkpoint, saved before "
                "the loss rose) trained at that LR and left the weights worse than they started: restore it and "
                "train them again at the lower LR (the data was not at fault)",
            )
        return Remedy(action="scale_lr", params={"factor": factor}, reasoning=why)

    def _data(self, view: Any, probe: float) -> Remedy | None:
        """The model still scores held-out data as well as at the last good checkpoint, so the bad
        steps' data is suspect: leave out the rows that score as outliers. None when no row does:
        the data is not to blame after all (a NaN forward, a numerically unstable step, a rising
        trend), so the rows stay in training and the ladder climbs to its LR cut."""
        ladder = self.ladder
        bad, evidence = self.data.score(view, self._incident_rows())
        if not bad:
            return None
        why = (
            f"the model still scores {probe:.3f} on held-out data (last good checkpoint {self.probe_baseline:.3f}), "
            f"so the bad steps' data is suspect; scored one by one on these weights, {len(bad)} of the "
            f"{evidence['rows_scored']} rows since the first bad step lose more than {evidence['threshold']:.3f} "
            "(held-out rows' median "
            f"{evidence['reference_median']:.3f}): leave them out; the LR stays"
        )
        ladder.rows, ladder.recent = [], []
        return Remedy(action="skip_data", params={"rows": bad}, reasoning=why, evidence=evidence)

    def _incident_rows(self) -> list[int]:
        """Every row since the incident's first flagged step (a bad step under the ceiling too)."""
        first = min(self.ladder.recent, default=self.ladder.last_step)
        return sorted(set(self.ladder.rows) | set(self.data.since(first)))

    def _watched(self, f: Finding, view: Any) -> Remedy:
        if f.rule == "rows":
            why = (
                "these rows' losses are far above the other rows' of the last steps, and stay there: outliers "
                "again when seen once more, or already by more than text ever is; the model does not learn them "
                "as it learns the rest (garbage, a broken encoding, a corrupt record), so they are bad data even "
                "though no step spiked; leave them out of later epochs (this step's update included them)"
            )
        else:
            why = (
                "rows were left out as bad data a few steps ago, so the steps after are watched: these score as "
                "outliers against held-out rows too; leave them out"
            )
        return Remedy(action="skip_data", params={"rows": f.evidence["rows"]}, reasoning=why)

    def _rollback(self, view: Any, broken: float | None = None, cause: str = "") -> Remedy:
        """Rung 2 (or straight there when the probe found the weights broken): restore the last
        good checkpoint; rung 3, stop, when none is left or the rollbacks are used up."""
        ladder, cfg = self.ladder, self.cfg
        if view.rollbacks >= cfg.max_rollbacks or not view.has_good_checkpoint:
            ladder.rung = 3
            reason = (
                "no good checkpoint to roll back to"
                if not view.has_good_checkpoint
                else f"{view.rollbacks} rollbacks used (orchestrator.max_rollbacks={cfg.max_rollbacks})"
            )
            return Remedy(
                action="stop",
                params={
                    "reason": f"training is unstable and cannot be healed: {reason}; see decisions.jsonl, "
                    "lower optim.lr or check the data",
                    "exit_code": GAVE_UP,
                },
                reasoning=f"every rung of the ladder was tried ({reason}); saving and stopping is safer than "
                "training on",
            )
        rows, evidence = self.data.score(view, self._incident_rows()) if broken is None else ([], {})
        ladder.rung, ladder.rows, ladder.recent = 0, [], []  # the ladder starts over; rollbacks stay counted
        self.last_lr_change = ladder.last_step
        params: dict[str, Any] = {"to": "last_good", "skip_rows": rows}
        # The last rollback restored this same checkpoint and the trouble came back before the replay
        # saved a newer good one: the checkpoint itself holds the update that broke the run (a spike
        # shows on the step after the update that caused it, and the checkpoint was written between
        # them). Go one checkpoint further back.
        # (Broken weights found by the probe have their own answer to a recurrence: the LR cut below.)
        earlier = (
            broken is None and self.last_rollback_to == view.last_good >= 1 and view.has_checkpoint(view.last_good - 1)
        )
        if earlier:
            params["to"] = view.last_good - 1
        self.last_rollback_to = view.last_good - 1 if earlier else view.last_good
        if broken is not None:
            # A first breakage may be transient (a bit flip, one bad value): replay as it was. One that
            # comes back within the replay is not: the same steps at this LR break the weights again.
            again = self.last_broken >= 0 and ladder.last_step - self.last_broken < cfg.escalation_window
            self.last_broken = ladder.last_step
            if again:
                params["lr_factor"] = cfg.lr_cut
                self.lr_debt *= cfg.lr_cut
            why = self._broken(broken, again, cause)
        else:
            data = (
                f"leave out the {len(rows)} rows of the bad steps that score as outliers"
                if rows
                else "keep the data: no row of the bad steps scores as an outlier"
                if evidence.get("rows_scored")
                else "keep the data: this phase's rows (RL prompts, DPO pairs) have no loss of their own to score"
            )
            why = (
                "instability persists after skipping and an LR cut: restore the last good checkpoint (the LR "
                f"stays cut) and {data}"
            )
        if earlier:
            why += (
                f"; the last rollback restored step {view.last_good} and the trouble came back before a newer good "
                "checkpoint: that checkpoint holds the update that broke the run, so restore the one before it"
            )
        return Remedy(action="rollback", params=params, reasoning=why, evidence=evidence)

    def _broken(self, probe: float, again: bool, cause: str = "") -> str:
        """The reasoning of a rollback for broken weights (`cause`: what found them, if not the
        diagnosis after flagged steps)."""
        worse = cause or (
            f"{probe:.4g} on held-out data against {self.probe_baseline:.4g} at the last good checkpoint, though "
            "the flagged steps' updates were withheld: an earlier update broke the weights"
            if math.isfinite(probe)
            else f"{probe:.4g} on held-out data: the weights themselves are broken"
        )
        cut = (
            f"; the weights broke again within the replay, so cut the LR x{self.cfg.lr_cut:g} with it" if again else ""
        )
        return (
            f"the model scores {worse}, which skipping or an LR cut cannot repair; restore the last good "
            f"checkpoint at once and keep the data (it was not at fault){cut}"
        )

    def _diagnose(self, view: Any, sudden: bool) -> tuple[str, float] | None:
        """Bad data or a bad model? Megatron reruns the step; here the model is scored on a
        held-out batch and compared with its score at the last good checkpoint. After sudden
        findings (spikes, NaN), whose updates the gate withheld, held-out rows scoring worse mean
        the weights broke before the first of them (one update wrecked them: every batch since
        scores high); after a rising trend they mean the model drifts, which the LR cut answers."""
        probe = view.probe_loss()
        if probe is not None and not math.isfinite(probe):  # NaN weights: with or without held-out data
            return "broken", probe
        if self.probe_baseline is None or probe is None:
            return None
        if probe <= self.probe_baseline + max(0.1, 0.05 * self.probe_baseline):
            return "data", probe
        return ("broken", probe) if sudden else None

    def verify_end(self, view: Any) -> tuple[Finding, Remedy] | None:
        """Is the state a phase ends in sound? The held-out probe against the last good
        checkpoint's: broken when it is not finite, when it is worse (as the diagnosis measures
        worse) after instability since that checkpoint, or when it is worse by three times that
        with no finding at all (wrecked weights whose loss never spiked). Broken: roll back like a
        diagnosis of broken weights mid-run (the second time within the replay with an LR cut, at
        max_rollbacks a stop). None when sound, or when nothing can be compared."""
        if self.probe_baseline is None or (probe := view.probe_loss()) is None:
            return None
        margin = max(0.1, 0.05 * self.probe_baseline)
        unsettled = self.ladder.last_step > view.last_good  # instability since the last good checkpoint
        if math.isfinite(probe) and probe <= self.probe_baseline + (margin if unsettled else 3 * margin):
            return None
        f = Finding(
            rule="end",
            family="instability",
            step=view.step,
            evidence={
                "probe": probe,
                "baseline": self.probe_baseline,
                "last_good": view.last_good,
                "instability_since_last_good": unsettled,
            },
            summary=f"the phase ends at held-out loss {probe:.4g} against {self.probe_baseline:.4g} at the last "
            f"good checkpoint (step {view.last_good})",
            strength=1.0,
        )
        self.ladder.last_step = view.step
        cause = (
            f"{probe:.4g} on held-out data at the end of the phase against {self.probe_baseline:.4g} at the last "
            f"good checkpoint (step {view.last_good}), "
            + ("after instability since then" if unsettled else "with no finding: weights wrecked without a spike")
            + ", not a state to save as final"
        )
        return f, self._rollback(view, broken=probe, cause=cause)

    def _plateau(self, f: Finding, view: Any) -> Remedy:
        cfg = self.cfg.plateau
        target = view.lr_scale * cfg.lr_factor
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
        self.last_lr_change = f.step
        return Remedy(
            action="scale_lr",
            params={"factor": cfg.lr_factor},
            reasoning="the loss has stopped moving long before the planned end: a larger LR may get it out of "
            "the flat region (bounded by orchestrator.plateau.max_lr_scale)",
        )

    def quiet(self, step: int) -> Remedy | None:
        """Called every step: after a quiet window the ladder falls back to rung 0; after
        lr_restore_after quiet steps the LR the ladder cut is given back, x2 at a time, unless a
        restore was followed by new instability once already (then the cut was needed)."""
        if self.ladder.rung and step - self.ladder.last_step >= self.cfg.escalation_window:
            self.ladder = Ladder(last_step=self.ladder.last_step, rows=[])
        wait = self.cfg.lr_restore_after
        if self.last_restore >= 0 and self.ladder.last_step > self.last_restore:
            self.restore_failed, self.last_restore = True, -1
        if (
            self.lr_debt >= 1
            or not wait
            or self.restore_failed
            or step - self.ladder.last_step < wait
            or step - self.last_lr_change < wait
        ):
            return None
        factor = min(2.0, 1 / self.lr_debt)
        self.lr_debt *= factor
        self.last_lr_change = self.last_restore = step
        return Remedy(
            action="scale_lr",
            params={"factor": factor},
            reasoning=f"{wait} steps without instability since the LR was cut: give part of it back "
            "(if instability returns, the cut stays for the rest of the run)",
        )

    def shift(self, steps: int) -> None:
        """A rollback moved the step counter back by `steps`: move remembered steps with it, so
        cooldowns and quiet windows count the steps actually trained."""
        ladder = self.ladder
        ladder.recent = [s - steps for s in ladder.recent]
        ladder.last_step -= steps if ladder.last_step >= 0 else 0
        self.last_lr_change -= steps
        self.last_restore -= steps if self.last_restore >= 0 else 0
        self.last_broken -= steps if self.last_broken >= 0 else 0
        self.data.shift()

    # ------------------------------------------------------------------ confidence

    @staticmethod
    def confidence(strength: float, record: tuple[int, int]) -> float:
        recovered, judged = record
        return round(strength * (recovered + 3) / (judged + 4), 3)

    def state_dict(self) -> dict[str, Any]:
        return {
            "ladder": vars(self.ladder).copy(),
            "last_lr_change": self.last_lr_change,
            "lr_debt": self.lr_debt,
            "last_restore": self.last_restore,
            "restore_failed": self.restore_failed,
            "probe_baseline": self.probe_baseline,
            "last_broken": self.last_broken,
            "last_rollback_to": self.last_rollback_to,
            "data": self.data.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ladder = Ladder(**state["ladder"])
        for key in ("last_lr_change", "lr_debt", "last_restore", "restore_failed", "probe_baseline"):
            setattr(self, key, state[key])
        self.last_broken = state.get("last_broken", -1)
        self.last_rollback_to = state.get("last_rollback_to", -1)
        self.data.load_state_dict(state.get("data", {}))
