"""The ceiling a curriculum raise found (RolloutLoader.top_difficulty: a raise past it did not fit model.max_seq_len,
rl/curriculum.py) across a rollback. The loader's state is its checkpoint's, so a rollback to a checkpoint from
before the ceiling was found lost it, and rule rl_signal tried the raise that did not fit again, failing again, where
it would have stopped the learned task. The ceiling is kept as a raise is (TrainState.rl_top_difficulty)."""

import pytest

from helpers import trimtab_cli
from test_rl_curriculum_rollback import Run
from test_rl_train import RL
from trimtab.errors import ConfigError
from trimtab.rundir import read_decisions
from trimtab.training.state import KEPT_ON_ROLLBACK


def test_the_ceiling_found_after_the_checkpoint_survives_a_rollback():
    run = Run()
    run.cfg.model.max_seq_len = 6  # the 2-digit prompts and rl.max_new_tokens do not fit: the ceiling is 1
    run.state.step = 4
    try:
        with pytest.raises(ConfigError):
            run.control._set_rl_difficulty(2)
        assert run.loader.top_difficulty == run.state.rl_top_difficulty == 1
        done = run.control._rollback("last_good")
        assert "rl_top_difficulty" in KEPT_ON_ROLLBACK
        assert run.loader.top_difficulty == 1 and run.loader.difficulty == 1, done
        assert "the task's ceiling kept: 1 digits" in done
        assert run.loader.next_batch().health["top_difficulty"] == 1  # rule rl_signal's evidence (_harder)
    finally:
        run.loader.close()


def test_a_rollback_with_no_ceiling_found_says_nothing_of_one():
    run = Run()
    try:
        done = run.control._rollback("last_good")
        assert run.loader.top_difficulty == 0 and "ceiling" not in done
    finally:
        run.loader.close()


@pytest.mark.slow  # a CLI run of 6 steps (~10 s on one core)
def test_trimtab_rl_stops_the_learned_task_at_the_ceiling_after_a_rollback(tmp_path, debug_run):
    """Every response right at 2 digits; 3 digits' prompts (8 tokens) and rl.max_new_tokens=2 over
    model.max_seq_len=9: the raise at step 4 fails (the ceiling), the weights NaN at step 5 roll back to step 3.
    Before, the replay raised to 3 again at step 6 (failed again) and stopped at step 8; now it stops at step 6."""
    out = tmp_path / "rl"
    args = ["rl", *RL, "--out", str(out), "--max-steps", "14", "--set", f"train.init_from={debug_run}"]
    args += ["--set", "rl.reward=format:.*", "--set", "orchestrator.rl_signal.window=2", "--set", "rl.held_out=0"]
    args += ["--set", "rl.prompts=builtin:arithmetic:2", "--set", "model.max_seq_len=9", "--set", "data.seq_len=8"]
    done = trimtab_cli([*args, "--set", 'faults=["weights_nan@5"]'], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    decisions = read_decisions(out)
    raises = [d for d in decisions if d["action"] == "set_rl_difficulty"]
    assert [(d["step"], d["params"]) for d in raises] == [(4, {"digits": 3})], raises
    assert "failed" in raises[0]["applied"][0]
    rollback = next(d for d in decisions if d["action"] == "rollback")
    assert "the task's ceiling kept: 2 digits" in str(rollback["applied"])
    stop = decisions[-1]
    assert (stop["rule"], stop["action"], stop["step"]) == ("rl_signal", "stop", 6), stop
    assert "would not fit model.max_seq_len" in stop["params"]["reason"]
