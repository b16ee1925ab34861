"""The row gate's reference under data parallelism (training/row_gate.py): each rank's window is
the rows it trained, not rank 0's. A checkpoint keeps every rank's and a resume gives each rank its
own: before, every rank resumed with rank 0's, and a DDP run killed at step 8 and resumed gated one
of the two garbage rows of rank 1 at steps 12 and 13 where the run never stopped gated both
(`--inject bad_rows@12:2@rank1 --inject kill_rank@8:0`, min_gap 0.3), its losses apart from step 13."""

import json

import pytest
import torch.distributed as dist

from trimtab.distributed.checkpoint import Checkpoints

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
    # on the worker of the process-group modules (tests/conftest.py PROCESS_GROUPS): their session's
    # `ddp` run is this test's too, not trained again on the other worker
    pytest.mark.xdist_group("process_groups"),
]


class Rank(Checkpoints):
    """read_checkpoint as rank `rank` of `world` data-parallel ranks reads it (no process group)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world


@pytest.mark.distributed
def test_a_checkpoint_keeps_each_ranks_gate_reference_and_a_resume_gives_each_its_own(ddp):
    """The undisturbed 2-rank DDP run (the session's): its checkpoint at step 5, read by each rank."""
    path = ddp[0] / "checkpoints" / "step_000005"
    saved = json.loads((path / "state.json").read_text())
    gates = saved["row_gate_by_rank"]
    assert len(gates) == 2 and gates[0] == saved["row_gate"] and gates[0]["recent"] != gates[1]["recent"]
    for rank, world, own in ((1, 2, 1), (2, 3, 0)):  # another world: rank mod the saved one
        assert Rank(rank, world).read_checkpoint(path)[2]["row_gate"] == gates[own]


def test_a_checkpoint_without_every_ranks_reference_resumes_as_before():
    """One process, a checkpoint from before, or the gate off: the state is left as it is."""
    from trimtab.distributed.checkpoint import own_gate, with_gates

    state = {"row_gate": {"recent": [1.0], "written": 1, "judged": 1}}
    assert with_gates(state, [None, None]) is state and own_gate(state, 1) is state
    assert own_gate({**state, "row_gate_by_rank": [None, None]}, 1) == {**state, "row_gate_by_rank": [None, None]}
