"""A stop signal that comes during an evaluation (a preemption's SIGTERM) leaves the evaluation off for the
stop's save (training/evaluation.py sharded_loss): the evaluation ran on to its end first (an eval_hang@10:3 run's
SIGTERM at 7 s was saved at 20 s), a real one for minutes, past a scheduler's grace (SIGKILL 30 s after SIGTERM)."""

import os
import signal

import trimtab
from test_orchestrator_loop import debug_cfg
from trimtab.rundir import read_decisions
from trimtab.training.trainer import Trainer


def test_a_sigterm_during_an_evaluation_leaves_it_for_the_stops_save(tmp_path, monkeypatch, capsys):
    scored = []
    score = Trainer.score

    def sigterm_in_evaluation(self, micro):
        if self.evaluating:
            scored.append(self.state.step)
            if len(scored) == 1:  # the first evaluation's first micro-batch: the handler runs at the next bytecode
                os.kill(os.getpid(), signal.SIGTERM)
        return score(self, micro)

    monkeypatch.setattr(Trainer, "score", sigterm_in_evaluation)
    run = tmp_path / "r"
    summary = trimtab.train(debug_cfg(run, steps=20, sets=["train.eval_every=10"]))
    assert summary["step"] == 10 and summary["status"].startswith("stopped (SIGTERM"), summary["status"]
    assert scored == [10]  # one micro-batch scored of the evaluation, and it was not tried again
    assert (run / "checkpoints" / "step_000010").is_dir()
    err = capsys.readouterr().err
    assert "eval step 10 abandoned (SIGTERM: left off for the stop's save after 1 of " in err
    assert "training goes on" not in err
    assert not [d for d in read_decisions(run) if d["rule"] == "eval_error"]  # no fault journaled
