"""The rule `rerun`: a step the update gate flagged was computed again from the same weights on the
same rows (training/rerun.py). A different result means the first computation was wrong, a
transient fault: the re-run's update stood in for it, and this journals it (family `hardware`). The
same result again is no fault of the machine: the verdict joins the evidence of the step's own
findings (a spike, a non-finite gradient), which the orchestrator decides as ever.
"""

from __future__ import annotations

from typing import Any

from trimtab.orchestrator.monitors import Finding


def rerun_finding(step: int, rerun: dict[str, Any], reproducible: dict[int, dict[str, Any]]) -> Finding | None:
    """The finding for a transient verdict; a reproducible one goes into `reproducible` by step."""
    if rerun["verdict"] != "transient":
        reproducible[step] = rerun
        return None
    (loss, again), (norm, norm_again) = rerun["loss"], rerun["grad_norm"]
    return Finding(
        rule="rerun",
        family="hardware",
        step=step,
        evidence=rerun,
        summary=f"step {step} computed twice from the same state: loss {loss:.4g} then {again:.4g}, gradient "
        f"norm {norm:.4g} then {norm_again:.4g}: a transient fault",
        strength=1.0,
    )
