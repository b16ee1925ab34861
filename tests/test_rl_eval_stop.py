"""A stop signal during an RL run's held-out evaluation leaves the generation off before its next forward for
the stop's save (Trainer._left_off), as a held-out loss's after its micro-batch (tests/test_stop_in_eval.py): it
ran on to its end (debug, 1,956 held-out prompts x 48 tokens and 4 samples: the save 17 s after SIGTERM, now
under 1 s), and its figures were logged as the step's evaluation. Under torchrun the ranks take the stop
together right after it (Phases._stop_agreed): 2 ranks, the agent's SIGKILL 30 s after SIGTERM came first and
no checkpoint was saved; now step 2's is, 0.2 s after the signal."""

import json
import os
import signal
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import trimtab
from helpers import forked_ranks
from test_rl_knobs import LIKELIHOOD_RULES
from trimtab.config import load_config
from trimtab.distributed.parallel import Parallel
from trimtab.model.transformer import Transformer
from trimtab.rl.batches import RolloutLoader
from trimtab.rundir import read_decisions
from trimtab.training.evaluation import LeftOff
from trimtab.training.phases import Phases
from trimtab.training.trainer import Trainer

SIGNAL_AT = 3  # the forward of the step-2 evaluation's generation after which SIGTERM comes


@pytest.fixture(scope="module")
def base(debug_run):
    return debug_run


def rl_cfg(out, base):
    rl = {"enabled": True, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8, "held_out": 16}
    rl |= {"reward": "python:rl_verifiers:starts_with_space", "held_out_samples": 2}
    return load_config(
        preset="debug",
        overrides={
            "out": str(out),
            "rl": rl,
            "orchestrator": {r: {"enabled": False} for r in LIKELIHOOD_RULES},
            "train": {"max_steps": 4, "init_from": str(base), "log_every": 1, "eval_every": 2},
            "checkpoint": {"every": 100},
            "log": {"progress": False, "report": False, "tensorboard": False},
        },
    )


def test_a_sigterm_during_rl_held_out_generation_leaves_it_for_the_stops_save(tmp_path, base, monkeypatch, capsys):
    seen = {"evaluations": 0, "forwards": 0}
    evaluate, next_logits = RolloutLoader.evaluate, Transformer.next_logits

    def counted_evaluate(self):
        seen["evaluations"] += 1  # step 0's (the baseline), then step 2's
        return evaluate(self)

    def signalling_forward(self, tokens, cache):
        if seen["evaluations"] == 2:
            seen["forwards"] += 1
            if seen["forwards"] == SIGNAL_AT:  # the handler runs at the next bytecode, within this forward
                os.kill(os.getpid(), signal.SIGTERM)
        return next_logits(self, tokens, cache)

    monkeypatch.setattr(RolloutLoader, "evaluate", counted_evaluate)
    monkeypatch.setattr(Transformer, "next_logits", signalling_forward)
    run = tmp_path / "rl"
    summary = trimtab.train(rl_cfg(run, base))
    assert summary["step"] == 2 and summary["status"].startswith("stopped (SIGTERM"), summary["status"]
    assert seen == {"evaluations": 2, "forwards": SIGNAL_AT}  # no forward after the signal, not tried again
    assert (run / "checkpoints" / "step_000002").is_dir()
    err = capsys.readouterr().err
    assert "eval step 2 abandoned (SIGTERM: left off for the stop's save during the held-out generation)" in err
    assert "training goes on" not in err
    assert not [d for d in read_decisions(run) if d["rule"] == "eval_error"]  # no fault journaled
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "rl/held_out_pass@1" in m] == [0]  # the abandoned one is no result
    assert summary["eval_step"] == 0 and summary["eval_final"] is False


class _Rank(Phases):
    """What Phases.evaluate reads of a trainer, in an RL phase whose held-out evaluation rank 1 left off at its
    SIGTERM and rank 0, not signalled (yet), answered to its end: the run's last evaluation (3 tries)."""

    request_stop = Trainer.request_stop

    def __init__(self, rank: int) -> None:
        self.dist = object.__new__(Parallel)  # its agreement alone: no model, no mesh
        self.dist.world, self.dist.device, self.dist._signal = 2, torch.device("cpu"), signal.SIGTERM * rank
        self.loader, self.answered = object.__new__(RolloutLoader), 0
        self.loader.evaluate = self._answer
        self.state, self.phases = SimpleNamespace(step=10, phase=0), [SimpleNamespace(name="rl")]
        self.watchdog, self.stop_reason, self.told = SimpleNamespace(beat=lambda what: None), "", []

    def _answer(self) -> dict:
        self.answered += 1
        if self.dist.signalled():
            raise LeftOff("SIGTERM: left off for the stop's save during the held-out generation")
        return {"rl/held_out_reward": 0.5}

    def _call(self, event: str, *args) -> None:
        self.told.append([event, *args, self.stop_reason])  # what the hooks read: run.stopping


def _evaluate_as(rank: int, store: str, out: str) -> None:
    code = 1
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=20)
        )
        trainer = _Rank(rank)
        figures = trainer.evaluate(tries=3)
        with open(out.format(rank=rank), "w") as f:
            json.dump({"figures": figures, "answered": trainer.answered, "told": trainer.told}, f)
        dist.destroy_process_group()
        code = 0
    finally:
        os._exit(code)  # a forked child: never back into pytest


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_ranks_take_a_stop_one_received_in_an_evaluation_together(tmp_path):
    """Before, rank 0 (the journal's) read the run as going on: it journaled an eval_error, tried its last
    evaluation again while rank 1 had broken off, and the stop waited for the next step's agreement."""
    rank0, rank1 = forked_ranks(_evaluate_as, tmp_path)
    assert rank0["figures"] == rank1["figures"] == {}  # no result
    assert rank0["answered"] == rank1["answered"] == 1  # not tried again
    assert rank0["told"] == [["on_eval_error", 10, "another rank's evaluation failed (its log says why)", "SIGTERM"]]
    assert rank1["told"] == [["on_eval_error", 10, "SIGTERM: left off for the stop's save during the held-out "
                              "generation", "SIGTERM"]]  # fmt: skip
