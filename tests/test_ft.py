"""Per-step fault tolerance across replica groups through torchft (resilience.ft): two groups, one
process each, a Lighthouse in this test. A group killed mid-run is dropped from the quorum while
the other keeps stepping (one session, no restart); the same command run again resumes from its
own checkpoint, joins the quorum and receives the healthy group's state live; a rollback after
that takes both to the same checkpoint; both end with the same weights, bit for bit."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import TORCHRUN, TRIMTAB_MAIN, trimtab_cli
from trimtab.config import load_config
from trimtab.errors import ConfigError
from trimtab.rundir import read_decisions, read_metrics

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse, in this process, logs each quorum at info
torchft = pytest.importorskip("torchft")


def command(out, group: int, lighthouse: str, *extra: str) -> list[str]:
    sets = {
        "resilience.ft.enabled": "true",
        "resilience.ft.groups": "2",
        "resilience.ft.replica_group": str(group),
        "resilience.ft.lighthouse": lighthouse,
        "resilience.ft.timeout_s": "20",
        "train.eval_every": "0",
        "checkpoint.every": "10",
        "log.progress": "false",
        "log.report": "false",
        "train.log_every": "1",
    }
    args = ["train", "--preset", "debug", "--out", str(out), "--max-steps", "30"]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args + list(extra)


def quorums(out) -> list[dict]:
    return [json.loads(line) for line in (out / "quorum.jsonl").read_text().splitlines()]


@pytest.mark.mostly_waits  # the survivor sleeps 0.25 s a step (slow@) to outlast the replacement's start
@pytest.mark.distributed
def test_a_replica_group_killed_is_dropped_and_its_replacement_heals_live(tmp_path):
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200)
    g0, g1 = tmp_path / "group0", tmp_path / "group1"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # group 0 first, each step 0.25 s slower: group 1 joins it, is killed at step 12, and its
    # replacement joins well before the end
    # weights_nan@20 on both: the orchestrator rolls both back, each from its own checkpoints
    broken = ("--inject", "weights_nan@20")
    survivor = subprocess.Popen(
        [sys.executable, "-m", "trimtab", *command(g0, 0, lighthouse.address(), "--inject", "slow@1:100", *broken)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not (g0 / "quorum.jsonl").is_file() and survivor.poll() is None:
            time.sleep(0.1)
        faults = ("--inject", "sigkill@12", *broken)
        killed = trimtab_cli(command(g1, 1, lighthouse.address(), *faults), cwd=tmp_path, env=env)
        assert killed.returncode == -9, killed.stderr[-3000:]
        again = trimtab_cli(command(g1, 1, lighthouse.address(), *faults), cwd=tmp_path, env=env)
        out, err = survivor.communicate(timeout=300)
    finally:
        survivor.kill()
        lighthouse.shutdown()
    assert again.returncode == 0, again.stderr[-3000:]
    assert survivor.returncode == 0, err[-3000:]
    # the survivor: one session, every step in order, alone while group 1 was down
    steps = [m["step"] for m in read_metrics(g0) if "loss" in m]
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= 30
    assert "resuming from" not in err
    # the step group 1 died in was withheld (its peer lost in the all-reduce); whether the quorum
    # shrank to 1 meanwhile depends on how soon the replacement joined
    records = quorums(g0)
    assert [r["step"] for r in records if r.get("withheld")] == [12] and "withheld on every replica group" in err
    sizes = [r["participants"] for r in records if "participants" in r]
    assert sizes[-1] == 2 and not any(r.get("healed") for r in records)
    # the replacement: resumed from its own checkpoint, then received the survivor's state
    assert "resuming from" in again.stderr and quorums(g1)[-1]["healed"] and quorums(g1)[-1]["step"] >= 12
    assert "this group received a healthy group's state" in again.stderr
    # weights_nan@20: both groups roll back, each from its own checkpoints, to the same step (the
    # state both saved when it went from one to the other)
    rollbacks = [[d["applied"] for d in read_decisions(g) if d["action"] == "rollback"] for g in (g0, g1)]
    assert rollbacks[0] == rollbacks[1] and len(rollbacks[0]) == 1, rollbacks
    final = f"checkpoints/step_{steps[-1]:06d}/model.safetensors"
    a, b = load_file(g0 / final), load_file(g1 / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
@pytest.mark.slow  # the default tier checks the same parity with groups of two FSDP2 ranks (below)
def test_two_replica_groups_train_exactly_as_one_process(tmp_path):
    """Every group present: the average scaled by groups / participants is the one-process sum,
    so the losses are those of one process training the whole batch (fp32)."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    short = ["--max-steps", "8", "--set", "train.precision=fp32"]
    try:
        other = subprocess.Popen(
            [sys.executable, "-m", "trimtab", *command(tmp_path / "g1", 1, lighthouse.address(), *short)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        ours = trimtab_cli(command(tmp_path / "g0", 0, lighthouse.address(), *short), cwd=tmp_path, env=env)
        _, err = other.communicate(timeout=300)
    finally:
        other.kill()
        lighthouse.shutdown()
    assert ours.returncode == 0 and other.returncode == 0, ours.stderr[-2000:] + err[-2000:]
    alone = trimtab_cli(command(tmp_path / "one", 0, "", *short, "--set", "resilience.ft.enabled=false"), tmp_path)
    assert alone.returncode == 0, alone.stderr[-3000:]
    losses = {g: [m["loss"] for m in read_metrics(tmp_path / g) if "loss" in m] for g in ("g0", "g1", "one")}
    assert len(losses["one"]) == 8 and losses["g0"] == losses["g1"]
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses["g0"], losses["one"], strict=True))


def torchrun(out, group: int, lighthouse: str, strategy: str, *extra: str) -> list[str]:
    """One replica group of two ranks (torchrun, DDP or FSDP2), as a user starts it."""
    launcher = [*TORCHRUN, "--standalone", "--nproc_per_node=2", TRIMTAB_MAIN]
    return launcher + command(out, group, lighthouse, "--set", f"distributed.strategy={strategy}", *extra)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("ddp", marks=pytest.mark.slow)])
def test_replica_groups_of_two_ranks_train_as_one_process_and_heal_shard_by_shard(tmp_path, strategy):
    """torchft's HSDP: two groups of two FSDP2 (or DDP) ranks each (rank r of one group averages with rank
    r of the other). With the Lighthouse waiting for both groups, every step has both: the losses
    are one process's on the whole batch. One group's rank killed at step 12 ends that group
    (torchrun); the survivor withholds step 12 and waits in the quorum for a replacement, which
    resumes from its own sharded checkpoint, receives each rank's shards live from the same rank
    of the survivor, and both end with the same weights, bit for bit."""
    from torchft._torchft import LighthouseServer

    from helpers import final_weights

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000)
    g0, g1 = tmp_path / "group0", tmp_path / "group1"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    short = ["--max-steps", "16", "--set", "train.precision=fp32", "--set", "checkpoint.every=5"]
    short += ["--set", "resilience.ft.timeout_s=90"]  # the survivor waits for the replacement's start
    popen = dict(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        survivor = subprocess.Popen(torchrun(g0, 0, lighthouse.address(), strategy, *short), **popen)
        killed = subprocess.run(
            torchrun(g1, 1, lighthouse.address(), strategy, *short, "--inject", "kill_rank@12:1"), **popen
        )
        assert killed.returncode != 0 and "resuming from" not in killed.stderr, killed.stderr[-3000:]
        again = subprocess.run(
            torchrun(g1, 1, lighthouse.address(), strategy, *short, "--inject", "kill_rank@12:1"), **popen
        )
        _, err = survivor.communicate(timeout=300)
    finally:
        survivor.kill()
        lighthouse.shutdown()
    assert again.returncode == 0 and survivor.returncode == 0, again.stderr[-3000:] + err[-3000:]
    alone = trimtab_cli(command(tmp_path / "one", 0, "", *short, "--set", "resilience.ft.enabled=false"), tmp_path)
    assert alone.returncode == 0, alone.stderr[-3000:]
    losses = {g: [m["loss"] for m in read_metrics(tmp_path / g) if "loss" in m] for g in ("group0", "one")}
    # step 12's update, withheld by the quorum, made up at the last step (orchestrator.make_up): 17 steps
    assert len(losses["group0"]) == 17 and "resuming from" not in err
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses["group0"][:11], losses["one"][:11], strict=True))
    assert [r["step"] for r in quorums(g0) if r.get("withheld")] == [12]
    assert "resuming from" in again.stderr and quorums(g1)[-1]["healed"] and quorums(g1)[-1]["step"] >= 11
    a, b = final_weights(g0), final_weights(g1)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ft_refuses_groups_split_other_than_data_parallel():
    from trimtab.distributed.ft import check_groups
    from trimtab.distributed.mesh import Mesh

    check_groups(Mesh(dp=4))
    with pytest.raises(ConfigError, match=r"resilience.ft with distributed.tp=2: .* set those to 1"):
        check_groups(Mesh(dp=2, tp=2))


def test_a_rollback_target_is_a_checkpoint_every_group_holds():
    """Three groups whose checkpoints differ past step 10 (one saved at a heal, one at a `ctl
    save`, one on its own interval): each agrees on the newest step all of them hold."""
    import threading

    from trimtab.distributed.ft import ReplicaGroups

    held = [{0, 5, 10, 12, 15}, {0, 5, 10, 13, 15}, {0, 5, 10, 12, 14, 15}]
    values, agreed = [], [None]
    arrived = threading.Barrier(3, action=lambda: agreed.__setitem__(0, min(values)) or values.clear())
    read = threading.Barrier(3)
    chosen = [None] * 3

    def agree_min(value: int) -> int:  # the all-reduce, stood in for by two barriers
        values.append(value)
        arrived.wait()
        result = agreed[0]
        read.wait()
        return result

    def group(g: int, newest: int) -> None:
        replicas = object.__new__(ReplicaGroups)
        replicas.agree_min = agree_min
        chosen[g] = replicas.common_step(newest, lambda s: max(x for x in held[g] | {-1} if x <= s))

    threads = [threading.Thread(target=group, args=(g, max(h))) for g, h in enumerate(held)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert chosen == [15, 15, 15]
    threads = [threading.Thread(target=group, args=(g, n)) for g, n in enumerate((14, 13, 14))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert chosen == [10, 10, 10]


def test_ft_needs_a_lighthouse_and_a_group_in_range(monkeypatch):
    from trimtab.distributed.ft import lighthouse_address

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    cfg = load_config(None, overrides={"resilience": {"ft": {"enabled": True, "groups": 2}}})
    with pytest.raises(ConfigError, match="resilience.ft.lighthouse"):
        lighthouse_address(cfg.resilience.ft)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://host:29510")
    assert lighthouse_address(cfg.resilience.ft) == "http://host:29510"
    with pytest.raises(ConfigError, match="resilience.ft.replica_group"):
        load_config(None, overrides={"resilience": {"ft": {"enabled": True, "groups": 2, "replica_group": 2}}})
    with pytest.raises(ConfigError, match="resilience.ft.min_replicas"):
        load_config(None, overrides={"resilience": {"ft": {"enabled": True, "groups": 2, "min_replicas": 3}}})
