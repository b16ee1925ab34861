"""The instability family's escalation ladder, a part of the Policy (policy.py):

    rung 0  skip the step (the update gate already withheld it on device); a loss spike's rows
            that score as outliers are left out with it (spikes.py)
    rung 1  cut the LR (x lr_cut)
    rung 2  roll back to the last good checkpoint, skip the rows behind the incident, cut the LR
    rung 3  save and stop with a clear message (max_rollbacks spent on one incident, or nothing
            to roll back to: a rollback never restores a checkpoint whose weights are the failed
            ones, every update since it withheld; _same_replay)

It climbs when `escalate_after` instability findings fall within `escalation_window` steps of
each other (skipping did not help), and falls back to rung 0 after a quiet window. Before the
first climb a held-out probe (diagnosis.py) tells bad data (leave its rows out, the LR stays) from
broken weights (roll back at once, keeping the data). A breakage is the LR's doing, and the rollback
cuts it decisively (x above_start.lr_factor, as a loss above its start gets), when it comes
back before the replay got clear of the last one, or when early in a phase it leaves the weights
worse than the untouched ones.

What a remedy changes in the policy (a rung climbed, a cut owed, a rollback spent) is in its `commit`,
run only when the orchestrator applies it: advice leaves the ladder where it was. The rollbacks of one
incident are counted, not a run's: an incident is over once the run trained past its last rollback's
step, then saved a good checkpoint and trained `outcome_after` steps without instability, or
`escalation_window` without (PaLM, arXiv 2204.02311, 5.1, answered each of its spikes on its own,
restarting ~100 steps before it; max_rollbacks bounds the answers to one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.attribution import DataAttribution
from trimtab.orchestrator.diagnosis import HeldOutDiagnosis
from trimtab.orchestrator.give_back import GiveBack
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.raised import PersonRaise
from trimtab.orchestrator.remedies import GAVE_UP, Remedy, lr_cut
from trimtab.orchestrator.spikes import EarlySpikes
from trimtab.orchestrator.too_high import OWED, TooHighLR


@dataclass
class Ladder:
    rung: int = 0
    recent: list[int] = field(default_factory=list)  # steps of findings since the last climb
    last_step: int = -1  # last finding
    rows: list[int] = field(default_factory=list)  # rows of the incident's flagged steps
    # the losses of those steps: any not finite, any finite (only NaN / inf ones: no finite score explains them)
    nan: bool = False
    finite: bool = False
    gradient_only: bool = True  # every finding so far a gradient-norm spike (rule grad): the loss never spiked
    spared: bool = False  # a climb of those answered by skipping, the LR kept (GRADIENT_ONLY)


@dataclass(frozen=True)
class Harmless:
    """A climb skipping answers, the LR kept, though the findings were many: the held-out probe found the
    weights sound and no row of the steps is to blame, so what the findings were says an LR cut, which
    slows every later update, answers nothing. The fields word the decision."""

    findings: str
    seen: str  # what the findings showed besides
    rows: str  # why no row is to blame
    verdict: str
    climbs: str  # what still climbs
    once: bool  # once an incident (Ladder.spared)


# Gradient-norm spikes alone, their updates withheld, the loss never spiked: the skipped updates did no
# harm, and a cut would be kept until lr_restore_after quiet steps for a few steps' spikes (debug-mod,
# grad_spike at steps 40-43: 4.23 with the cut against 4.07 with the orchestrator off; OLMo-core skips
# such steps and nothing more). Once an incident: as many spikes again within the window cut it.
GRADIENT_ONLY = Harmless(
    findings="gradient-norm spikes",
    seen="their updates withheld, but the loss never spiked, ",
    rows="no row of the steps scores as an outlier",
    verdict="the skipped updates did no harm",
    climbs="as many spikes again within the window cut it",
    once=True,
)
# Isolated NaN / inf losses (healthy steps trained between them) and no row NaN on its own: the fault
# follows neither the weights (they score as before, and the steps between trained on them at this LR)
# nor the data (attribution.py) (debug, a NaN loss every 10 steps: cut to x0.25 and rolled back, 4.43
# against 4.17 fault-free). NaN steps back to back (nothing trains) climb as ever: LR cut, rollback, stop.
ISOLATED_NAN = Harmless(
    findings="NaN / inf losses",
    seen="each with healthy steps between, but ",
    rows="no row is NaN on its own",
    verdict="neither the weights nor the data explain them, and an LR cut would only slow every later update",
    climbs="NaN losses back to back cut it",
    once=False,
)


class InstabilityLadder(EarlySpikes, TooHighLR, HeldOutDiagnosis, GiveBack, PersonRaise):
    """The Policy's instability family (it holds the state named here; an LR far too high: too_high.py;
    the held-out probe's judgements: diagnosis.py; the LR debt its cuts owe: give_back.py; a person's
    LR raise a rollback undoes: raised.py)."""

    cfg: OrchestratorConfig
    ladder: Ladder
    data: DataAttribution
    last_lr_change: int  # step of the last LR decision applied (cooldowns, grace periods)
    phase_start: int  # the step the current phase started after
    lr_too_high_at: int  # step of the last decisive LR cut: rows' losses are the model's for a while
    unstable_at: int  # step of the last LR cut or rollback (unsettled)
    rollbacks: int  # rollbacks of the open incident (0: none open)
    rollback_at: int  # the step the last of them was decided at (-1: none)
    broken_at: int  # ... when it was for broken weights (-1: none)
    last_rollback_to: int  # the checkpoint step the last ladder rollback restored (-1: none)
    updated_at: int  # the last step whose update was applied (core.py)
    closed_at: int  # the step the last incident with a rollback closed at (-1: none)
    # step (a string: JSON keys) -> [the loss an early spike rolled back from, unstable_at and broken_at before]
    early_rollbacks: dict[str, list[float]]

    def _instability(self, f: Finding, view: Any) -> Remedy:
        ladder, cfg = self.ladder, self.cfg
        if f.rule == "above_start":
            return self._lr_too_high(f, view)
        ladder.recent = [s for s in ladder.recent if f.step - s < cfg.escalation_window] + [f.step]
        ladder.last_step = f.step
        ladder.rows = sorted(set(ladder.rows) | set(f.rows))
        ladder.gradient_only = ladder.gradient_only and f.rule == "grad"
        if _nonfinite_loss(f):
            ladder.nan = True
        else:
            ladder.finite = True
        if (broken_weights := self._nan_weights(f, view)) is not None:  # diagnosis.py
            return broken_weights
        if f.evidence.get("early") and ladder.rung == 0:
            return self._early_spike(f, view)
        climb = len(ladder.recent) >= cfg.escalate_after
        if f.rule == "divergence" and ladder.rung == 0:
            climb = True  # a trend is not a one-off: skipping cannot fix it
        verdict = self._diagnose(view, sudden=f.rule != "divergence") if climb and ladder.rung == 0 else None
        if verdict and verdict[0] == "data" and not self.lr_suspect(f.step):
            remedy = self._data(view, verdict[1])
            if remedy is not None:
                return remedy
            harmless = self._harmless()
            if harmless is not None:
                return self._skip_harmless(harmless, verdict[1])
        if verdict and verdict[0] == "broken":
            early = min(ladder.recent) - self.phase_start < cfg.escalation_window
            ladder.recent = []  # the climb is answered (applied or advised): the next needs as many findings
            return self._rollback(view, broken=verdict[1], early=early)
        if not climb:
            if f.rule == "spike" and ladder.rung == 0:
                return self._lone_spike(f, view)
            return Remedy(action="skip_step", reasoning="")  # the orchestrator words it from what the gate did
        ladder.recent = []
        rung = ladder.rung + 1
        if rung == 1 and view.lr_scale * cfg.lr_cut < cfg.min_lr_scale:
            rung = 2  # the LR is already at its floor
        if rung == 1:
            return self._cut(f, view)
        return self._rollback(view)

    def _harmless(self) -> Harmless | None:
        """Which of the cases skipping answers with the LR kept, if any, the climb is (the probe
        found the weights sound and no row of the steps is to blame)."""
        ladder = self.ladder
        if ladder.gradient_only and not ladder.spared:
            return GRADIENT_ONLY
        if ladder.nan and not ladder.finite and _isolated(ladder.recent):
            return ISOLATED_NAN
        return None

    def _skip_harmless(self, case: Harmless, probe: float) -> Remedy:
        """Skip, the LR kept: an LR cut slows every later update and would answer nothing."""
        n = len(self.ladder.recent)
        self.ladder.recent = []  # the climb is answered (applied or advised)
        self.ladder.spared = self.ladder.spared or case.once
        return Remedy(
            action="skip_step",
            reasoning=f"{n} {case.findings} within {self.cfg.escalation_window} steps, {case.seen}the model still "
            f"scores {probe:.3f} on held-out data (against {self._against()}) and {case.rows}: {case.verdict}; skip "
            f"this one too and keep the LR ({case.climbs})",
        )

    def _cut(self, f: Finding, view: Any) -> Remedy:
        """Rung 1: the LR comes down (divergence's cut is never given back: a rising trend is the
        LR's doing). Not at the run's last step, where a cut would act on no step of it."""
        cfg = self.cfg
        if f.step >= view.total_steps:
            return Remedy(
                action="skip_step",
                reasoning="no LR cut at the run's last step: it would change no step of this run and stay in the "
                "final checkpoint, carried into any extension of the run; the end check scores the weights "
                "before they are saved as final (broken, they are rolled back and the steps trained again)",
            )
        factor = cfg.divergence.lr_factor if f.rule == "divergence" else cfg.lr_cut
        lr_scale = view.lr_scale

        def commit() -> None:
            self.ladder.rung, self.last_lr_change = 1, f.step
            self.unstable_at = f.step
            if f.rule != "divergence":
                self._owe(factor, lr_scale)

        return Remedy(
            action="scale_lr",
            params={"factor": factor},
            reasoning=f"{cfg.escalate_after} instability findings within {cfg.escalation_window} steps: "
            "skipping alone does not help, so the LR comes down"
            if f.rule != "divergence"
            else "the loss trends upward: a lower LR is the standard remedy for divergence",
            commit=commit,
        )

    def _data(self, view: Any, probe: float) -> Remedy | None:
        """The model still scores held-out data as well as at the last good checkpoint, so the bad
        steps' data is suspect: leave out the rows that score as outliers. None when no row does:
        the data is not to blame after all (a NaN forward, a numerically unstable step, a rising
        trend), so the rows stay in training and the ladder climbs to its LR cut."""
        bad, evidence = self._score_incident(view)
        if not bad:
            return None
        median = evidence["reference_median"]
        lose = (
            "score NaN or inf on their own, as the steps' losses were (the other rows finite)"
            if evidence["nonfinite_losses"]
            else f"lose more than {evidence['threshold']:.3f} (held-out rows' median {median:.3f})"
        )
        why = (
            f"the model still scores {probe:.3f} on held-out data (against {self._against()}), "
            f"so the bad steps' data is suspect; scored one by one on these weights, {len(bad)} of the "
            f"{evidence['rows_scored']} rows since the first bad step {lose}: leave them out; the LR stays"
        )
        self.ladder.recent = []
        return self._leave_out(bad, why, evidence)

    def _leave_out(self, bad: list[int], why: str, evidence: dict[str, Any]) -> Remedy:
        """Leave out the bad rows; once applied, the incident's rows are answered and the next
        steps' rows watched (a bad stretch rarely ends where it was caught)."""

        def commit() -> None:
            self.ladder.rows, self.ladder.nan, self.ladder.finite = [], False, False
            self.data.watch_more()

        return Remedy(action="skip_data", params={"rows": bad}, reasoning=why, evidence=evidence, commit=commit)

    def _score_incident(self, view: Any) -> tuple[list[int], dict[str, Any]]:
        """Every row since the incident's first flagged step (a bad step under the ceiling too),
        scored; after NaN / inf losses alone, only a row not finite on its own is to blame (a
        finite score does not explain them: a NaN that does not repeat is not the rows')."""
        first = min(self.ladder.recent, default=self.ladder.last_step)
        rows = sorted(set(self.ladder.rows) | set(self.data.since(first)))
        return self.data.score(view, rows, nonfinite=self.ladder.nan and not self.ladder.finite)

    def _rollback(self, view: Any, broken: float | None = None, cause: str = "", early: bool = False) -> Remedy:
        """Rung 2 (or straight there when the probe found the weights broken): restore the last
        good checkpoint; rung 3, stop, when none is left or this incident's rollbacks are spent.
        `early`: the incident began in the phase's first escalation_window steps."""
        if self.rollbacks >= self.cfg.max_rollbacks or not view.has_good_checkpoint:
            return self._give_up(view)
        step, suspect = self.ladder.last_step, self.lr_suspect(self.ladder.last_step)
        scored = broken is None and not suspect
        rows, evidence = self._score_incident(view) if scored else ([], {})
        params: dict[str, Any] = {"to": "last_good", "skip_rows": rows}
        earlier = broken is None and self._checkpoint_broke(view)
        if earlier:
            params["to"] = view.last_good - 1
        target = view.last_good - 1 if earlier else view.last_good
        same = self._same_replay(view, target, rows)
        if same is not None:
            if same.get("to") is None:  # nothing before it to restore
                return self._give_up(view, same["why"])
            target = params["to"] = same["to"]
            evidence = {**evidence, "last_update": self.updated_at}
        again = broken is not None and self.broken_at >= 0
        high = broken is not None and early and self._worse_than_untouched(broken)
        cut = lr_cut(self.cfg.above_start.lr_factor, view, self.cfg) if again or high else None
        undo = self._undo_raise(view, step) if cut is None else None  # raised.py
        if undo is not None:
            cut = undo[0]
        if cut is not None:
            params["lr_factor"] = cut
        if broken is not None:
            why = self._broken(broken, again, high, None if undo else cut, cause)
        else:
            why = (
                "instability persists after skipping and an LR cut: restore the last good checkpoint (the LR "
                f"stays cut) and {_data_kept(rows, evidence, suspect)}"
            )
        if earlier:
            why += (
                f"; the last rollback restored step {view.last_good} and the trouble came back before a newer good "
                "checkpoint: that checkpoint holds the update that broke the run, so restore the one before it"
            )
        if same is not None:
            why += same["why"]
        if undo is not None:
            why += undo[1]
        lr_scale = view.lr_scale

        def commit() -> None:
            self._rolled_back(step, target, broken=broken is not None)
            if cut is not None:
                self.lr_too_high_at = step
                # given back once quiet, on probation: a recurrence may be the replayed data's, and weights
                # early in a phase worse than its untouched ones may be a young model's score on held-out text
                # unlike its training rows, not an LR far too high: owed part way, as above_start's (too_high.py)
                self._owe(cut, lr_scale, ceiling=lr_scale * math.sqrt(cut) if high else math.inf)

        return Remedy(action="rollback", params=params, reasoning=why, evidence=evidence, commit=commit)

    def _checkpoint_broke(self, view: Any) -> bool:
        """The last rollback restored this same checkpoint and the trouble came back before the replay saved a
        newer good one: the checkpoint itself holds the update that broke the run (a spike shows on the step
        after the update that caused it, and the checkpoint was written between them); go one further back.
        (Broken weights found by the probe have their own answer to a recurrence: the LR cut, _rollback.)"""
        return self.last_rollback_to == view.last_good >= 1 and view.has_checkpoint(view.last_good - 1)

    def _same_replay(self, view: Any, target: int, rows: list[int]) -> dict[str, Any] | None:
        """A rollback to `target` that would replay exactly what failed: every update since it was
        withheld (its weights are the ones the flagged steps met) and no row is left out, so the replay
        meets the same rows with the same weights, and the LR acts on no withheld update (debug at
        train.batch_tokens 1024, checkpoint.every 10: spikes at 11-16 withheld, rolled back to step 10:
        the same six spikes, "not recovered", before a second rollback went further back). The newest
        checkpoint from before the last applied update is restored instead ({"to": step, "why": wording});
        with none, {"why": wording} alone (the ladder's next rung: stop). None: the replay differs, or may:
        a non-finite loss in the incident may come from weights something other than an update broke (a
        fault, a flipped bit: weights_nan after step 6's checkpoint, updates 7-8 withheld), which the
        checkpoint does not hold."""
        if rows or target < self.updated_at or self.ladder.nan:
            return None
        why = (
            f"; a rollback to step {target} would replay exactly what failed (no update was applied after step "
            f"{self.updated_at}: its weights are the ones "
        )
        before = self.updated_at - 1
        if before < 0 or not view.has_checkpoint(before):
            return {
                "why": why.removeprefix("; ")
                + "the flagged steps met, and no checkpoint from before that update is left)"
            }
        return {"to": before, "why": why + f"the flagged steps met): restore the newest at or before step {before}"}

    def _rolled_back(self, step: int, target: int, broken: bool) -> None:
        """A rollback decided at `step` is applied: the ladder starts over, the incident spends one."""
        self.ladder = Ladder(last_step=self.ladder.last_step)
        self.last_lr_change, self.last_rollback_to, self.unstable_at = step, target, step
        self.rollbacks, self.rollback_at = self.rollbacks + 1, step
        if broken:
            self.broken_at = step

    def _give_up(self, view: Any, reason: str = "") -> Remedy:
        """Rung 3: no good checkpoint, this incident's rollbacks are spent, or `reason`."""
        window, most = self.cfg.escalation_window, self.cfg.max_rollbacks
        reason = reason or (
            "no good checkpoint to roll back to"
            if not view.has_good_checkpoint
            else f"{self.rollbacks} rollbacks used on one incident (orchestrator.max_rollbacks={most} per incident: "
            "a rollback counts until the run trains past its step and then saves a good checkpoint or trains "
            f"{window} steps without instability)"
        )

        def commit() -> None:
            self.ladder.rung = 3

        return Remedy(
            action="stop",
            params={
                "reason": f"training is unstable and cannot be healed: {reason}; see decisions.jsonl, "
                "lower optim.lr or check the data",
                "exit_code": GAVE_UP,
            },
            reasoning=f"every rung of the ladder was tried ({reason}); saving and stopping is safer than training on",
            commit=commit,
        )

    def _broken(self, probe: float, again: bool, high: bool, cut: float | None, cause: str = "") -> str:
        """The reasoning of a rollback for broken weights (`cause`: what found them, if not the
        diagnosis after flagged steps)."""
        worse = cause or (
            f"{probe:.4g} on held-out data against {self._against()}, though "
            "the flagged steps' updates were withheld: an earlier update broke the weights"
            if math.isfinite(probe)
            else f"{probe:.4g} on held-out data: the weights themselves are broken"
        )
        why = (
            f"the model scores {worse}, which skipping or an LR cut cannot repair; restore the last good "
            "checkpoint at once and keep the data (it was not at fault)"
        )
        if high:
            why += (
                f"; this early in the phase the weights score worse than its untouched ones ({self.start_probe:.4g}): "
                "an update at an LR far too high wrecked them (as a loss above its start says, rule above_start)"
            )
        elif again:
            why += (
                f"; the weights broke again before the replay got clear of the last breakage (step {self.broken_at}): "
                "the same steps at this LR break them, so the LR is too high"
            )
        if cut is not None:
            kept = OWED if high else "given back only after orchestrator.lr_restore_after quiet steps"
            why += f": cut it x{cut:.3g} with the rollback, {kept}"
        elif again or high:
            why += f", but it is at its floor (orchestrator.min_lr_scale={self.cfg.min_lr_scale:g}): lower optim.lr"
        return why

    def quiet(self, step: int, view: Any) -> Remedy | None:
        """Every step: after a quiet window the ladder falls back to rung 0 and the incident may be over
        (_clear); a cut LR is given back once quiet (give_back.py)."""
        if self.ladder.rung and step - self.ladder.last_step >= self.cfg.escalation_window:
            self.ladder = Ladder(last_step=self.ladder.last_step, rows=[])
        self._clear(step, view)
        return self._give_back(step, view)  # give_back.py

    def unsettled(self, step: int) -> bool:
        """Instability skipping did not answer (an LR cut, a rollback) within the last
        escalation_window steps: the model, not a row, explains a high loss then
        (orchestrator/outliers.py judges no row). A spike alone does not count: bad rows make
        those, and the rows rule must see them (bad data spread thinly spikes every few steps)."""
        return step - self.unstable_at < self.cfg.escalation_window

    def lr_suspect(self, step: int) -> bool:
        """The LR was found far too high within the last escalation_window steps: high-loss rows
        are the model's doing, not bad data (no row is left out for them)."""
        return step - self.lr_too_high_at < self.cfg.escalation_window

    def _clear(self, step: int, view: Any) -> None:
        """The open incident is over once the run trained past the step its last rollback was decided at,
        then saved a good checkpoint and trained outcome_after steps without instability (last_step is
        shifted: the replay's count) or escalation_window without: a later fault is a new incident. Any good
        checkpoint past it closed it: one 1-2 steps on, a cause that persists opened incident after incident."""
        if self.rollback_at < 0 or step <= self.rollback_at:
            return
        healthy = view.last_good > self.rollback_at and step - self.ladder.last_step >= self.cfg.outcome_after
        if healthy or step - self.ladder.last_step >= self.cfg.escalation_window:
            self.rollbacks, self.rollback_at, self.broken_at, self.last_rollback_to = 0, -1, -1, -1
            self.closed_at = step

    def counted(self, remedy: Remedy) -> Remedy:
        """A ladder rollback says which of its incident's it is: max_rollbacks bounds one incident's,
        so a run may take more, and the journal names the incident each belongs to."""
        n, most = self.rollbacks + 1, self.cfg.max_rollbacks
        remedy.evidence = {**remedy.evidence, "incident_rollback": n, "max_rollbacks": most}
        new = ""
        if n == 1 and self.closed_at >= 0:
            new = (
                f"; a new incident: the last closed at step {self.closed_at}, once its replay trained past its "
                f"rollback and then saved a good checkpoint or trained {self.cfg.escalation_window} steps without "
                "instability"
            )
        remedy.reasoning += f" (rollback {n} of this incident's orchestrator.max_rollbacks={most}{new})"
        return remedy


def _nonfinite_loss(f: Finding) -> bool:
    """A NaN / inf loss (rule nonfinite; an inf gradient norm alone leaves the loss finite)."""
    return f.rule == "nonfinite" and not math.isfinite(f.evidence.get("loss", math.nan))


def _isolated(steps: list[int]) -> bool:
    """No two of the findings' steps back to back: a step trained between each two."""
    return all(b - a > 1 for a, b in zip(steps, steps[1:], strict=False))


def _data_kept(rows: list[int], evidence: dict[str, Any], suspect: bool) -> str:
    """What a ladder rollback does with the incident's rows."""
    if rows:
        return f"leave out the {len(rows)} rows of the bad steps that score as outliers"
    if suspect:
        return "keep the data: the LR was found far too high lately, so rows that score high are the model's doing"
    if evidence.get("rows_scored"):
        return "keep the data: no row of the bad steps scores as an outlier"
    return "keep the data: this phase's rows (RL prompts, DPO pairs) have no loss of their own to score"
