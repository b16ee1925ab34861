"""A finding a hook proposes at start (a restart's, a corrupt-checkpoint fallback's: orchestrator/
restarts.py) is delivered before the first step's hooks run, so decisions.jsonl reads in step order:
the resume at step N before the nonfinite of step N+1 (it came after it)."""

import pytest

import trimtab
from trimtab.orchestrator.fallbacks import fallback_finding
from trimtab.training.hooks import Hook

pytestmark = pytest.mark.usefixtures("one_thread")


class Proposer(Hook):
    """Proposes one finding at start, as Resilience does on a resume, and records the events' order."""

    def __init__(self):
        self.events: list[str] = []

    def on_train_start(self, run):
        refused = [{"checkpoint": "step_000004", "step": 4, "reason": "probe", "kept_in": None}]
        run.propose(fallback_finding({"refused": refused}, run.step, run.world))

    def on_finding(self, run, finding):
        if finding.rule == "checkpoint_fallback":
            self.events.append("finding")

    def on_step_end(self, run, out):
        self.events.append(f"step {out.step}")


def test_start_finding_delivered_before_first_step(tmp_path):
    hook = Proposer()
    trimtab.train(
        preset="debug",
        out=str(tmp_path / "r"),
        train={"max_steps": 2, "eval_every": 0, "batch_tokens": 1024, "log_every": 1},
        data={"max_bytes": 150_000},
        log={"progress": False, "tensorboard": False},
        hooks=[hook],
    )
    assert hook.events[:2] == ["finding", "step 1"]
