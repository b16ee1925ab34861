"""The instability ladder's answer to a spike in a phase's first steps (LossSpike's early bar:
orchestrator/monitors.py), a part of InstabilityLadder (ladder.py): so few steps are at stake that
it is answered at once, not climbed to."""

from __future__ import annotations

import math
from typing import Any

from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.remedies import Remedy


class EarlySpikes:
    """InstabilityLadder's early spikes (it holds the state and the methods named here)."""

    early_rollbacks: dict[str, list[float]]  # step -> [the loss rolled back from, unstable_at, broken_at before]
    unstable_at: int
    broken_at: int

    def _early_spike(self, f: Finding, view: Any) -> Remedy:
        """A spike in the phase's first steps (LossSpike's early bar), answered at once, since so few
        steps are at stake. The step's rows, scored one by one, explain it: bad data, left out (the
        LR stays). Else the weights are suspect (a bad update, a corrupted weight; the held-out
        probe may still beat the untouched weights, so a diagnosis would call it the data): roll
        back to the last good checkpoint, the phase's start most often, keeping the data. Watched
        instead, the wrecked weights trained on (debug, weights_noise@8:3: 13% worse at the end).
        After the update the weights cannot tell a hard batch from a wrecked model (a clean debug
        run on a 60 KB corpus jumped 0.84 nats at an epoch's last step, and one update later its
        rows scored under held-out ones, as wrecked weights' do), but the replay can: the same
        loss at the same step again is the data's, not a fault's (a note, and no second rollback)."""
        self.ladder.recent = []  # answered: the next climb needs as many findings
        ev = f.evidence
        rise = f"{ev['loss']:.4g} at step {f.step}, {ev['loss'] - ev['lowest']:.3g} nats above the phase's lowest"
        seen, unstable_at, broken_at = self.early_rollbacks.get(str(f.step), (math.nan, 0, 0))
        if abs(ev["loss"] - seen) <= 1e-3 * abs(seen):

            def cleared() -> None:  # no breakage after all: rows are judged again, a later one is a first
                self.unstable_at, self.broken_at = int(unstable_at), int(broken_at)

            return Remedy(
                action="none",
                reasoning=f"the loss jumped to {rise} in its first steps, as it did before the last rollback: the "
                "replay from sound weights met the same loss at the same step, so the step's data, not a fault, "
                "lifts it (a hard batch); training goes on",
                commit=cleared,
            )
        bad, evidence = ([], {}) if self.lr_suspect(f.step) else self.data.score(view, f.rows)
        if bad:
            why = (
                f"the loss jumped to {rise} in its first steps; scored one by one on these weights, {len(bad)} of "
                f"the step's {evidence['rows_scored']} rows lose more than {evidence['threshold']:.3f} (held-out "
                f"rows' median {evidence['reference_median']:.3f}): the data is to blame; leave them out, the LR stays"
            )
            return self._leave_out(bad, why, evidence)
        probe = view.probe_loss()
        scored = "no row of the step scores as an outlier" if evidence else "its rows were not scored"
        cause = (
            f"a loss of {rise} in its first steps, and {scored}: the weights are suspect"
            + ("" if probe is None else f" (held-out probe {probe:.4g})")
            + "; so few steps are at stake that replaying them costs less than training on from wrecked weights "
            "(a replay that meets the same loss again says it was the data)"
        )
        remedy = self._rollback(view, broken=math.nan if probe is None else probe, cause=cause, early=True)
        remedy.evidence = {**evidence, **remedy.evidence}
        if remedy.action == "rollback":
            applied = remedy.commit

            def commit() -> None:
                self.early_rollbacks[str(f.step)] = [ev["loss"], self.unstable_at, self.broken_at]
                applied()

            remedy.commit = commit
        return remedy
