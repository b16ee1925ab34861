"""decisions.jsonl: one line per orchestrator decision, with its evidence and measured outcome.

    {"id": 3, "step": 120, "rule": "spike", "evidence": {...}, "reasoning": "...",
     "action": "skip_step", "params": {}, "confidence": 0.71, "mode": "auto",
     "applied": ["skipped the update"], "outcome": {"result": "recovered", ...}}

The decisions live in the orchestrator's state (checkpointed) and the file is rewritten from them
atomically on every change, so the outcome filled in N steps later lands on the decision's own
line, and a resumed run's file holds exactly the decisions up to its checkpoint.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trimtab.distributed import is_main
from trimtab.paths import write_atomic
from trimtab.training.actions import describe

log = logging.getLogger(__name__)


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
    mode: str  # auto | advise | manual
    family: str = ""
    summary: str = ""
    applied: list[str] = field(default_factory=list)  # what changed, as Control reported it
    outcome: dict[str, Any] | None = None  # filled in `outcome_after` steps later
    observed: int = 0  # steps seen since the decision
    loss_before: float | None = None

    def console_line(self) -> str:
        """e.g. `[orchestrator] step 5000 plateau: loss variance 8e-4 < 1e-3 for 50 steps -> lr x1.5
        (confidence 0.75)`."""
        tag = "" if self.mode in ("auto", "manual") else f" [{self.mode}: not applied]"
        return (
            f"[orchestrator] step {self.step} {self.rule}: {self.summary} -> {describe(self.action, self.params)} "
            f"(confidence {self.confidence:.2f}){tag}"
        )


class Journal:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.decisions: list[Decision] = []
        # Decisions a resumed run's checkpoint does not hold (taken after it, in a session that
        # ended without saving again: a crash, a stop on a full disk): kept in the file, marked
        # "abandoned": true, so the reasons a run stopped survive its resume.
        self.abandoned: list[dict[str, Any]] = []

    def add(self, decision: Decision) -> Decision:
        self.decisions.append(decision)
        self.write()
        return decision

    def next_id(self) -> int:
        return max([len(self.decisions), *(d["id"] for d in self.abandoned)]) + 1

    def pending(self) -> list[Decision]:
        return [d for d in self.decisions if d.outcome is None]

    def write(self) -> None:
        if not is_main():
            return  # data parallelism: every rank holds the same decisions; rank 0 writes them
        lines = sorted([*self.abandoned, *map(asdict, self.decisions)], key=lambda d: d["id"])
        try:
            write_atomic(self.path, "".join(json.dumps(d, default=_jsonable) + "\n" for d in lines))
        except OSError as exc:  # a full disk: the decisions are in memory (and every checkpoint),
            log.warning("decisions.jsonl not updated (%s); the next decision writes it whole", exc)

    def track_record(self, rule: str, action: str) -> tuple[int, int]:
        """(recovered, judged) of this rule's decisions with this action in this run: how often
        this remedy fixed this problem. Per action, since a failed first remedy is what an
        escalation answers, and must not lower the confidence in the escalation."""
        judged = [d for d in self.decisions if d.rule == rule and d.action == action and d.outcome]
        return sum(d.outcome["result"] == "recovered" for d in judged), len(judged)

    def state_dict(self) -> list[dict[str, Any]]:
        return [asdict(d) for d in self.decisions]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.decisions = [Decision(**d) for d in state]
        kept = {d.id for d in self.decisions}
        found = _read(self.path)
        self.abandoned = [{**d, "abandoned": True} for d in found if d["id"] not in kept]
        self.write()


def read_decisions(run_dir: str | Path) -> list[dict[str, Any]]:
    """A run's decisions, oldest first (those a resume abandoned carry "abandoned": true)."""
    return _read(Path(run_dir) / "decisions.jsonl")


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return repr(value)
    return str(value)
