"""A resume that fell back past corrupt checkpoints, journaled: rule `checkpoint_fallback`, action
`resume` (done before the decision, as a restart's: orchestrator/restarts.py), with which
checkpoints were refused and why (verify's error: the file, truncated or corrupt), where each was
kept (checkpoints/corrupt/), and the steps trained again. It was said on the console alone, so the
journal, `trimtab runs` and the report read a run that re-trained those steps as one without a fault.
"""

from __future__ import annotations

from typing import Any

from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.remedies import Remedy, ranks
from trimtab.training.resume import short_reason


def fallback_finding(record: dict[str, Any], step: int, world: int) -> Finding:
    """The finding of training/resume.py's record (take_fallback) for the session resumed at `step`."""
    refused = record["refused"]
    newest = max(int(r["step"]) for r in refused)
    evidence = {
        "kind": "corrupt_checkpoints",
        "refused": refused,
        "newest_step": newest,
        "resumed_step": step,
        "steps_lost": max(0, newest - step),  # at least: the run may have trained past its newest save
        "world_before": world,
        "world_after": world,
    }
    names = ", ".join(f"{r['checkpoint']} ({short_reason(r['reason'])})" for r in refused)
    start = f"resumed at step {step}" if step else "started over from step 0 (no valid checkpoint left)"
    return Finding(
        rule="checkpoint_fallback",
        family="fallback",
        step=step,
        evidence=evidence,
        summary=f"{len(refused)} corrupt checkpoint(s) refused: {names}; {start} ({evidence['steps_lost']} "
        "step(s) trained again)",
        strength=1.0,
    )


def fallback_remedy(f: Finding) -> Remedy:
    e = f.evidence
    store = sorted({r["store"] for r in e["refused"] if r.get("store")})
    local = any(not r.get("store") for r in e["refused"])
    where = ["moved the others to checkpoints/corrupt/ (kept for inspection, never resumed from)"] if local else []
    where += [
        f"did not download the ones in {url} that fail it (the next upload's retention deletes them)" for url in store
    ]
    return Remedy(
        action="resume",
        params={"step": e["resumed_step"], "world": e["world_after"]},
        reasoning="a checkpoint that fails its manifest (a truncated or flipped file) would load damaged weights or "
        f"optimizer state, so the resume took the newest one that verifies and {' and '.join(where)}; on "
        f"{ranks(e['world_after'])} the steps "
        f"after step {e['resumed_step']} (at least {e['steps_lost']}) are trained again, the data order continued "
        "exactly",
    )
