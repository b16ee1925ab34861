"""Tensor (+ sequence) parallelism on CPU: gloo processes under torchrun against one process.

Each run trains the debug preset for 10 steps through tests/dist_worker.py (one thread per
process; 4 processes run on the 2-core CI machine).
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
from trimtab.distributed.splits import check_tensor_parallel
from trimtab.errors import ConfigError

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
TP2 = {"distributed": {"tp": 2}}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2") / "run"
    return out, run(out, 2, **TP2)


def grad_norms(record: dict) -> list[float]:
    return [s["grad_norm"] for s in record["steps"]]


@pytest.mark.distributed
def test_tp2_matches_one_process(single, tp2):
    """Two tensor-parallel ranks are one replica: the same rows, the same loss and gradient norm
    as one process, and whole weights equal to its."""
    base = single[1]
    for record in tp2[1]:
        assert_close(losses(record), losses(base))
        assert_close(grad_norms(record), grad_norms(base))
        assert_close(record["weights"], base["weights"])
        assert [s["rows"] for s in record["steps"]] == [s["rows"] for s in base["steps"]]
    theirs, ours = final_weights(single[0]), final_weights(tp2[0])
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor, rtol=1e-4, atol=1e-5), name
    shards = sorted(p.name for p in (list_checkpoints(tp2[0])[-1] / "dcp").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.distributed
def test_tp2_under_selective_checkpointing_matches_one_process(single, tmp_path):
    """Selective checkpointing's saved outputs are DTensors under tensor parallelism, and its
    re-run gathers the sequence-parallel activations again: the same run as one process's."""
    records = run(tmp_path / "tp2-selective", 2, **TP2, train={"activation_checkpointing": "selective"})
    for record in records:
        assert_close(losses(record), losses(single[1]))
        assert_close(record["weights"], single[1]["weights"])


@pytest.mark.distributed
def test_tp_by_dp_with_fsdp2_matches_one_process(single, tmp_path):
    """A 2 x 2 mesh: ranks 0-1 and 2-3 are two replicas, each split by tensor parallelism and
    sharded by FSDP2 over the replicas; a replica reads half of every step's rows."""
    records = run(tmp_path / "2d", 4, distributed={"tp": 2, "strategy": "fsdp"})
    for record in records:
        assert_close(losses(record), losses(single[1]))
        assert_close(record["weights"], single[1]["weights"])
    for step in range(STEPS):
        rows = [records[r]["steps"][step]["rows"] for r in range(4)]
        assert rows[0] == rows[1] and rows[2] == rows[3] and not set(rows[0]) & set(rows[2])
        assert sorted(rows[0] + rows[2]) == single[1]["steps"][step]["rows"]


@pytest.mark.distributed
def test_checkpoints_reshard_between_meshes(single, tp2, tmp_path):
    """The TP=2 run's step-5 checkpoint resumed by one process, and the one-process run's resumed
    under TP=2, both continue as the one-process run did (1e-5)."""
    for source, nproc, overrides in ((tp2[0], 1, {}), (single[0], 2, TP2)):
        run_dir = tmp_path / f"from-{nproc}"
        shutil.copytree(source, run_dir)
        shutil.rmtree(list_checkpoints(run_dir)[-1])  # back to step 5
        records = run(run_dir, nproc, **overrides)
        for record in records:
            assert [s["step"] for s in record["steps"]] == list(range(6, STEPS + 1))
            assert_close(losses(record), losses(single[1])[5:], rel=1e-5)


# slow tier: the hybrid preset's MoD and MoE blocks under TP; tp2 on debug stays in the default tier
# (CI under 10 minutes, issue 31)
@pytest.mark.slow
@pytest.mark.distributed
def test_hybrid_preset_with_qk_norm_under_tp2_matches_one_process(reference, tmp_path):
    """debug-hybrid (dense, MoE, MoD and MoE+MoD layers) with qk_norm: the MoE layers split each
    expert's hidden units, the MoD blocks run on the whole sequence (their capacity warms up
    through token counts like 55 of 64, odd, so nothing needs k divisible by tp), the qk gains
    see each rank's heads. Loss, gradient norm and weights as one process."""
    one = reference(**HYBRID)[1]
    for record in run(tmp_path / "tp2", 2, **HYBRID, **TP2):
        assert_close(losses(record), losses(one))
        assert_close(grad_norms(record), grad_norms(one))
        assert_close(record["weights"], one["weights"])


@pytest.mark.distributed
def test_faults_under_tensor_parallelism_are_decided_alike(tmp_path):
    """NaN loss on rank 1 only: both skip. Out of memory at step 6 (both ranks): both halve the
    micro-batch and retry. SIGTERM on rank 1 only: both stop after step 8 with one checkpoint."""
    faults = ["nan_loss@4@rank1", "oom@6:600", "sigterm@8@rank1"]
    # one block: each block's tensor-parallel collectives add time, not another way to disagree
    rank0, rank1 = run(tmp_path / "faults", 2, faults=faults, model={"n_layers": 1}, **TP2)
    assert rank0["decisions"] == rank1["decisions"]
    for record in (rank0, rank1):
        record["state"].pop("train_seconds")
    assert rank0["state"] == rank1["state"] and rank0["weights"] == rank1["weights"]
    actions = {(d["step"], d["rule"], d["action"]) for d in rank0["decisions"]}
    assert (4, "nonfinite", "skip_step") in actions and (6, "oom", "set_micro_batch_tokens") in actions
    assert rank0["steps"][3]["skipped"] and rank0["summary"]["status"] == "stopped (SIGTERM)"
    assert list_checkpoints(tmp_path / "faults")[-1].name == "step_000008"
    journal = [json.loads(line) for line in (tmp_path / "faults" / "decisions.jsonl").read_text().splitlines()]
    assert [(d["step"], d["action"]) for d in journal] == [(d["step"], d["action"]) for d in rank0["decisions"]]


def test_tensor_parallel_settings_that_do_not_fit_are_named():
    cfg = load_config(preset="debug", sets=["distributed.tp=2"])
    with pytest.raises(ConfigError, match="distributed.tp.*does not divide the 3 processes"):
        Mesh.of(cfg.distributed, 3)
    assert Mesh.of(cfg.distributed, 4) == Mesh(dp=2, tp=2) and cfg.distributed.data_parallel == "fsdp"  # auto
    ddp = load_config(preset="debug", sets=["distributed.tp=2", "distributed.strategy=ddp"])
    with pytest.raises(ConfigError, match="strategy=fsdp"):
        Mesh.of(ddp.distributed, 4)  # 2 replicas under DDP
    assert Mesh.of(cfg.distributed, 2) == Mesh(dp=1, tp=2)
    with pytest.raises(ConfigError, match="distributed.tp"):
        load_config(preset="debug", sets=["distributed.tp=0"])
    narrow = load_config(preset="debug", sets=["model.vocab_size=96", "model.n_kv_heads=1"]).model
    with pytest.raises(ConfigError, match="must divide model.n_kv_heads"):
        check_tensor_parallel(narrow, 2)
    check_tensor_parallel(load_config(preset="debug-hybrid", sets=["model.vocab_size=96"]).model, 2)
    odd = load_config(preset="debug-moe", sets=["model.vocab_size=96", "model.moe.expert_hidden=97"]).model
    with pytest.raises(ConfigError, match="must divide model.moe.expert_hidden"):
        check_tensor_parallel(odd, 2)
