"""Expert parallelism and Mixture-of-Experts layers under tensor parallelism, on CPU: gloo
processes under torchrun against one process, training debug-moe for 10 steps through
tests/dist_worker.py (one thread per process; 4 processes run on the 2-core CI machine).

Every run uses 64-row steps in 16-row micro-batches, so each data-parallel replica's
micro-batches hold exactly the rows of one of the single process's (data/packing.shard_rows):
the capacity drops and the balance loss, which depend on what shares a micro-batch, are then
the single process's too, and the comparison is exact up to summation order.
"""

import shutil

import pytest
import torch
import torch.distributed as dist

from helpers import STEPS, assert_close, final_weights, losses, run
from trimtab.checkpoint import list_checkpoints
from trimtab.config import load_config
from trimtab.config.distributed import check_moe_split
from trimtab.distributed.mesh import Mesh
from trimtab.errors import ConfigError
from trimtab.model import build_model
from trimtab.training.surgery import moe_layer

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
# the aux-loss-free bias on: it moves with every rank's expert loads, so they must be agreed
MOE = {"preset": "debug-moe", "train": {"batch_tokens": 4096}, "model": {"moe": {"bias_update_rate": 1e-3}}}
EP2 = {"distributed": {"ep": 2}}


def grad_norms(record: dict) -> list[float]:
    return [s["grad_norm"] for s in record["steps"]]


def assert_matches(records: list[dict], base: dict) -> None:
    for record in records:
        assert_close(losses(record), losses(base))
        assert_close(grad_norms(record), grad_norms(base))
        assert_close(record["weights"], base["weights"])


@pytest.fixture(scope="module")
def moe_one(reference):
    return reference(**MOE)


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep2") / "run"
    return out, run(out, 2, **MOE, **EP2)


@pytest.mark.distributed
def test_ep2_matches_one_process(moe_one, ep2):
    """Two replicas, each holding 4 of the 8 experts of every MoE layer and exchanging tokens
    with all-to-all: the loss, gradient norm and whole weights are one process's."""
    assert_matches(ep2[1], moe_one[1])
    theirs, ours = final_weights(moe_one[0]), final_weights(ep2[0])
    assert "blocks.1.ffn.w1" in theirs and theirs.keys() <= ours.keys()  # (DCP lists the tied head too)
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor, rtol=1e-4, atol=1e-5), name


# slow tier: a combination of layouts each tested alone in the default tier (CI under 10 minutes, issue 31)
@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_by_ep2_matches_one_process(moe_one, tmp_path):
    """The issue's mesh: `torchrun --nproc_per_node 4 -m trimtab train --preset debug-moe --set
    distributed.tp=2 --set distributed.ep=2`. Ranks 0-1 and 2-3 are two replicas split by tensor
    parallelism (every MoE layer routed alike on both, each computing half of every expert's
    hidden units); the replicas split the experts (ranks 0 and 2 exchange tokens, 1 and 3)."""
    records = run(tmp_path / "tp2ep2", 4, **MOE, distributed={"tp": 2, "ep": 2})
    assert_matches(records, moe_one[1])
    for step in range(STEPS):
        rows = [records[r]["steps"][step]["rows"] for r in range(4)]
        assert rows[0] == rows[1] and rows[2] == rows[3] and not set(rows[0]) & set(rows[2])


@pytest.mark.distributed
def test_ep2_by_dp2_shards_experts_over_the_expert_groups(moe_one, tmp_path):
    """Four replicas, two expert groups of two: each expert's gradient is its group's; FSDP2
    shards the experts over the two groups' copies (their own mesh, edp) and reduce-scatters
    their gradients there, the dense weights over all four."""
    assert_matches(run(tmp_path / "ep2dp2", 4, **MOE, **EP2), moe_one[1])


@pytest.mark.distributed
@pytest.mark.slow  # 4 ranks, 19 s; CI keeps TP x FSDP2 (test_tensor_parallel.py) and EP x DP (above)
def test_tp2_by_dp2_shards_the_split_experts_with_fsdp2(moe_one, tmp_path):
    """Tensor parallelism alone splits each expert's hidden units; with two replicas FSDP2
    shards those DTensors over dp like any other weight (bench/comm.py found them left out once:
    summed correctly, but held whole by both replicas)."""
    assert_matches(run(tmp_path / "tp2dp2", 4, **MOE, distributed={"tp": 2}), moe_one[1])


@pytest.mark.distributed
def test_expert_parallelism_under_selective_checkpointing_matches_one_process(moe_one, tmp_path):
    """Selective checkpointing (model/recompute.py) keeps each block's matmul and routing outputs;
    its backward's re-run exchanges the tokens between the expert groups again (the all-to-all's
    output is not kept) and takes the kept top-k: the run is one process's without checkpointing."""
    selective = {**MOE, "train": {**MOE["train"], "activation_checkpointing": "selective"}}
    assert_matches(run(tmp_path / "ep2-selective", 2, **selective, **EP2), moe_one[1])


@pytest.mark.distributed
def test_expert_parallel_checkpoints_reshard(moe_one, ep2, tmp_path):
    """The EP=2 run's step-5 checkpoint resumed in one process, and the one-process run's
    resumed under EP=2, both continue as the one-process run did (1e-5)."""
    for source, nproc, overrides in ((ep2[0], 1, {}), (moe_one[0], 2, EP2)):
        run_dir = tmp_path / f"from-{nproc}"
        shutil.copytree(source, run_dir)
        shutil.rmtree(list_checkpoints(run_dir)[-1])  # back to step 5
        for record in run(run_dir, nproc, **MOE, **overrides):
            assert [s["step"] for s in record["steps"]] == list(range(6, STEPS + 1))
            assert_close(losses(record), losses(moe_one[1])[5:], rel=1e-5)


@pytest.mark.distributed
def test_faults_under_expert_parallelism_are_decided_alike(tmp_path):
    """NaN loss and SIGTERM on rank 1 only, a routing collapse on both (seen in the agreed
    expert loads): the same decisions on both ranks."""
    faults = ["expert_collapse@2:2", "nan_loss@4@rank1", "sigterm@8@rank1"]
    rank0, rank1 = run(tmp_path / "faults", 2, faults=faults, orchestrator={"moe": {"window": 2}}, **MOE, **EP2)
    assert rank0["decisions"] == rank1["decisions"]
    for record in (rank0, rank1):
        record["state"].pop("train_seconds")
    assert rank0["state"] == rank1["state"] and rank0["weights"] == rank1["weights"]
    actions = {(d["step"], d["rule"], d["action"]) for d in rank0["decisions"]}
    assert (4, "nonfinite", "skip_step") in actions
    assert rank0["summary"]["status"] == "stopped (SIGTERM)"
    collapse = [d for d in rank0["decisions"] if d["rule"] == "moe"]
    assert collapse and collapse[0]["step"] <= 4 and collapse[0]["applied"], rank0["decisions"]


def test_expert_surgery_under_a_mesh_is_refused_with_the_reason():
    """What the journal records when the orchestrator (or a person) asks for surgery under
    torchrun: Control turns the error into a 'failed: ...' line of the decision."""
    model = build_model(load_config(preset="debug-moe", sets=["model.vocab_size=96"]).model)
    with pytest.raises(ConfigError, match=r"split over distributed.ep=2 ranks\); run it in one process"):
        moe_layer(model, 1, world=4, ep=2)
    with pytest.raises(ConfigError, match="split by distributed.tp=2"):
        moe_layer(model, 1, world=2, tp=2)
    with pytest.raises(ConfigError, match="pipeline stages"):
        moe_layer(model, 1, world=2, pp=2)
    assert moe_layer(model, 1, world=1) is model.blocks[1].ffn


@pytest.mark.distributed
def test_expert_parallelism_of_a_dense_model_is_refused_at_the_start(tmp_path):
    """It ran as plain FSDP2, silently: the check was reached only with MoE layers on the rank."""
    from helpers import run

    with pytest.raises(AssertionError, match=r"distributed.ep=2: the model has no MoE layers to split"):
        run(tmp_path / "r", 2, distributed={"ep": 2, "strategy": "fsdp"})


def test_expert_parallel_settings_that_do_not_fit_are_named():
    cfg = load_config(preset="debug-moe", sets=["distributed.ep=2"])
    assert cfg.distributed.data_parallel == "fsdp"  # auto: experts split need FSDP2
    assert Mesh.of(cfg.distributed, 4) == Mesh(dp=4, tp=1, ep=2) and Mesh(dp=4, ep=2).edp == 2
    with pytest.raises(ConfigError, match="distributed.ep.*does not divide the 3 data-parallel"):
        Mesh.of(cfg.distributed, 3)
    with pytest.raises(ConfigError, match="distributed.strategy.*ddp"):
        load_config(preset="debug-moe", sets=["distributed.ep=2", "distributed.strategy=ddp"])
    model = load_config(preset="debug-moe", sets=["model.vocab_size=96"]).model
    with pytest.raises(ConfigError, match="must divide model.moe.n_experts"):
        check_moe_split(model, 1, 3)
    with pytest.raises(ConfigError, match="no MoE layers"):
        check_moe_split(load_config(preset="debug", sets=["model.vocab_size=96"]).model, 1, 2)
    jitter = load_config(preset="debug-moe", sets=["model.vocab_size=96", "model.moe.router_jitter=0.1"]).model
    with pytest.raises(ConfigError, match="router_jitter"):
        check_moe_split(jitter, 2, 1)
    check_moe_split(jitter, 1, 2)  # expert parallelism alone routes on each replica's own rows
