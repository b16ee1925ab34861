"""The rule `rerun`: a step the update gate flagged was computed again from the same weights on the
same rows (training/rerun.py). A different result means the first computation was wrong, a
transient fault: the re-run's update stood in for it, and this journals it (family `hardware`). The
same result again is no fault of the machine: the verdict joins the evidence of the step's own
findings (a spike, a non-finite gradient), which the orchestrator decides as ever.

Under DDP the verdict names the rank whose own gradient differed; each rank's transient faults are
counted over the run (checkpointed), and one named `orchestrator.rerun.suspect_after` times is a
suspect device: named in the journal, and with `orchestrator.rerun.exclude` in an elastic job of
several nodes, its node is left out as a straggler's is.
"""

from __future__ import annotations

from typing import Any

from trimtab.orchestrator.monitors import Finding


def rerun_finding(
    step: int,
    rerun: dict[str, Any],
    reproducible: dict[int, dict[str, Any]],
    faults: dict[str, int],
    suspect_after: int,
) -> Finding | None:
    """The finding for a transient verdict, its ranks' counts in `faults` (rank -> transient faults
    so far); a reproducible verdict goes into `reproducible` by step."""
    if rerun["verdict"] != "transient":
        reproducible[step] = rerun
        return None
    (loss, again), (norm, norm_again) = rerun["loss"], rerun["grad_norm"]
    ranks = rerun.get("ranks", [])
    for rank in ranks:
        faults[str(rank)] = faults.get(str(rank), 0) + 1
    suspects = [rank for rank in ranks if faults[str(rank)] >= suspect_after]
    who = f"; rank {', '.join(map(str, ranks))} computed it wrong" if ranks else ""
    if suspects:
        counts = ", ".join(f"rank {r} {faults[str(r)]} times" for r in suspects)
        who += f" ({counts} in this run: a suspect device)"
    return Finding(
        rule="rerun",
        family="hardware",
        step=step,
        evidence={**rerun, "faults_by_rank": dict(faults), "suspects": suspects},
        summary=f"step {step} computed twice from the same state: loss {loss:.4g} then {again:.4g}, gradient "
        f"norm {norm:.4g} then {norm_again:.4g}: a transient fault{who}",
        strength=1.0,
    )
