"""A stop signal during the rest of an RL or DPO evaluation leaves it off for the stop's save, as a held-out
generation's before its next forward (tests/test_rl_eval_stop.py): the verifier's scoring of the held-out answers
before its next round of verifications (rl/rewards.py VerifierPool.score; debug, 64 held-out prompts x 4 samples, a
verifier of 50 ms on 2 workers, SIGTERM in the sampled answers' scoring: the save 6.0 s after it, now 0.1 s), a
DPO run's held-out pair scoring before its next forward (1,000 held-out pairs of ~100 tokens: 5.3 s, now < 0.1 s).
The evaluation is neither journaled as an eval_error nor logged as a result. A SIGTERM in RL's step-0 baseline
saves step 0 and stops; a resume takes the baseline (it took none: the step-0 save predates it)."""

import os
import shutil
import signal
import time

import pytest

import trimtab
from test_rl_knobs import LIKELIHOOD_RULES
from trimtab.config import load_config
from trimtab.model.transformer import Transformer
from trimtab.rl.batches import RolloutLoader
from trimtab.rl.preference import PairLoader
from trimtab.rl.rewards import VerifierPool
from trimtab.rundir import read_decisions, read_metrics
from trimtab.training.trainer import Trainer

LOG = {"progress": False, "report": False, "tensorboard": False}


@pytest.fixture(scope="module")
def base(debug_run):
    return debug_run


def _cfg(out, base, phase: dict, max_steps: int = 4, **train):
    return load_config(
        preset="debug",
        overrides={
            "out": str(out),
            **phase,
            "orchestrator": {r: {"enabled": False} for r in LIKELIHOOD_RULES},
            "train": {"max_steps": max_steps, "init_from": str(base), "log_every": 1, "eval_every": 2, **train},
            "checkpoint": {"every": 100},
            "log": LOG,
        },
    )


def _rl(held_out_samples: int = 0) -> dict:
    rl = {"enabled": True, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8, "held_out": 16}
    return {"rl": rl | {"reward": "python:rl_verifiers:starts_with_space", "held_out_samples": held_out_samples}}


def _evals(run, key: str) -> list[int]:
    return [m["step"] for m in read_metrics(run) if key in m]


def _stopped_at(summary, run, step: int, during: str, err: str) -> None:
    assert summary["step"] == step and summary["status"].startswith("stopped (SIGTERM"), summary["status"]
    assert (run / "checkpoints" / f"step_{step:06d}").is_dir()
    assert f"eval step {step} abandoned (SIGTERM: left off for the stop's save during {during})" in err
    assert "training goes on" not in err
    assert not [d for d in read_decisions(run) if d["rule"] == "eval_error"]  # no fault journaled


def test_a_stop_leaves_a_verification_round_off_and_kills_the_verifications_under_way():
    """A hanging verification (600 s) is killed within POLL_S of the interrupt, and the pool scores on after it
    with no verdict of the left-off round read as the next one's."""
    asked = []

    def interrupt():
        asked.append(time.monotonic())
        if len(asked) == 2:  # the jobs are sent, the worker hangs: the next slice of the wait asks again
            raise KeyboardInterrupt

    pool = VerifierPool("python:rl_verifiers:flaky", workers=1, timeout_s=30.0)
    try:
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            pool.score(["hang", "a"], ["x", "a"], interrupt)
        assert time.monotonic() - start < 5.0  # it waited for the 30 s limit
        assert pool.score(["a", "b", "c"], ["a", "x", "c"]).rewards == [1.0, 0.0, 1.0]
    finally:
        pool.close()


def test_a_sigterm_during_rl_held_out_scoring_leaves_it_for_the_stops_save(tmp_path, base, monkeypatch, capsys):
    seen = {"evaluations": 0, "verified": 0, "in": False}
    evaluate, score = RolloutLoader.evaluate, VerifierPool.score

    def counted_evaluate(self):
        seen["evaluations"] += 1  # step 0's (the baseline), then step 2's
        seen["in"] = True
        try:
            return evaluate(self)
        finally:
            seen["in"] = False

    def signalling_score(self, *args):
        held_out = seen["in"] and seen["evaluations"] == 2  # the held-out answers' (not a training batch's)
        if held_out:
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at once, in this thread
        scored = score(self, *args)
        seen["verified"] += len(scored.rewards) if held_out else 0
        return scored

    monkeypatch.setattr(RolloutLoader, "evaluate", counted_evaluate)
    monkeypatch.setattr(VerifierPool, "score", signalling_score)
    run = tmp_path / "rl"
    summary = trimtab.train(_cfg(run, base, _rl()))
    _stopped_at(summary, run, 2, "the verifier's scoring of the held-out answers", capsys.readouterr().err)
    assert seen == {"evaluations": 2, "verified": 0, "in": False}  # left off before its first round, not tried again
    assert _evals(run, "rl/held_out_pass@1") == [0]  # the abandoned one is no result
    assert summary["eval_step"] == 0 and summary["eval_final"] is False


def test_a_sigterm_during_dpo_held_out_pair_scoring_leaves_it_for_the_stops_save(tmp_path, base, monkeypatch, capsys):
    scored = {"evaluations": 0, "micro-batches": 0}
    evaluate, pair_logprobs = PairLoader.evaluate, Trainer._pair_logprobs

    def counted_evaluate(self):
        scored["evaluations"] += 1
        return evaluate(self)

    def signalling_scorer(self, inputs, targets):
        out = pair_logprobs(self, inputs, targets)
        if scored["evaluations"] == 2:
            scored["micro-batches"] += 1
            if scored["micro-batches"] == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(PairLoader, "evaluate", counted_evaluate)
    monkeypatch.setattr(Trainer, "_pair_logprobs", signalling_scorer)
    run = tmp_path / "dpo"
    dpo = {"dpo": {"enabled": True, "pairs_per_step": 8, "held_out": 16}}
    summary = trimtab.train(_cfg(run, base, dpo, micro_batch_tokens=64))  # a few pairs a micro-batch
    _stopped_at(summary, run, 2, "the held-out pair scoring", capsys.readouterr().err)
    assert scored == {"evaluations": 2, "micro-batches": 2}  # no forward after the signal's micro-batch
    assert _evals(run, "dpo/held_out_accuracy") == [0]


def test_a_sigterm_in_rls_baseline_saves_step_0_and_a_resume_takes_the_baseline(tmp_path, base, monkeypatch, capsys):
    forwards, next_logits = [], Transformer.next_logits

    def signalling_forward(self, tokens, cache):
        forwards.append(1)
        if len(forwards) == 2:  # the baseline's generation (no step trained yet)
            os.kill(os.getpid(), signal.SIGTERM)
        return next_logits(self, tokens, cache)

    run = tmp_path / "rl"
    with monkeypatch.context() as patch:
        patch.setattr(Transformer, "next_logits", signalling_forward)
        summary = trimtab.train(_cfg(run, base, _rl(), max_steps=2))
    _stopped_at(summary, run, 0, "the held-out generation", capsys.readouterr().err)
    assert len(forwards) == 2 and not _evals(run, "rl/held_out_pass@1")
    summary = trimtab.train(_cfg(run, base, _rl(), max_steps=2))  # resumed at step 0
    assert summary["status"] == "completed" and summary["step"] == 2
    assert _evals(run, "rl/held_out_pass@1") == [0, 2]  # before: [2], the baseline never taken
    shutil.rmtree(run / "checkpoints" / "step_000002")  # a resume at step 0 again, its baseline in the log: kept
    trimtab.train(_cfg(run, base, _rl(), max_steps=2))
    assert _evals(run, "rl/held_out_pass@1") == [0, 2]  # once each
