"""Pipeline parallelism on CPU: gloo processes under torchrun against one process.

Each run trains a debug preset for 10 steps through tests/dist_worker.py (one thread per
process). Stage ranks hold different layers, so weights are compared through the checkpoints.
"""

import json
import shutil

import pytest
import torch
import torch.distributed as dist

from helpers import HYBRID, STEPS, assert_close, final_weights, losses, run
from trimtab.checkpoint import list_checkpoints
from trimtab.config import load_config
from trimtab.distributed.mesh import Mesh
from trimtab.distributed.pipeline import stage_cuts
from trimtab.errors import ConfigError

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
PP2 = {"distributed": {"pp": 2}}


def grad_norms(record: dict) -> list[float]:
    return [s["grad_norm"] for s in record["steps"]]


def assert_same_run(record: dict, base: dict) -> None:
    """Loss, gradient norm, auxiliary loss and router telemetry of every step as one process."""
    assert_close(losses(record), losses(base))
    assert_close(grad_norms(record), grad_norms(base))
    for ours, theirs in zip(record["steps"], base["steps"]):
        assert ours["rows"] == theirs["rows"]
        if theirs["aux"] is not None:
            assert_close([ours["aux"]], [theirs["aux"]])
        for key in ("moe", "mod"):
            flat = lambda v: [x for row in v for x in row] if v else []  # noqa: E731
            assert_close(flat(ours[key]), flat(theirs[key]))


def assert_same_weights(ours_dir, theirs_dir, rel: float = 1e-4) -> None:
    theirs, ours = final_weights(theirs_dir), final_weights(ours_dir)
    assert set(ours) - set(theirs) <= {"lm_head.weight"}  # a sharded checkpoint names the tied copy too
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor, rtol=rel, atol=1e-5), name


@pytest.fixture(scope="module")
def hybrid(reference, tmp_path_factory):
    """debug-hybrid (helpers.HYBRID) in one process and PP=2, as {nproc: (run dir, records)}."""
    out = tmp_path_factory.mktemp("pp") / "2"
    one_dir, one = reference(**HYBRID)
    return {1: (one_dir, [one]), 2: (out, run(out, 2, **HYBRID, **PP2))}


@pytest.mark.distributed
def test_pp2_matches_one_process(hybrid):
    """Two stages of two layers each (1F1B): the loss on the last stage, the MoE balance and MoD
    predictor losses attached on the stage that computes them, the router statistics gathered
    from both stages, the tied embedding's two copies summed: all as one process, and the
    weights written by the two stages together equal to its."""
    (one_dir, (one,)), (pp_dir, records) = hybrid[1], hybrid[2]
    for record in records:
        assert_same_run(record, one)
        assert record["decisions"] == records[0]["decisions"]
    assert_same_weights(pp_dir, one_dir)
    shards = sorted(p.name for p in (list_checkpoints(pp_dir)[-1] / "dcp").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.distributed
def test_checkpoints_reshard_between_pipeline_and_one_process(hybrid, tmp_path):
    """PP=2's step-5 checkpoint resumed by one process and under PP=2, and one process's resumed
    under PP=2, all continue as the one-process run did (1e-5)."""
    one_losses = losses(hybrid[1][1][0])
    # and PP=2's under PP=2: its stages' param groups were written under one key (KeyError 'betas')
    for source, nproc in ((hybrid[2][0], 1), (hybrid[1][0], 2), (hybrid[2][0], 2)):
        run_dir = tmp_path / f"from-{source.name}-{nproc}"
        shutil.copytree(source, run_dir)
        shutil.rmtree(list_checkpoints(run_dir)[-1])  # back to step 5
        for record in run(run_dir, nproc, **HYBRID, **({} if nproc == 1 else PP2)):
            assert [s["step"] for s in record["steps"]] == list(range(6, STEPS + 1))
            assert_close(losses(record), one_losses[5:], rel=1e-5)


@pytest.mark.distributed
def test_interleaved_and_pipeline_by_fsdp2_match_one_process(single, reference, tmp_path):
    """debug (5 layers) as 4 stages on 2 ranks (interleaved 1F1B), and debug-moe on a 2 x 2 mesh:
    two stages, each sharded by FSDP2 over its two replicas (a replica reads half the rows)."""
    for record in run(tmp_path / "v2", 2, distributed={"pp": 2, "pp_stages_per_rank": 2}):
        assert_same_run(record, single[1])
    assert_same_weights(tmp_path / "v2", single[0])
    one_dir, one = reference(preset="debug-moe")
    records = run(tmp_path / "2d", 4, preset="debug-moe", **PP2)
    for step in range(STEPS):
        rows = [records[r]["steps"][step]["rows"] for r in range(4)]
        assert rows[0] == rows[2] and rows[1] == rows[3] and not set(rows[0]) & set(rows[1])
        assert sorted(rows[0] + rows[1]) == one["steps"][step]["rows"]
    for record in records:
        assert_close(losses(record), losses(one))
        assert_close(grad_norms(record), grad_norms(one))
    assert_same_weights(tmp_path / "2d", one_dir)


# slow tier: a combination of layouts each tested alone in the default tier (CI under 10 minutes, issue 31)
@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_by_tensor_and_expert_parallelism_match_one_process(reference, tmp_path):
    """3D meshes on 4 processes: debug as 2 stages x 2 tensor-parallel ranks (stages exchange
    each rank's T / tp positions), debug-moe as 2 stages x 2 replicas splitting the experts."""
    for preset, section in (("debug", {"tp": 2}), ("debug-moe", {"ep": 2})):
        one_dir, one = reference() if preset == "debug" else reference(preset=preset)
        for record in run(tmp_path / preset, 4, preset=preset, distributed={"pp": 2, **section}):
            assert_close(losses(record), losses(one))
            assert_close(grad_norms(record), grad_norms(one))
        assert_same_weights(tmp_path / preset, one_dir)


@pytest.mark.distributed
def test_faults_under_pipeline_parallelism_are_decided_alike(tmp_path):
    """NaN loss (computed on the last stage, rank 1): both skip. Out of memory at step 6 in the
    first stage's forward (rank 0), inside the schedule: the stage hands zeros on, the schedule
    ends, both halve the micro-batch and retry. SIGTERM on rank 1 only: both stop after step 8."""
    faults = ["nan_loss@4@rank1", "oom@6:600", "sigterm@8@rank1"]
    rank0, rank1 = run(tmp_path / "faults", 2, faults=faults, **PP2)
    assert rank0["decisions"] == rank1["decisions"]
    for record in (rank0, rank1):
        record["state"].pop("train_seconds")
    assert rank0["state"] == rank1["state"]
    actions = {(d["step"], d["rule"], d["action"]) for d in rank0["decisions"]}
    assert (4, "nonfinite", "skip_step") in actions and (6, "oom", "set_micro_batch_tokens") in actions
    assert rank0["steps"][3]["skipped"] and rank0["summary"]["status"] == "stopped (SIGTERM)"
    assert [s["micro_batches"] for s in rank0["steps"]][4:6] == [2, 4]  # halved at step 6
    assert list_checkpoints(tmp_path / "faults")[-1].name == "step_000008"
    journal = [json.loads(line) for line in (tmp_path / "faults" / "decisions.jsonl").read_text().splitlines()]
    assert [(d["step"], d["action"]) for d in journal] == [(d["step"], d["action"]) for d in rank0["decisions"]]


def test_stage_cuts_balance_cost():
    assert stage_cuts([1.0] * 4, 0.0, 2) == [0, 2, 4]
    assert stage_cuts([1.0] * 5, 0.0, 4) == [0, 1, 2, 4, 5]
    # a heavy vocabulary projection on the last stage moves a layer to the first
    assert stage_cuts([1.0] * 6, 2.0, 2) == [0, 4, 6]
    # every stage gets at least one layer, however uneven
    cuts = stage_cuts([10.0, 1.0, 1.0, 1.0], 0.0, 4)
    assert cuts == [0, 1, 2, 3, 4]


def test_pipeline_settings_that_do_not_fit_are_named():
    cfg = load_config(preset="debug", sets=["distributed.pp=2"])
    assert Mesh.of(cfg.distributed, 4) == Mesh(dp=2, pp=2) and cfg.distributed.data_parallel == "fsdp"
    with pytest.raises(ConfigError, match="distributed.pp.*does not divide the 3 processes"):
        Mesh.of(cfg.distributed, 3)
    for sets, match in (
        (["distributed.pp=0"], "distributed.pp"),
        (["distributed.pp=2", "distributed.strategy=ddp"], "distributed.strategy"),
        (["distributed.pp_schedule=1f1b", "distributed.pp_stages_per_rank=2"], "pp_stages_per_rank"),
        (["distributed.pp_schedule=interleaved"], "pp_stages_per_rank >= 2"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(preset="debug", sets=sets)
    auto = load_config(preset="debug", sets=["distributed.pp_stages_per_rank=2"]).distributed
    assert auto.schedule == "interleaved"


@pytest.mark.distributed
def test_a_nan_loss_aimed_at_the_first_stage_is_skipped(tmp_path):
    """nan_loss@3@rank0 under PP=2: rank 0 holds the first stage, not the loss; its stage output
    goes NaN, so the loss on the last stage does, and both ranks skip step 3 as one process would."""
    rank0, rank1 = run(tmp_path / "nan", 2, faults=["nan_loss@3@rank0"], train={"max_steps": 4}, **PP2)
    assert rank0["decisions"] == rank1["decisions"]
    assert (3, "nonfinite", "skip_step") in {(d["step"], d["rule"], d["action"]) for d in rank0["decisions"]}
    assert [s["skipped"] for s in rank0["steps"]] == [False, False, True, False]
    assert [s["skipped"] for s in rank1["steps"]] == [False, False, True, False]
