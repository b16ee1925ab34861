"""What the orchestrator reads of a data-parallel job, unit by unit. Row scoring: each rank scores
the rows it trained, on its own copy of them, in as many forwards as the others, and all take the
same decision from the scores (two forked gloo processes; no training: the scoring forward is
replaced by each rank's own numbers). Throughput across a resume on another number of processes."""

import json
import os
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch.distributed as dist

from helpers import forked_ranks
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.data.batches import Owners, micro_batches
from trimtab.data.packing import Rows
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.resources import Throughput
from trimtab.training import scoring
from trimtab.training.view import RunView

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

ROWS = 6
TRAINED = [[1], [0, 2, 3, 4, 5]]  # the step's rows each rank trained (shard_rows' shares)
# rank 1 read rows 0 and 3 corrupt (bad_batch@S@rank1: its copy alone) and trained them, and row 5
# is NaN on it; rank 0's copy of row 3 is corrupt too, but rank 0 never trained it; its held-out
# copy scores one row higher. A row's score is the one its trainer's copy gives.
SCORED = {0: [5.0, 5.0, 5.0, 8.0, 5.0, 5.0], 1: [9.0, 5.0, 5.0, 9.5, 5.0, float("nan")]}
HELD_OUT = {0: [5.0, 5.1, 4.9], 1: [5.0, 7.0, 4.9]}
BUDGET = 9  # tokens per micro-batch: one row each, so rank 1 has five forwards to rank 0's one


def _rows() -> Rows:
    lengths = np.array([8, 6, 8, 4, 8, 5])
    starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]])
    tokens = np.arange(int((lengths + 1).sum()), dtype=np.int32) % 50
    return Rows(tokens, np.ones(len(tokens), dtype=bool), starts, lengths)


def _trainer(rows: Rows, rank: int) -> SimpleNamespace:
    """What RunView's scoring reads of a trainer; the forward answers with this rank's numbers."""
    micro = micro_batches(rows, [0, 1, 2], 10_000, 0)
    # each micro-batch's source (one); the row reference's sample (HeldOut.reference): these rows
    held = SimpleNamespace(micro=micro, sources=["data"] * len(micro), reference=lambda limit, part=None: micro)
    phase = SimpleNamespace(train_rows=rows, eval_rows=SimpleNamespace(at=lambda budget: held))
    agreed = SimpleNamespace(completing_forward=nullcontext, first_error=lambda error: error, dp_rank=rank, dp_world=2)
    trained_by = Owners()
    trained_by.saw(TRAINED)
    return SimpleNamespace(
        phases=[phase],
        state=SimpleNamespace(phase=0, step=30),
        loader=SimpleNamespace(micro_batch_tokens=BUDGET, trained_by=trained_by),
        data_shard=(rank, 2),
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
        rows = _rows()
        view = RunView(_trainer(rows, rank), control=SimpleNamespace(request=None))
        seen = {"scored": [], "forwards": 0}

        def scored(model, forward, precision, micro, device):  # training rows, then held-out ones
            if any(len(m.rows) > 1 for m in micro):
                return list(HELD_OUT[rank])
            seen["forwards"] += len(micro)
            seen["scored"] += [r for m in micro for r in m.rows]
            # a padding forward scores its one row (all targets ignored): a number that is dropped
            return [SCORED[rank][m.rows[0]] if m.rows else 0.0 for m in micro]

        scoring.row_losses, scoring.untouched = scored, lambda model, device: nullcontext()
        found = view.row_losses(list(range(ROWS)))
        reference = view.held_out_row_losses(3)
        with open(out.format(rank=rank), "w") as f:
            rows_found = {str(r): v for r, v in sorted(found.items())}
            json.dump({"rows": rows_found, "held_out": reference, **seen}, f)
        dist.destroy_process_group()
        code = 0
    finally:
        os._exit(code)  # a forked child: never back into pytest


def test_rows_scored_by_the_rank_that_trained_them_agree_on_every_rank(tmp_path):
    """bad_batch@30:1@rank1 under torchrun (DDP or FSDP2) with the orchestrator on: rank 1 scored
    the lone spike's rows as garbage and left them out, rank 0 scored its clean copy and only
    skipped; rank 1 then watched step 31 (a scoring forward and its collective) while rank 0
    trained on, and the watchdog ended the job at step 31. Each row's score is now the same on
    both (NaN counted as inf). And each rank scores only the rows it trained (every rank scored
    every row: W times the work), on the copy it trained on (rank 0's corrupt copy of a row rank 1
    trained is not what was trained), in as many forwards as the other (FSDP gathers weights in
    each: one rank with fewer would leave the other waiting)."""
    rank0, rank1 = forked_ranks(_rank, tmp_path)
    assert rank0["rows"] == rank1["rows"] == {"0": 9.0, "1": 5.0, "2": 5.0, "3": 9.5, "4": 5.0, "5": float("inf")}
    assert rank0["held_out"] == rank1["held_out"] == [5.0, 7.0, 4.9]
    assert (sorted(rank0["scored"]), sorted(rank1["scored"])) == (TRAINED[0], TRAINED[1])
    assert rank0["forwards"] == rank1["forwards"] == 5


def test_rows_trained_before_a_resume_are_cut_among_the_ranks_by_tokens():
    """Owners.split: a row the map holds goes to the rank that trained it (a replica group's rank:
    its share minus the group's first), every other row to a share of about equal tokens; no row twice."""
    rows, owners = _rows(), Owners()
    owners.saw([[0, 1], [2], [3], [4]])  # four shares: two replica groups of two ranks
    assert owners.split(rows, [0, 1, 2, 5], first=0, world=2) == [[0, 1], [2, 5]]
    second = owners.split(rows, [3, 4, 5, 3], first=2, world=2)
    assert sorted(second[0]) == [3] and 4 in second[1] and sorted(r for s in second for r in s) == [3, 4, 5]


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
