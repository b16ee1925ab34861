"""The instability ladder's held-out probe, a part of InstabilityLadder (ladder.py): the model
scored on held-out rows and judged against a reference (the last good checkpoint's score, or calm
weights' since the phase's start). Sound weights put the blame on the data, worse ones on the
weights (Megatron-LM reruns the step to tell them apart; the probe costs one forward). At a phase's
end it decides whether the state is fit to be saved as final (verify_end)."""

from __future__ import annotations

import math
from typing import Any

from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.remedies import Remedy

# held-out loss within this share of the reference (or 0.1 nats): the weights are sound, the data is
# suspect. The probe scores the same rows each time, so it moves only with the weights; at 5% weights
# wrecked at step 30 (5.55 against 5.31) read as sound, and the ladder left out clean rows and
# withheld every update for 90 steps (+33%, against +4.5% with the orchestrator off).
DATA_MARGIN = 0.02
# held-out loss above a reference by this share (or 0.1 nats) is worse: weights broken, not noise
WORSE_SHARE = 0.05


def margin(reference: float, share: float) -> float:
    """How far a held-out loss may move from `reference` before it counts: `share` of it, at least 0.1 nats
    (a small reference's share is below the probe's noise)."""
    return max(0.1, share * reference)


class HeldOutDiagnosis:
    """InstabilityLadder's probe judgements (it holds the state and the methods named here)."""

    probe_baseline: float | None  # held-out loss at the last good checkpoint
    start_probe: float | None  # held-out loss of the phase's untouched weights
    fresh_probe: float | None  # ... of calm weights since, before a good checkpoint is measured
    # step (a string: JSON keys) -> [the probe an end check with no finding rolled back from, unstable_at and
    # broken_at before]
    end_rollbacks: dict[str, list[float]]

    def _worse_than_untouched(self, probe: float) -> bool:
        """The held-out probe worse than the phase's untouched weights scored (as the diagnosis
        measures worse)."""
        start = self.start_probe
        return start is not None and math.isfinite(probe) and probe > start + margin(start, WORSE_SHARE)

    def reference(self) -> float | None:
        """The held-out loss a probe is judged against: the last good checkpoint's, or one of calm
        weights trained since the phase's start where that is lower (core.py _fresh_reference)."""
        if self.probe_baseline is None or self.fresh_probe is None or not math.isfinite(self.fresh_probe):
            return self.probe_baseline
        return min(self.probe_baseline, self.fresh_probe)

    def _against(self) -> str:
        """The reference named in a diagnosis's reasoning."""
        ref = self.reference()
        if ref == self.probe_baseline:
            return f"{ref:.4g} at the last good checkpoint"
        return f"{ref:.4g} of the weights trained since the phase's start, before its first checkpoint"

    def _diagnose(self, view: Any, sudden: bool) -> tuple[str, float] | None:
        """Bad data or a bad model? Megatron reruns the step; here the model is scored on a
        held-out batch and compared with its score at the last good checkpoint. After sudden
        findings (spikes, NaN), whose updates the gate withheld, held-out rows scoring worse mean
        the weights broke before the first of them (one update wrecked them: every batch since
        scores high); after a rising trend they mean the model drifts, which the LR cut answers."""
        probe = view.probe_loss()
        if probe is not None and not math.isfinite(probe):  # NaN weights: with or without held-out data
            return "broken", probe
        if self.reference() is None or probe is None:
            return None
        if self.sound(probe):
            return "data", probe
        return ("broken", probe) if sudden else None

    def _nan_weights(self, f: Finding, view: Any) -> Remedy | None:
        """A non-finite step (rule nonfinite): are the weights (or the optimizer's moments) themselves not
        finite? No skipped step heals those: roll back at once to the last good checkpoint (its weights
        finite). Debug, auto, weights_nan@15: two skip_steps "not recovered" (15, 16) came before the
        diagnosis's rollback at 17; debug, advise, weights_nan@10, `ctl mode auto` at step 19: the NaN
        updates applied in advise left NaN weights. One fused host read (RunView.weights_finite: every rank
        asks and all decide alike), on non-finite steps only; finite, a bad batch's NaN skips as before."""
        if f.rule != "nonfinite" or view.weights_finite():
            return None
        self.ladder.recent = []  # answered: the next climb needs as many findings
        cause = (
            "NaN on any data: a weight or an optimizer moment is not finite (a fault, a flipped bit, or a "
            "non-finite update applied while nothing withheld updates: orchestrator mode advise or off)"
        )
        return self._rollback(view, broken=math.nan, cause=cause)

    def sound(self, probe: float | None) -> bool:
        """Whether a held-out probe shows sound weights: finite and within the diagnosis's margin of
        the reference (what _diagnose reads as "the data's, not the model's"). False when nothing
        can be compared (no held-out data: RL, DPO)."""
        reference = self.reference()
        if reference is None or probe is None or not math.isfinite(probe):
            return False
        return probe <= reference + margin(reference, DATA_MARGIN)

    def learned(self, probe: float | None) -> bool:
        """Sound, and better than the phase's untouched weights by the same margin: weights wrecked
        in a phase's first steps score no worse than those (core.py: _fresh_reference), so against
        them alone soundness says nothing of a checkpoint (core.py: healthy)."""
        start = self.start_probe
        return self.sound(probe) and (start is None or probe < start - margin(start, DATA_MARGIN))

    def verify_end(self, view: Any) -> tuple[Finding, Remedy] | None:
        """Is the state a phase ends in sound? The held-out probe against the last good
        checkpoint's: broken when it is not finite, when it is worse (as the diagnosis measures
        worse) after instability since that checkpoint, or when it is worse by three times that
        with no finding at all (wrecked weights whose loss never spiked). Broken: roll back like a
        diagnosis of broken weights mid-run (the second time within the replay with an LR cut, at
        max_rollbacks a stop). The replay of a rollback with no finding that ends at the same probe is
        kept, with a note (_replayed_end). None when sound, or when nothing can be compared."""
        if self.probe_baseline is None or (probe := view.probe_loss()) is None:
            return None
        worse = margin(self.probe_baseline, WORSE_SHARE)
        unsettled = self.ladder.last_step > view.last_good  # instability since the last good checkpoint
        if math.isfinite(probe) and probe <= self.probe_baseline + (worse if unsettled else 3 * worse):
            return None
        seen = None if unsettled else self.end_rollbacks.get(str(view.step))
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
        if seen is not None and math.isfinite(probe) and abs(probe - seen[0]) <= margin(seen[0], DATA_MARGIN):
            return f, self._replayed_end(probe, seen)
        self.ladder.last_step = view.step
        cause = (
            f"{probe:.4g} on held-out data at the end of the phase against {self.probe_baseline:.4g} at the last "
            f"good checkpoint (step {view.last_good}), "
            + ("after instability since then" if unsettled else "with no finding: weights wrecked without a spike")
            + ", not a state to save as final"
        )
        remedy = self._rollback(view, broken=probe, cause=cause)
        if remedy.action == "rollback" and not unsettled:
            applied = remedy.commit

            def commit() -> None:
                self.end_rollbacks[str(view.step)] = [probe, self.unstable_at, self.broken_at]
                applied()

            remedy.commit = commit
        return f, remedy

    def _replayed_end(self, probe: float, seen: list[float]) -> Remedy:
        """The replay after an end rollback with no finding ended where the first pass did: what the
        data and the schedule make of these weights (a held-out set unlike the training rows, rising
        while the training loss falls), not a transient fault's wreck, which a replay leaves behind.
        A second rollback cut the LR x0.1 for weights that were never broken: a debug run on two text
        files trained its 20 steps three times, the last at a tenth of the LR (training loss 5.55 against
        4.47; its held-out text, unlike the training rows, 6.23 against 7.78: less learned, less unlike).
        Same: within the diagnosis's margin of it (DATA_MARGIN; a replay on a GPU is not bit for bit)."""
        unstable_at, broken_at = seen[1], seen[2]

        def cleared() -> None:  # no breakage after all: the ladder's state as before that rollback
            self.unstable_at, self.broken_at = int(unstable_at), int(broken_at)

        return Remedy(
            action="none",
            reasoning=f"the replay from the last good checkpoint ended at held-out loss {probe:.4g} again "
            f"({seen[0]:.4g} before the rollback), with no finding: the data and the schedule lead there, not a "
            "fault; the state is kept as final (a held-out set unlike the training data scores so)",
            commit=cleared,
        )
