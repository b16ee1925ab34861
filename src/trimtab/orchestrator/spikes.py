"""The instability ladder's answers to a loss spike before it climbs, a part of InstabilityLadder
(ladder.py): one in a phase's first steps (LossSpike's early bar: orchestrator/loss_spike.py) is
answered at once, so few steps are at stake; a lone one later has its rows scored."""

from __future__ import annotations

import math
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.remedies import Remedy


class EarlySpikes:
    """InstabilityLadder's early and lone spikes (it holds the state and the methods named here)."""

    cfg: OrchestratorConfig
    early_rollbacks: dict[str, list[float]]  # step -> [the loss rolled back from, unstable_at, broken_at before]
    unstable_at: int
    broken_at: int

    def _lone_spike(self, f: Finding, view: Any) -> Remedy:
        """A loss spike below the climb: the update gate withheld its update, so the weights are
        those that scored the steps before well, and the step's rows are what changed. They are
        scored one by one against held-out rows (attribution.py); the ones far above are left
        out with the skip, and the next steps' rows watched, since a bad stretch rarely ends on
        its first step. Skipped alone, such rows came back in the next epoch, and so did the
        stretch's rows whose steps stayed under the ceiling (healing benchmark, bad_rows@60:8,
        a quarter of 8 steps' rows: the spikes at 60 and 61 skipped, 62-67 trained, 26 of the
        70 garbage rows named when they came round again). Not scored: a spike whose re-run
        differed (a transient fault's: transient.py), one while the model is unsettled or the
        LR suspect (rows then score high for the model's sake), or a step the watch scores. One
        row must stand out by the rows rule's bar (a hard row of text stays under it) for the data
        to be blamed: one spike is less evidence than the climb the incident's rows are scored at
        otherwise; then the step's rows are judged by orchestrator.data's bar, as a climb's are."""
        skip = Remedy(action="skip_step", reasoning="")  # the orchestrator words it from what the gate did
        rerun = f.evidence.get("rerun") or {}
        if (
            not f.rows
            or rerun.get("verdict") == "transient"
            or self.unsettled(f.step)
            or self.lr_suspect(f.step)
            or f.step <= self.data.watch_until
        ):
            return skip
        # the rows rule's bar (orchestrator.rows.min_gap) to blame the data: one spike is less
        # evidence than a climb; blamed, its rows are judged as a climb's (at rows.min_gap alone, a
        # stretch's first step early in training, its garbage closer to the text, kept 17 of 32)
        bad, evidence = self.data.score(view, f.rows, gate=self.cfg.rows.min_gap)
        if not bad:
            return skip
        loss = f.evidence.get("loss")
        why = (
            f"the loss spiked{'' if loss is None else f' to {loss:.4g}'} on weights that scored the steps before it "
            f"well; scored one by one, {len(bad)} of the step's {evidence['rows_scored']} rows lose more than "
            f"{evidence['threshold']:.3f} (held-out rows' median {evidence['reference_median']:.3f}; one above "
            f"{evidence['gate']:.3f} blames the data): leave them out and watch the next steps' rows, the LR stays"
        )
        return self._leave_out(bad, why, evidence)

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
