"""A long stretch of fully row-gated steps, replayed on clean rows once it ends (the withheld guard's, withheld.py).

A step whose every row the row gate left out (training/row_gate.py) trains on nothing: its update is withheld
and lost, and make_up (make_up.py) pays at most `make_up.max_fraction` of the phase back, at the schedule's
tail where the LR is low. Debug, 200 steps, `bad_batch@25:25` (every row of steps 25-49 gated): 25 updates
lost at the schedule's peak, 20 made up at its end, val +2.1% / +2.0% / +0.9% over clean (seeds 1234 / 1 / 2).
So when a stretch of at least REPLAY_SHARE of a window (`orchestrator.withheld_window`: 8 of 20) of such steps
ends, at the first step that trains on mostly clean rows again, the run is rolled back to the newest
checkpoint at or before the step before the stretch with the stretch's gated rows left out (named in
skip_rows: the row gate's own skip_data may have fallen to advice, outliers.py, and not reached the loader),
the LR kept: the replay trains those steps on the clean rows that follow (+1.6% / +0.8% / -0.0%, 50 steps
re-done, none to make up). Not where that checkpoint lies so far back that the replay would train more than
REDO steps again per update it regains (the make-up is cheaper there). Never during a stretch (it may be
garbage to the end: the garbage stop takes that, withheld.py), never for a shorter one (bad_batch@60:4,
bad_data_warmup's 4 steps: the make-up pays them), and once per stretch: a stretch that starts before the
replayed one's end is not replayed again (a replay meets garbage again only where the data is garbage past
the rows left out).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trimtab.checkpoint import dir_step, list_checkpoints
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.remedies import Remedy

REDO = 4  # the most steps a replay trains again per update it regains (8 updates for 23 steps gained, below)
STRENGTH = 0.9  # a count, not a threshold on noise: every row of those steps was gated
# of the window: the fewest fully gated steps worth a replay (debug, 120 steps, bad_batch@15:N, seeds 1234 / 1 / 2,
# val over clean with / without: N=8 -0.7 / +1.3 / -0.3% against +0.8 / +1.8 / +0.4%, 23 steps re-done; N=5
# +0.3 / +0.6 / +0.1% against +1.1 / +0.4 / +0.5%, 20 re-done: mixed, so not replayed)
REPLAY_SHARE = 0.4


def replay_finding(s: dict[str, Any], step: int, window: int, rule: str) -> Finding | None:
    """The `data` finding that replays the ended stretch `s` (withheld.py _extend) at `step`, its first step
    on mostly clean rows; None when too few of its steps were fully gated or most of its rows were not."""
    full, rows = s.get("full", 0), sorted(set(s.get("out", [])))
    if full < REPLAY_SHARE * window or not rows or 10 * s["gated"] < 9 * s["rows"]:  # withheld.GARBAGE_SHARE
        return None
    steps = f"{s['first']}-{s['last']}"
    evidence = {"replay": steps, "to": s["first"] - 1, "fully_gated": full, "stretch": s["steps"]}
    evidence |= {"rows_seen": s["rows"], "rows_gated": s["gated"], "skip_rows": rows, "window": window}
    return Finding(
        rule=rule,
        family="data",
        step=step,
        evidence=evidence,
        summary=f"the {s['steps']} steps {steps} trained on nothing (every row garbage, left out)",
        strength=STRENGTH,
    )


def replay_remedy(policy: Any, f: Finding, view: Any) -> Remedy:
    """Roll back to the newest checkpoint at or before the step before the stretch, its gated rows left out, the
    LR kept; with none there, or one so far back that the replay costs more than REDO steps an update, the make-up
    pays what it can (a note). `policy`: the InstabilityLadder (its _rolled_back)."""
    ev, step = f.evidence, f.step
    target = ev["to"]
    lost = f"the {ev['stretch']} steps {ev['replay']} trained on nothing: their {ev['rows_gated']:,} rows were garbage"
    if not view.has_checkpoint(target):
        return Remedy(action="none", reasoning=f"{lost}, and no checkpoint at or before step {target} to replay from")
    restored = _restored(view, target)
    if restored is not None and step - restored > REDO * ev["fully_gated"]:  # checkpoints far apart
        f.summary += f": not replayed (from step {restored}: {step - restored} steps for {ev['fully_gated']} updates)"
        return Remedy(
            action="none",
            reasoning=f"{lost}; a replay from step {restored}, the newest checkpoint at or before step {target}, would "
            f"train {step - restored} steps again for {ev['fully_gated']} updates (more than {REDO}x): the make-up "
            "pays them for less (orchestrator.make_up.max_fraction)",
        )
    f.summary += ": replayed" + (f" from step {restored}" if restored is not None else "") + " on clean rows"
    return Remedy(
        action="rollback",
        params={"to": target, "skip_rows": ev["skip_rows"]},  # no lr_factor: the LR is kept (1.0 is refused)
        reasoning=f"{lost} (left out by the row gate), so their updates were lost at the LR the schedule gave them, "
        "more than the make-up pays back at its tail (orchestrator.make_up.max_fraction): restore the newest "
        f"checkpoint at or before step {target} and train those steps again on the clean rows that follow, the "
        "garbage rows left out and the LR kept; once per stretch",
        evidence={"to": target},
        commit=lambda: policy._rolled_back(step, target, broken=False),
    )


def _restored(view: Any, target: int) -> int | None:
    """The step of the newest checkpoint at or before `target` (the rollback's, unless it fails to load)."""
    run_dir = getattr(view, "run_dir", None)
    steps = [dir_step(p) for p in list_checkpoints(Path(run_dir))] if run_dir else []
    return max((s for s in steps if s <= target), default=None)
