"""RL's knobs moved while batches generated ahead wait (rl.max_staleness, rl/engine.py), through
the real loop and a person's `trimtab ctl`: the objective scores each batch at the temperature it
was drawn at, and a staleness bound raised above the config's is the one logged and corrected for."""

import json

import pytest

import trimtab
from trimtab.config import load_config
from trimtab.orchestrator import ctl
from trimtab.training.hooks import Hook

# one worker for the module (--dist loadgroup): its module-scoped base run is made once, not on each worker
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("test_rl_knobs")]
LIKELIHOOD_RULES = ("spike", "above_start", "divergence", "plateau", "early_stop", "rows", "mod")  # `trimtab rl`'s off


class Person(Hook):
    """Types `trimtab ctl RUN VERB ARGS` once at the end of each given step; the run applies it
    after the following step (tests/test_ctl_loop.py)."""

    def __init__(self, run_dir, script):
        self.run_dir, self.script = run_dir, dict(script)

    def on_step_end(self, trainer, out):
        if out.step in self.script:
            verb, *args = self.script.pop(out.step)
            ctl.send(self.run_dir, ctl.parse_command(verb, args))


@pytest.fixture(scope="module")
def base(debug_run):
    """A debug run of two steps: a tokenizer and weights to start RL from (the session's, conftest.py)."""
    return debug_run


def rl_run(out, base, staleness: int, script: dict) -> list[dict]:
    """Six RL steps at a small LR (the policy barely moves: what is off its rollouts is the knob's
    doing), a person's commands typed at the script's steps; the RL steps' metric lines."""
    rl = {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 2, "held_out": 0, "max_staleness": staleness}
    rl |= {"enabled": True, "reward": "python:rl_verifiers:starts_with_space"}
    off = {r: {"enabled": False} for r in LIKELIHOOD_RULES} | {"rl_ratio": {"enabled": False}}
    cfg = load_config(
        preset="debug",
        overrides={
            "out": str(out),
            "rl": rl,
            "orchestrator": off,
            "plan": {"status_every": 0},
            "train": {"max_steps": 6, "init_from": str(base), "log_every": 1, "eval_every": 0},
            "optim": {"lr": 1e-5, "warmup_steps": 0},
            "log": {"progress": False, "report": False, "tensorboard": False},
        },
    )
    summary = trimtab.train(cfg, hooks=[Person(out, script)])
    assert summary["status"] == "completed", summary
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "rl/reward" in m]


def test_a_temperature_changed_while_batches_are_queued_scores_them_at_their_own(tmp_path, base):
    """Rollouts two steps ahead, sampled at 1.0; `ctl rl-temperature 0.3` lands after step 2,
    with the batches of steps 3 and 4 queued: the objective evaluated them at 0.3, not at the 1.0
    they were drawn at, and 62-84% of their tokens read as off the policy (rule rl_ratio's
    evidence). Evaluated at their own temperature, none is."""
    logged = rl_run(tmp_path / "t", base, 2, {1: ("rl-temperature", "0.3")})
    assert [m["rl/temperature"] for m in logged] == [1.0, 1.0, 0.3, 0.3, 0.3, 0.3]
    assert all(m["rl/off_policy"] == 0.0 for m in logged), [m["rl/off_policy"] for m in logged]
    assert max(m["rl/kl"] for m in logged) < 1e-2, [m["rl/kl"] for m in logged]


def test_a_staleness_raised_above_the_config_is_logged_and_weighted(tmp_path, base):
    """A synchronous run (rl.max_staleness 0) made asynchronous by `ctl max-staleness 2` after
    step 2: its staleness is logged from step 3 (0, 1, then 2: the new queue's first batch is
    the current policy's) and the objective is the decoupled one, its behaviour weight logged.
    Before, both read rl.max_staleness and stayed off."""
    logged = rl_run(tmp_path / "s", base, 0, {1: ("max-staleness", "2")})
    assert [m.get("rl/staleness") for m in logged] == [None, None, 0, 1, 2, 2]
    assert ["rl/behaviour_weight" in m for m in logged] == [False, False, True, True, True, True]
    assert all(0 < m["rl/behaviour_weight"] <= 2 for m in logged[2:])
