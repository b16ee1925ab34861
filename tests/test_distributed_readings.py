"""What the orchestrator reads of a data-parallel job, unit by unit. Row scoring: every rank scores
the same rows on its own copy of them and of the weights, and all must take the same decision
from the scores (two forked gloo processes; no training: the scoring forward is replaced by each
rank's own numbers). Throughput across a resume on another number of processes."""

import json
import multiprocessing
import os
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch.distributed as dist

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.data.batches import micro_batches
from trimtab.data.packing import Rows
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.resources import Throughput
from trimtab.training import scoring
from trimtab.training.view import RunView

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

ROWS = 6
# rank 1 read rows 0 and 3 corrupt (bad_batch@S@rank1: its copy alone), and row 5 is NaN on it;
# its held-out copy scores one row higher too. Rank 0's copies are clean.
SCORED = {0: [5.0] * ROWS, 1: [9.0, 5.0, 5.0, 9.5, 5.0, float("nan")]}
HELD_OUT = {0: [5.0, 5.1, 4.9], 1: [5.0, 7.0, 4.9]}


def _trainer(rows: Rows, rank: int) -> SimpleNamespace:
    """What RunView's scoring reads of a trainer; the forward answers with this rank's numbers."""
    held = SimpleNamespace(micro=micro_batches(rows, [0, 1, 2], 10_000, 0))
    phase = SimpleNamespace(train_rows=rows, eval_rows=SimpleNamespace(at=lambda budget: held))
    agreed = SimpleNamespace(completing_forward=nullcontext, first_error=lambda error: error)
    return SimpleNamespace(
        phases=[phase],
        state=SimpleNamespace(phase=0, step=30),
        loader=SimpleNamespace(micro_batch_tokens=10_000),
        tok=SimpleNamespace(pad_id=0),
        model=None,
        forward=None,
        precision=None,
        device=None,
        dist=agreed,
    )


def _rank(rank: int, store: str, out: str) -> None:
    code = 1
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        lengths = np.array([8, 6, 8, 4, 8, 5])
        starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]])
        tokens = np.arange(int((lengths + 1).sum()), dtype=np.int32) % 50
        rows = Rows(tokens, np.ones(len(tokens), dtype=bool), starts, lengths)
        view = RunView(_trainer(rows, rank), control=SimpleNamespace(request=None))

        def scored(model, forward, precision, micro, device):  # training rows, then held-out ones
            order = [r for m in micro for r in m.rows]
            if len(order) == ROWS:
                return [SCORED[rank][r] for r in order]
            return list(HELD_OUT[rank])

        scoring.row_losses, scoring.untouched = scored, lambda model, device: nullcontext()
        found = view.row_losses(list(range(ROWS)))
        reference = view.held_out_row_losses(3)
        with open(out.format(rank=rank), "w") as f:
            json.dump({"rows": {str(r): v for r, v in sorted(found.items())}, "held_out": reference}, f)
        dist.destroy_process_group()
        code = 0
    finally:
        os._exit(code)  # a forked child: never back into pytest


def test_rows_scored_on_each_ranks_own_copy_agree_on_every_rank(tmp_path):
    """bad_batch@30:1@rank1 under torchrun (DDP or FSDP2) with the orchestrator on: rank 1 scored
    the lone spike's rows as garbage and left them out, rank 0 scored its clean copy and only
    skipped; rank 1 then watched step 31 (a scoring forward and its collective) while rank 0
    trained on, and the watchdog ended the job at step 31. Now each row's score is its highest
    over the ranks (NaN counted as inf), the same on both: the rows bad on any rank go."""
    fork = multiprocessing.get_context("fork")
    out = str(tmp_path / "rank{rank}.json")
    children = [fork.Process(target=_rank, args=(r, str(tmp_path / "store"), out)) for r in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0, "a rank failed or hung"
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0 == rank1
    assert rank0["rows"] == {"0": 9.0, "1": 5.0, "2": 5.0, "3": 9.5, "4": 5.0, "5": float("inf")}
    assert rank0["held_out"] == [5.0, 7.0, 4.9]


def test_a_resume_on_fewer_processes_is_not_reported_as_a_slower_machine():
    """A 2-rank debug run resumed in one process (DCP reshards it) logged a throughput finding at
    its 5th step, "3,081 tokens/s < 0.5 x median 8,777 for 5 steps": the job's tokens/s halve with
    its ranks, and the checkpointed window held the two ranks' rates. A new world starts a new
    baseline, as an applied action does; a slower machine on the same world is still reported."""
    cfg = OrchestratorConfig()
    two = Throughput(cfg)
    for step in range(1, 21):
        assert two.observe(StepMetrics(step=step, loss=5.0, grad_norm=1.0, tokens_per_s=8800.0, world=2)) is None
    resumed = Throughput(cfg)
    resumed.load_state_dict(json.loads(json.dumps(two.state_dict())))  # through the checkpoint's state.json
    again = Throughput(cfg)
    again.load_state_dict(json.loads(json.dumps(two.state_dict())))
    found, slower = [], []
    for step in range(21, 41):
        found.append(resumed.observe(StepMetrics(step=step, loss=5.0, grad_norm=1.0, tokens_per_s=3100.0, world=1)))
        slower.append(again.observe(StepMetrics(step=step, loss=5.0, grad_norm=1.0, tokens_per_s=3100.0, world=2)))
    assert found == [None] * 20
    assert [f.rule for f in slower if f is not None] == ["throughput"]
