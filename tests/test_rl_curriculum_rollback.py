"""A curriculum raise (rule rl_signal's set_rl_difficulty, rl/curriculum.py) across a rollback. The loader's
difficulty is its checkpoint's, so a rollback to a checkpoint before the raise undid it unsaid, and the rule raised
it again a window later (a weights_nan rollback: 4 more steps at the learned task). A raise is a journaled decision,
as an LR cut: a rollback keeps it (TrainState.rl_difficulty), drawn again after the loader's state is restored,
unless the rollback is a fall's (rl_reward, a held-out fall), which puts back the knobs RL's rules turned on the
falling policy: the raise is one of them, reverted and said so."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from helpers import trimtab_cli
from test_rl_curriculum import loader
from test_rl_train import RL
from trimtab.orchestrator.remedies import Remedy
from trimtab.orchestrator.rl_reward import put_back
from trimtab.rl.curriculum import set_difficulty
from trimtab.rundir import read_decisions
from trimtab.training.control import Control
from trimtab.training.state import KEPT_ON_ROLLBACK, TrainState
from trimtab.training.view import RunView


class Run:
    """What Control's rollback needs of a trainer: Trainer._load's restore (the checkpoint's state with the knobs
    kept, a loader rebuilt at the configured difficulty and given the checkpoint's data state)."""

    def __init__(self) -> None:
        self.loader, self.state = loader(), TrainState(step=3)
        self.cfg = SimpleNamespace(model=SimpleNamespace(max_seq_len=64))
        self.rl_temperature = 1.25  # a rule warmed it (test_a_persons_raise_stays_through_a_falls_rollback)
        self.control = Control(self)
        self.view = RunView(self, self.control)
        self.saved = (replace(self.state), self.loader.state_dict())  # the checkpoint of step 3

    def rollback(self, to: str) -> str:
        state, data = self.saved
        kept = {k: getattr(self.state, k) for k in KEPT_ON_ROLLBACK}
        self.loader.close()
        self.loader = loader()
        self.loader.load_state_dict(data)
        self.state = replace(state, **kept)
        return f"rolled back to step {state.step}"

    def prompts(self, n: int = 6) -> list[str]:
        return [self.loader.problems[self.loader.order.next()].prompt for _ in range(n)]


def raised_after_the_checkpoint() -> Run:
    run = Run()
    run.state.step = 4
    assert "1 -> 2 digits" in run.control._set_rl_difficulty(2)
    run.state.step = 6
    return run


def test_a_raise_after_the_checkpoint_survives_a_rollback():
    run = raised_after_the_checkpoint()
    try:
        done = run.control._rollback("last_good")
        assert run.loader.difficulty == 2 and run.state.rl_difficulty == 2 and run.view.rl_difficulty == 2
        assert "1 -> 2 digits" in done and "kept" in done
        following = run.prompts()
    finally:
        run.loader.close()
    raised = loader()  # the raise draws its order from the start, as the one rolled back did
    try:
        set_difficulty(raised, 2, max_seq_len=64)
        assert following == [raised.problems[raised.order.next()].prompt for _ in range(6)]
    finally:
        raised.close()


def test_a_falls_rollback_reverts_a_rules_raise_in_the_checkpoints_order():
    run = raised_after_the_checkpoint()
    try:
        done = run.control._rollback("last_good", knobs=[[4, "set_rl_difficulty", 1, 2]])
        assert run.loader.difficulty == 1 and run.state.rl_difficulty == 1 and run.view.rl_difficulty == 1
        assert "2 -> 1 digits: the raise reverted" in done and "kept" not in done
        reverted = run.prompts()
    finally:
        run.loader.close()
    restored = loader()
    try:
        restored.load_state_dict(run.saved[1])
        assert reverted == [restored.problems[restored.order.next()].prompt for _ in range(6)]  # not drawn again
    finally:
        restored.close()


def test_a_persons_raise_stays_through_a_falls_rollback():
    """A raise no rule turned (`trimtab ctl RUN rl-difficulty`) is a person's: a fall's rollback keeps it."""
    run = raised_after_the_checkpoint()
    try:
        run.control._rollback("last_good", knobs=[[5, "set_rl_temperature", 1.0, 1.25]])
        assert run.loader.difficulty == 2
    finally:
        run.loader.close()


def test_a_falls_rollback_names_the_raise_it_reverts():
    remedy = Remedy(action="rollback", params={"to": 2}, reasoning="the reward fell")
    put_back(remedy, [[4, "set_rl_difficulty", 2, 3]], good_step=2)
    assert "the task's difficulty (digits) 2 -> 3 (step 4)" in remedy.reasoning


@pytest.mark.slow  # a CLI run of 10 steps (~15 s on loaded cores)
def test_trimtab_rl_keeps_a_raise_across_a_nonfinite_rollback(tmp_path, debug_run):
    """Raised 2 -> 3 at step 4, the weights NaN at step 6, rolled back to step 3: the replay trains at 3 digits and
    the rule raises to 4 next (the raise to 3 decided again at step 8 before: steps 4-8 at 2 digits)."""
    out = tmp_path / "rl"
    args = ["rl", *RL, "--out", str(out), "--max-steps", "14", "--set", f"train.init_from={debug_run}"]
    args += ["--set", "rl.reward=format:.*", "--set", "orchestrator.rl_signal.window=2", "--set", "rl.held_out=0"]
    args += ["--set", "orchestrator.rl_signal.max_difficulty=4", "--set", 'faults=["weights_nan@6"]']
    done = trimtab_cli(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    decisions = read_decisions(out)
    raises = [d["params"]["digits"] for d in decisions if d["action"] == "set_rl_difficulty" and d.get("applied")]
    rollback = next(d for d in decisions if d["action"] == "rollback")
    assert "the raise decided after the checkpoint kept" in str(rollback["applied"])
    assert raises.count(3) == 1, raises
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "rl/reward" in line]
    replayed = [m["rl/difficulty"] for m in logged if m["step"] in (4, 5, 6)][3:]  # the replay's, after the first
    assert replayed == [3, 3, 3]
