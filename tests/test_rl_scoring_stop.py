"""A stop signal while an RL run's held-out scoring waits for the verifiers (asynchronous RL: the rollout
thread scoring a training batch holds them, rl/batches.py) leaves the wait for the stop's save: it waited on
until that batch's scoring ended (each verification up to rl.verifier_timeout_s), past a scheduler's grace."""

import os
import signal
import threading
import time

import trimtab
from test_rl_eval_stop import base, rl_cfg  # noqa: F401  (a fixture)
from trimtab.rl.batches import RolloutLoader

HELD_S = 30.0  # how long the other scoring holds the verifiers: the test's run would take that long before


def test_a_sigterm_while_held_out_scoring_waits_for_the_verifiers_leaves_the_wait(tmp_path, base, monkeypatch, capsys):  # noqa: F811
    score = RolloutLoader._score
    seen: dict[str, float] = {}  # held-out scorings begun; when the signal came
    done = threading.Event()

    def busy_verifiers(self, rollouts, answers, held_out=False):
        seen["held_out"] = seen.get("held_out", 0) + held_out
        if held_out and seen["held_out"] == 3:  # step 2's greedy answers (step 0's baseline: greedy, then sampled)
            taken = threading.Event()

            def rollout_thread_scoring():  # as a training batch's scoring holds them
                with self._scoring:
                    taken.set()
                    done.wait(HELD_S)

            threading.Thread(target=rollout_thread_scoring, daemon=True).start()
            taken.wait()
            os.kill(os.getpid(), signal.SIGTERM)
            seen["signalled"] = time.monotonic()
        return score(self, rollouts, answers, held_out)

    monkeypatch.setattr(RolloutLoader, "_score", busy_verifiers)
    run = tmp_path / "rl"
    try:
        summary = trimtab.train(rl_cfg(run, base))
    finally:
        done.set()
    waited = time.monotonic() - seen["signalled"]
    assert summary["status"].startswith("stopped (SIGTERM"), summary["status"]
    assert waited < HELD_S / 3, waited  # left within POLL_S of the signal, the save and the run's end after it
    assert summary["step"] == 2 and (run / "checkpoints" / "step_000002").is_dir()
    assert "eval step 2 abandoned (SIGTERM: left off for the stop's save during the verifier's scoring" in (
        capsys.readouterr().err
    )
