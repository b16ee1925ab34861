"""Data parallelism on CPU: 2 gloo processes under torchrun against one process, same global batch.

Each run trains the debug preset for 10 steps through tests/dist_worker.py, which records what its
rank saw; one thread per process (the CI machine has 2 cores).
"""

import json
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist

from helpers import STEPS, assert_close, final_weights, losses, run
from trimtab.api import load_run
from trimtab.checkpoint import list_checkpoints
from trimtab.config import load_config
from trimtab.data.batches import BatchLoader, shard_rows
from trimtab.data.packing import Rows
from trimtab.errors import ConfigError
from trimtab.orchestrator.fault_specs import parse_fault

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def check_parity(single, records, run_dir) -> None:
    base_dir, base = single
    for record in records:
        assert record["world"] == 2 and record["summary"] == base["summary"]
        assert_close(losses(record), losses(base))
        assert_close(record["weights"], base["weights"])
    assert [s["micro_batches"] for s in records[0]["steps"]] == [1] * STEPS  # 1024 of 2048 tokens each
    assert [s["micro_batches"] for s in base["steps"]] == [2] * STEPS
    theirs, ours = final_weights(base_dir), final_weights(run_dir)
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor, rtol=1e-4, atol=1e-5), name
    # rank 0 alone writes the run directory's logs
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [m["loss"] for m in lines if "loss" in m]
    assert_close(logged, losses(base))


@pytest.mark.distributed
def test_ddp_matches_one_process_for_the_same_global_batch(single, ddp):
    check_parity(single, ddp[1], ddp[0])
    assert (list_checkpoints(ddp[0])[-1] / "dcp" / ".metadata").is_file()


@pytest.mark.distributed
def test_fsdp2_matches_one_process_for_the_same_global_batch(single, fsdp):
    check_parity(single, fsdp[1], fsdp[0])
    shards = sorted(p.name for p in (list_checkpoints(fsdp[0])[-1] / "dcp").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.distributed
def test_moe_routing_and_balancing_bias_match_one_process(tmp_path):
    """Router capacity and the balance loss depend on which rows share a micro-batch, and the
    aux-loss-free bias on every rank's expert loads (all-reduced): all as in one process."""
    moe = {"preset": "debug-moe", "model": {"moe": {"bias_update_rate": 1e-3}}, "train": {"max_steps": 6}}
    one = run(tmp_path / "one", 1, **moe)[0]
    two = run(tmp_path / "two", 2, **moe)
    for record in two:
        assert_close(losses(record), losses(one))
        assert_close(record["weights"], one["weights"])


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_fault_on_one_rank_is_decided_alike_on_both(tmp_path, strategy):
    """NaN loss on rank 1 only: both skip the update. Rank 1 alone runs out of memory in the
    middle of a forward (inside the first block): both halve the micro-batch and retry the same
    rows; under FSDP2 rank 0 is then waiting in the next block's all-gather, so rank 1's block
    hands its input on and rank 1 says so at the step's agreement point instead of leaving rank
    0 to the collective timeout. Rank 1 alone gets SIGTERM: both stop after the same step and
    save one checkpoint."""
    faults = ["nan_loss@4@rank1", "oom@6:600@rank1", "sigterm@8@rank1"]
    rank0, rank1 = run(tmp_path / "faults", 2, faults=faults, distributed={"strategy": strategy})
    assert rank0["decisions"] == rank1["decisions"]
    for record in (rank0, rank1):
        record["state"].pop("train_seconds")  # each rank's own clock
    assert rank0["state"] == rank1["state"] and rank0["weights"] == rank1["weights"]

    def agreed(steps):  # each rank's own rows aside
        return [{k: v for k, v in s.items() if k != "rows"} for s in steps]

    assert agreed(rank0["steps"]) == agreed(rank1["steps"])
    actions = {(d["step"], d["rule"], d["action"]) for d in rank0["decisions"]}
    assert (4, "nonfinite", "skip_step") in actions and (6, "oom", "set_micro_batch_tokens") in actions
    assert rank0["steps"][3]["skipped"] and rank0["state"]["micro_batch_tokens"] == 512
    assert [s["micro_batches"] for s in rank0["steps"]][5:] == [2, 2, 2]  # shrunk from step 6 on
    assert rank0["summary"] == rank1["summary"]
    assert rank0["summary"].items() >= {"status": "stopped (SIGTERM)", "step": 8, "tokens": 8 * 2048}.items()
    assert list_checkpoints(tmp_path / "faults")[-1].name == "step_000008"
    journal = [json.loads(line) for line in (tmp_path / "faults" / "decisions.jsonl").read_text().splitlines()]
    assert [(d["step"], d["action"]) for d in journal] == [(d["step"], d["action"]) for d in rank0["decisions"]]
    assert (tmp_path / "faults" / "faults.rank1.json").is_file()  # rank 1 remembers its own firings


@pytest.mark.distributed
def test_a_replica_gone_bad_alone_is_rolled_back_on_every_rank(tmp_path):
    """NaN weights in rank 1's replica only: both ranks roll back to the step-5 sharded checkpoint
    together at the first NaN step (the weights' check is all-reduced, so rank 0, whose weights are
    fine, does not skip on its own); replicas are equal again after."""
    rank0, rank1 = run(tmp_path / "bad", 2, faults=["weights_nan@7@rank1"], train={"max_steps": 12})
    assert rank0["decisions"] == rank1["decisions"] and rank0["weights"] == rank1["weights"]
    assert ("nonfinite", "rollback") in {(d["rule"], d["action"]) for d in rank0["decisions"]}
    assert rank0["state"]["rollbacks"] == 1 and rank0["summary"]["status"] == "completed"


@pytest.mark.distributed
def test_two_rank_checkpoint_resumes_in_one_process(single, fsdp, tmp_path):
    """The FSDP run's step-5 checkpoint (two shards) resumed by one process gives the one-process
    run's losses for steps 6-10; the sharded weights also load for generation."""
    run_dir = tmp_path / "resumed"
    shutil.copytree(fsdp[0], run_dir)
    shutil.rmtree(list_checkpoints(run_dir)[-1])  # back to step 5
    record = run(run_dir, 1)[0]
    assert record["world"] == 1 and [s["step"] for s in record["steps"]] == list(range(6, STEPS + 1))
    assert_close(losses(record), losses(single[1])[5:])
    cfg, model, _ = load_run(fsdp[0])
    assert cfg.distributed.strategy == "fsdp" and model.tok_emb.weight.shape[0] == cfg.model.vocab_size


# ---------------------------------------------------------------------------------- units (fast)


def test_each_rank_takes_a_disjoint_share_with_equal_micro_batch_counts():
    lengths = np.array([64, 10, 64, 30, 64, 5, 64])
    starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]])  # row i holds lengths[i] + 1 tokens
    tokens = np.random.default_rng(0).integers(0, 50, int((lengths + 1).sum())).astype(np.int32)
    rows = Rows(tokens, np.ones(len(tokens), dtype=bool), starts, lengths)
    shares = shard_rows(rows, list(range(len(lengths))), 2)
    assert sorted(shares[0] + shares[1]) == list(range(len(lengths))) and not set(shares[0]) & set(shares[1])
    loaders = [BatchLoader(rows, 400, 64, seed=0, pad_id=0, rank=r, world=2) for r in range(2)]
    one = BatchLoader(rows, 400, 64, seed=0, pad_id=0).next_batch()
    steps = [loader.next_batch() for loader in loaders]
    assert steps[0].rows == steps[1].rows == one.rows  # the same global step
    assert steps[0].n_targets == steps[1].n_targets == one.n_targets  # the global count
    assert sum(m.n_targets for s in steps for m in s.micro) == one.n_targets
    assert len(steps[0].micro) == len(steps[1].micro)  # FSDP: the same number of forwards


def test_distributed_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="distributed.strategy"):
        load_config(preset="debug", sets=["distributed.strategy=zero3"])
    with pytest.raises(ConfigError, match="distributed.cpu_offload.*fsdp"):
        load_config(preset="debug", sets=["distributed.cpu_offload=true"])
    with pytest.raises(ConfigError, match="distributed.find_unused_parameters"):
        load_config(preset="debug", sets=["distributed.strategy=fsdp", "distributed.find_unused_parameters=true"])
    cfg = load_config(
        preset="debug",
        sets=["distributed.strategy=fsdp", "distributed.cpu_offload=true", "distributed.param_dtype=bf16"],
    )
    assert cfg.distributed.cpu_offload and cfg.distributed.param_dtype == "bf16"


@pytest.mark.distributed
def test_faults_every_rank_met_do_not_fire_again_when_the_world_grows(tmp_path):
    """One process meets nan_loss@3 and stops at step 6; resumed on two ranks, the new rank 1
    (no record of its own) fired both again: a NaN step and a stop at step 7."""
    faults = ["nan_loss@3", "sigterm@6"]
    (alone,) = run(tmp_path / "r", 1, faults=faults)
    assert alone["summary"]["status"] == "stopped (SIGTERM)"
    rank0, rank1 = run(tmp_path / "r", 2, faults=faults)
    for record in (rank0, rank1):
        again = [(d["step"], d["rule"]) for d in record["decisions"] if d["step"] > 6 and d["rule"] == "nonfinite"]
        assert record["summary"]["status"] == "completed" and not again, again


def test_a_fault_can_name_its_rank(tmp_path):
    assert parse_fault("oom@6:600@rank1").rank == 1 and parse_fault("oom@6:600").rank is None
    with pytest.raises(ConfigError, match="@rankR"):
        parse_fault("nan_loss@3@rankx")
    # one the job has not is said at the start (it never fired, silently)
    from trimtab.api import train_or_raise

    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "r"), "faults": ["nan_loss@1@rank5"]})
    with pytest.raises(ConfigError, match=r"faults: nan_loss@1@rank5 names a rank this job has not \(ranks 0-0\)"):
        train_or_raise(cfg)


@pytest.mark.distributed
def test_a_prepared_mixture_is_split_disjointly_and_matches_one_process(tmp_path):
    """Two prepared sources mixed 70/30: each rank reads its own rows of every step, together
    exactly one process's rows, and the training matches."""
    from trimtab.config import DataConfig
    from trimtab.data.prepare import prepare
    from trimtab.data.sources import read_documents

    docs = read_documents(DataConfig(max_bytes=150_000))[0]
    for name, part in (("a", docs[::2]), ("b", docs[1::2])):
        (tmp_path / f"{name}-src").mkdir()
        lines = [json.dumps({"text": d.text}) for d in part]
        (tmp_path / f"{name}-src" / "part.jsonl").write_text("\n".join(lines) + "\n")
    prepare([str(tmp_path / "a-src")], tmp_path / "a", vocab_size=512)
    prepare([str(tmp_path / "b-src")], tmp_path / "b", tokenizer=str(tmp_path / "a" / "tokenizer.json"))
    mix = {"mix": [{"source": str(tmp_path / "a"), "weight": 0.7}, {"source": str(tmp_path / "b"), "weight": 0.3}]}
    one = run(tmp_path / "one", 1, data=mix)[0]
    two = run(tmp_path / "two", 2, data=mix)
    for step, mine, theirs, whole in zip(range(STEPS), two[0]["steps"], two[1]["steps"], one["steps"]):
        assert not set(mine["rows"]) & set(theirs["rows"]), step
        assert sorted(mine["rows"] + theirs["rows"]) == whole["rows"], step
    for record in two:
        assert_close(losses(record), losses(one))


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_evaluation_failing_on_one_rank_is_abandoned_on_both(tmp_path, strategy):
    """eval_error on rank 1 alone: rank 0 does not wait for it in a collective; both journal the
    same eval_error decision and train on. FSDP2: rank 0 is inside the forward, in the next
    block's all-gather, when rank 1 fails; rank 1 joins its all-gathers before it says so."""
    rank0, rank1 = run(
        tmp_path / "r",
        2,
        faults=["eval_error@4@rank1"],
        train={"eval_every": 2, "max_steps": 6},
        distributed={"strategy": strategy},
    )
    assert rank0["decisions"] == rank1["decisions"]
    assert [(d["step"], d["rule"], d["action"]) for d in rank0["decisions"]] == [(4, "eval_error", "none")]
    assert rank0["summary"]["status"] == "completed" and rank0["summary"]["step"] == 6
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "val_loss" in m] == [2, 6]


@pytest.mark.distributed
def test_lean_snapshots_are_refused_under_fsdp2_before_training(tmp_path):
    """checkpoint.snapshot_every needs every weight on one rank: under FSDP2 each rank holds a
    shard, so the run stops at start-up naming the key, before a step is taken."""
    with pytest.raises(
        AssertionError, match=r"checkpoint\.snapshot_every: lean snapshots need every weight on one rank"
    ):
        run(tmp_path / "s", 2, distributed={"strategy": "fsdp"}, checkpoint={"snapshot_every": 2})
    assert not (tmp_path / "s" / "metrics.jsonl").is_file() or "loss" not in (tmp_path / "s/metrics.jsonl").read_text()


@pytest.mark.distributed
def test_a_bit_flipped_in_one_ranks_gradient_shard_is_rerun_under_fsdp2(tmp_path):
    """grad_bitflip@3:1 under FSDP2: the gradient rank 1 holds is its shard (a DTensor, filled by
    the reduce-scatter, never by a backward through the sharded parameter), so the flip lands in
    that shard; both ranks see the overflowing norm, compute the step again and apply the clean one."""
    fsdp2 = {"distributed": {"strategy": "fsdp"}, "train": {"max_steps": 4}}
    rank0, rank1 = run(tmp_path / "flip", 2, faults=["grad_bitflip@3:1"], **fsdp2)
    assert rank0["decisions"] == rank1["decisions"]
    [d] = [d for d in rank0["decisions"] if d["rule"] != "straggler"]
    assert (d["step"], d["rule"], d["action"]) == (3, "rerun", "rerun_step")
    assert [s["skipped"] for s in rank0["steps"]] == [False] * 4 and rank0["summary"]["status"] == "completed"


@pytest.mark.distributed
@pytest.mark.parametrize("fault, rule", [("inf_grad@3", "nonfinite"), ("grad_spike@3:1e6", "grad")])
def test_bad_gradients_land_in_fsdp2_shards_and_are_skipped(tmp_path, fault, rule):
    """FSDP2's reduce-scatter fills a sharded parameter's gradient (no hook on the parameter
    fires): inf_grad and grad_spike hit each rank's shard, and both ranks skip the step alike."""
    fsdp2 = {"distributed": {"strategy": "fsdp"}, "train": {"max_steps": 4}}
    rank0, rank1 = run(tmp_path / "g", 2, faults=[fault], **fsdp2)
    assert rank0["decisions"] == rank1["decisions"]
    [d] = [d for d in rank0["decisions"] if d["rule"] != "straggler"]
    assert (d["step"], d["rule"], d["action"]) == (3, rule, "skip_step")
    assert [s["skipped"] for s in rank0["steps"]] == [False, False, True, False]


@pytest.mark.distributed
def test_fsdp2_says_the_replica_check_does_not_run(fsdp):
    """orchestrator.replicas (on by default) needs ranks holding the same whole model; under FSDP2
    it was skipped without a word. Rank 0 says so at the start, naming the key and why."""
    told = (fsdp[0].parent / "run.log.rank0").read_text()
    assert "orchestrator.replicas does not run: no two of the 2 ranks hold the same whole copy" in told, told[-3000:]
    assert "(FSDP2 shards them)" in told and "orchestrator.replicas.enabled=false" in told
    assert "orchestrator.replicas" not in (fsdp[0].parent / "run.log.rank1").read_text()  # rank 0 speaks


@pytest.mark.distributed
def test_fsdp2_says_the_straggler_rule_cannot_judge_and_names_no_rank(fsdp):
    """Under FSDP2 a fast rank's compute holds its waits in the all-gathers and reduce-scatters
    (orchestrator/stragglers.py): rank 0 says once that the rule does not run, and it names no rank."""
    told = (fsdp[0].parent / "run.log.rank0").read_text()
    assert told.count("orchestrator.straggler does not run: the 2 ranks split the model (FSDP2 shards them)") == 1
    assert not [d for d in fsdp[1][0]["decisions"] if d["rule"] == "straggler"]


@pytest.mark.distributed
def test_a_resume_under_torchrun_counts_the_loaded_experts(tmp_path):
    """cluster5: a run grown by surgery in one process, resumed by 2 ranks (DDP), gave the config's
    parameter count (899,424 for 936,384): the recount on load was for one process only."""
    import trimtab
    from helpers import config
    from test_soak3_sizes import Person

    moe = {"train": {"max_steps": 2, "batch_tokens": 1024}, "data": {"max_bytes": 60_000}, "checkpoint": {"every": 2}}
    first = Person(add=1)
    grown = trimtab.train(load_config(preset="debug-moe", overrides=config(tmp_path / "r", **moe)), hooks=[first])
    assert grown["params"] > first.seen[0][2]  # step 2's checkpoint holds 9 experts in layer 1, the config 8
    two = run(tmp_path / "r", 2, preset="debug-moe", **{**moe, "train": {**moe["train"], "max_steps": 3}})
    assert [r["summary"]["params"] for r in two] == [grown["params"]] * 2
