"""A person's LR raises the first rollback after them undoes (orchestrator/raised.py), counted whichever
way they came: `ctl set-lr` above the LR (debug at x7 from step 21: the first rollback replayed steps
21-25 at that LR, the second cut it), finetune.optim.lr raised on a resume in the finetune phase (x100:
the first rollback kept it). And a command the job refuses when it applies it, journaled as the refusal
alone: `ctl rollback 500` at step 21 was journaled as a rollback, then failed, and drawn in the report
as one (units: a fake trainer and view, no run)."""

import json

import pytest

from helpers import FakeTrainer
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator import ctl
from trimtab.orchestrator.core import Orchestrator
from trimtab.rundir import read_decisions


class Trainer(FakeTrainer):
    def scheduled_lr(self) -> float:
        return 1e-3  # the schedule's LR for the next step (Control._set_lr's)

    def set_lr_level(self) -> float:
        return 1e-3  # past the warm-up: the step's LR


class View:
    """The orchestrator's view of Trainer: what people.py reads of a run."""

    def __init__(self, trainer: Trainer, phase: int = 0):
        self._t, self.phase, self.control = trainer, phase, trainer.control

    @property
    def step(self) -> int:
        return self._t.state.step

    @property
    def scheduled_lr(self) -> float:
        return self._t.scheduled_lr()

    @property
    def set_lr_level(self) -> float:
        return self._t.set_lr_level()

    @property
    def lr_scale(self) -> float:
        return self._t.state.lr_scale

    def say(self, line: str) -> None:
        self._t.say(line)


def _commands(tmp_path, *commands):
    """`commands` sent, taken at step 3 and applied; the orchestrator, the trainer, and the decisions the hooks
    were told of (Hook.on_decision: trackers, /metrics), as they were told."""
    (tmp_path / "config.yaml").write_text("{}")
    orchestrator, trainer, told = Orchestrator(OrchestratorConfig(), tmp_path), Trainer(tmp_path), []
    orchestrator.journal.on_add = told.append
    for command in commands:
        ctl.send(tmp_path, command, queue=True)
    orchestrator._take_commands(View(trainer))
    assert told == []  # taken, not applied yet: nothing to tell
    trainer.control.apply()
    return orchestrator, trainer, told


def test_a_persons_set_lr_above_the_lr_is_a_raise_and_below_it_forgets_one(tmp_path):
    orchestrator, trainer, _ = _commands(tmp_path, ctl.parse_command("set-lr", ["0.003"]))
    assert trainer.state.lr_scale == pytest.approx(3.0)
    step, factor, what = orchestrator.policy.raised
    assert (step, what) == (3, "trimtab ctl set_lr 0.003") and factor == pytest.approx(3.0)
    orchestrator._take_commands(View(trainer))  # nothing more sent: nothing changes
    ctl.send(tmp_path, ctl.parse_command("set-lr", ["0.001"]), queue=True)  # x1/3: a lowering
    orchestrator._take_commands(View(trainer))
    trainer.control.apply()
    assert orchestrator.policy.raised == [] and trainer.state.lr_scale == pytest.approx(1.0)
    assert [d["applied"] for d in read_decisions(tmp_path)] == [["lr multiplier 1 -> 3"], ["lr multiplier 3 -> 1"]]


@pytest.mark.parametrize(
    ("key", "phase", "raised"),
    [("finetune.optim.lr", 1, True), ("finetune.optim.lr", 0, False), ("optim.lr", 1, False), ("optim.lr", 0, True)],
)
def test_the_lr_of_the_phase_resumed_in_raised_in_the_config_is_a_raise(tmp_path, key, phase, raised):
    """finetune.optim.lr raised in the finetune phase is the LR it trains at from this step; in pretraining
    the finetune phase starts later, warming up to it; optim.lr in the finetune phase is no LR it trains at."""
    orchestrator, trainer = Orchestrator(OrchestratorConfig(), tmp_path), Trainer(tmp_path)
    change = {"key": key, "old": 1e-4, "new": 1e-2, "effect": "the LR x100"}
    orchestrator._configured(View(trainer, phase=phase), change)
    assert [d.action for d in orchestrator.journal.decisions] == ["none"]
    if raised:
        assert orchestrator.policy.raised[:2] == [3, pytest.approx(100.0)]
        assert orchestrator.policy.raised[2].startswith(f"{key} 0.0001 -> 0.01 on resume at step 3")
    else:
        assert orchestrator.policy.raised == []


def test_a_command_the_job_refuses_is_journaled_as_the_refusal_alone(tmp_path):
    orchestrator, trainer, told = _commands(tmp_path, {"action": "rollback", "params": {"to": 500}})
    error = "rollback 500: the run is at step 3; name a step at or before it"
    (decision,) = read_decisions(tmp_path)
    assert [json.loads(json.dumps(d)) for d in told] == [decision]  # told once, the refusal
    assert (decision["action"], decision["params"], decision["applied"]) == ("none", {}, [])
    assert decision["summary"] == "rollback 500 (refused)"
    assert decision["evidence"] == {"command": "rollback", "to": 500}
    assert decision["outcome"] == {"result": "failed", "error": error, "steps": 0}
    assert decision["reasoning"].endswith(f"refused: {error}")
    assert trainer.said == [f"[orchestrator] step 3 manual: rollback 500 refused, nothing changed: {error}"]
    (answer,) = (tmp_path / "control").glob("*.error")
    assert answer.read_text().strip() == error
    assert ctl.lost_commands([json.loads(json.dumps(decision))]) == ([], [])  # nothing to apply again on resume


def test_a_command_applied_is_said_once_applied(tmp_path):
    orchestrator, trainer, told = _commands(tmp_path, ctl.parse_command("scale-lr", ["0.5"]))
    (decision,) = read_decisions(tmp_path)
    assert [json.loads(json.dumps(d)) for d in told] == [decision]
    assert decision["action"] == "scale_lr" and decision["applied"] == ["lr multiplier 1 -> 0.5"]
    assert trainer.said == ["[orchestrator] step 3 manual: scale_lr 0.5 -> lr x0.5 (confidence 1.00)"]
    assert orchestrator.policy.raised == []  # a lowering
