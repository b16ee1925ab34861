"""decisions.jsonl: one line per orchestrator decision, with its evidence and measured outcome.

    {"id": 3, "step": 120, "rule": "spike", "evidence": {...}, "reasoning": "...",
     "action": "skip_step", "params": {}, "confidence": 0.71, "mode": "auto",
     "applied": ["skipped the update"], "outcome": {"result": "recovered", ...}}

The decisions live in the orchestrator's state (checkpointed) and the file is rewritten from them
atomically on every change, so the outcome filled in N steps later lands on the decision's own
line, and a resumed run's file holds exactly the decisions up to its checkpoint. The file is
trimtab/rundir.py's (read_decisions); each new decision is also handed to `on_add` (the
orchestrator raises it to every hook as Hook.on_decision: trackers follow decisions that way).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trimtab.distributed import is_main
from trimtab.rundir import ABANDONED, PEOPLES, is_decision, read_jsonl, write_jsonl
from trimtab.training.actions import describe

log = logging.getLogger(__name__)

# Outcomes a remedy's track record counts; "not applied" (advice), "stopped", "applied" (a person's),
# "cut short" (taken in a branch a rollback abandoned before any step followed it), "noted" (a note:
# nothing done), "too early" (the run ended before outcome_after steps followed it), and a knob's "done" /
# "not done" (make_up's steps trained or not) and "applied" (a checkpoint interval set) judge nothing.
JUDGED = ("recovered", "not recovered", "failed")


@dataclass(kw_only=True)
class Decision:
    id: int
    step: int
    rule: str
    evidence: dict[str, Any]
    reasoning: str
    action: str  # an action of trimtab.training.actions.ACTIONS, an orchestrator command, or "none" (log only)
    params: dict[str, Any]
    confidence: float
    mode: str  # auto | advise | manual | default (a config default, unset in the config, over the run's saved value)
    family: str = ""
    summary: str = ""
    applied: list[str] = field(default_factory=list)  # what changed, as Control reported it
    outcome: dict[str, Any] | None = None  # filled in `outcome_after` steps later
    observed: int = 0  # steps seen since the decision
    loss_before: float | None = None

    def console_line(self) -> str:
        """e.g. `[orchestrator] step 5000 plateau: loss variance 8e-4 < 1e-3 for 50 steps -> lr x1.5
        (confidence 0.75)`."""
        # a resume (a restart's, a corrupt checkpoint's) was done before it was decided, in every mode: applied
        tag = "" if self.mode in ("auto", *PEOPLES) or self.applied else f" [{self.mode}: not applied]"
        return (
            f"[orchestrator] step {self.step} {self.rule}: {self.summary} -> {describe(self.action, self.params)} "
            f"(confidence {self.confidence:.2f}){tag}"
        )


def person_decision(
    id: int,
    step: int,
    rule: str,
    evidence: dict[str, Any],
    reasoning: str,
    action: str,
    params: dict[str, Any],
    summary: str,
    applied: list[str] = (),
) -> Decision:
    """A person's decision (a `trimtab ctl` command, a config change found on resume): confidence
    1, mode manual, its family its rule, applied as it is journaled."""
    return Decision(
        id=id,
        step=step,
        rule=rule,
        evidence=evidence,
        reasoning=reasoning,
        action=action,
        params=params,
        confidence=1.0,
        mode="manual",
        family=rule,
        summary=summary,
        applied=list(applied),
        outcome={"result": "applied"},
    )


class Journal:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.decisions: list[Decision] = []
        # Decisions a resumed run's checkpoint does not hold (taken after it, in a session that
        # ended without saving again: a crash, a stop on a full disk): kept in the file, marked
        # "abandoned": true, so the reasons a run stopped survive its resume.
        self.abandoned: list[dict[str, Any]] = []
        self.on_add: Callable[[dict[str, Any]], None] | None = None  # told of each new decision, as written
        self.dropped: list[dict[str, Any]] = []  # set by load_state_dict

    def add(self, decision: Decision) -> Decision:
        self.decisions.append(decision)
        self.write()
        if self.on_add is not None:
            self.on_add(asdict(decision))
        return decision

    def next_id(self) -> int:
        """One past every id given: the kept decisions' (not their count: a rollback's abandoned
        ones sit between them, and a resume after it would hand out a kept decision's id again,
        merging two decisions' outcomes) and the abandoned ones'."""
        return max([0, *(d.id for d in self.decisions), *(d["id"] for d in self.abandoned)]) + 1

    def repeat_of(self, rule: str, action: str, reasoning: str) -> Decision | None:
        """This rule's latest decision when it was this action for this reason: a finding that
        comes back to the same answer (a ceiling reached, a remedy a person must take) is that
        decision again, not a new one."""
        last = next((d for d in reversed(self.decisions) if d.rule == rule), None)
        return last if last is not None and (last.action, last.reasoning) == (action, reasoning) else None

    def advised_again(self, rule: str, action: str, params: dict[str, Any], step: int, within: int) -> Decision | None:
        """This rule's latest decision of this action with these parameters, when it was advice given
        (or seen again) within `within` steps of `step`: the same advice repeated (advise mode
        answers a persisting fault at every climb) is that advice again, not a new decision. By
        parameters: two MoE layers collapsed at once are advised in turn (reset_router layer 1,
        then layer 3), and matching the action's latest alone journaled each anew every climb."""
        same = (d for d in reversed(self.decisions) if d.rule == rule and d.action == action and d.params == params)
        last = next(same, None)
        if last is None or last.mode != "advise":
            return None
        return last if step - last.evidence.get("last_seen_at", last.step) < within else None

    def pending(self) -> list[Decision]:
        return [d for d in self.decisions if d.outcome is None]

    def write(self) -> None:
        if not is_main():
            return  # data parallelism: every rank holds the same decisions; rank 0 writes them
        lines = sorted([*self.abandoned, *map(asdict, self.decisions)], key=lambda d: d["id"])
        try:
            write_jsonl(self.path, lines, default=_jsonable)
        except OSError as exc:  # a full disk: the decisions are in memory (and every checkpoint),
            log.warning("decisions.jsonl not updated (%s); the next decision writes it whole", exc)

    def track_record(self, rule: str, action: str) -> tuple[int, int]:
        """(recovered, judged) of this rule's decisions with this action in this run: how often
        this remedy fixed this problem. Per action, since a failed first remedy is what an
        escalation answers, and must not lower the confidence in the escalation. Only applied
        decisions count (advice changed nothing, whatever followed it)."""
        judged = [
            d
            for d in self.decisions
            if d.rule == rule and d.action == action and d.outcome and d.outcome["result"] in JUDGED
        ]
        return sum(d.outcome["result"] == "recovered" for d in judged), len(judged)

    def state_dict(self) -> list[dict[str, Any]]:
        return [asdict(d) for d in self.decisions]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.decisions = [Decision(**d) for d in state]
        kept = {d.id for d in self.decisions}
        found = [d for d in read_jsonl(self.path) if is_decision(d)]  # a foreign line is no decision
        # decisions in force in the file that the state does not hold: a rollback's, or what a
        # process journaled after its last checkpoint and lost with it (a person's commands: ctl.py)
        self.dropped = [d for d in found if d["id"] not in kept and not d.get(ABANDONED)]
        self.abandoned = [{**d, ABANDONED: True} for d in found if d["id"] not in kept]
        self.write()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return repr(value)
    return str(value)
