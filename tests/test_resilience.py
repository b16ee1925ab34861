"""Cluster faults under torchrun (gloo, one thread per process): a rank killed from outside, a
rank that stops; the job restarted by torchrun's elastic agent (--max-restarts) ends as the
undisturbed run does, and the restart is journaled and counted in the goodput ledger."""

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from helpers import SRC, TORCHRUN, TRIMTAB_MAIN, WORKER, assert_close, config, free_port, losses, run, run_relaunched
from trimtab.config import load_config
from trimtab.errors import ConfigError
from trimtab.orchestrator.fault_specs import parse_fault
from trimtab.resilience.goodput import read_goodput
from trimtab.rundir import read_decisions, read_json, read_metrics

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def assert_same_tail(records: list[dict], base: list[dict], resumed: int) -> None:
    """The restarted session's steps (after the checkpoint at `resumed`) as the undisturbed run's:
    the same rows on each rank, the same loss (1e-5) and final weights."""
    for ours, theirs in zip(records, base):
        tail = [s for s in theirs["steps"] if s["step"] > resumed]
        assert [s["step"] for s in ours["steps"]] == [s["step"] for s in tail]
        assert [s["rows"] for s in ours["steps"]] == [s["rows"] for s in tail]
        assert_close(losses(ours), [s["loss"] for s in tail], rel=1e-5)
        assert_close(ours["weights"], theirs["weights"], rel=1e-5)
        assert ours["summary"] == theirs["summary"]


def restart_decision(run_dir) -> dict:
    (decision,) = [d for d in read_decisions(run_dir) if d["rule"] == "restart"]
    assert decision["action"] == "resume" and decision["mode"] == "auto"
    return decision


@pytest.mark.distributed
def test_a_rank_killed_from_outside_is_restarted_and_the_run_ends_as_undisturbed(ddp, tmp_path):
    """kill_rank@7:1: SIGKILL to rank 1 as step 7 begins (a lost process or node). Rank 0's next
    collective fails before its update: it saves step 6 alone (training/emergency.py); torchrun
    restarts both; they resume from step 6 and end with the rows, loss and weights of the
    undisturbed run. The journal names rank 1 (it left no exit record; rank 0 left its error), and
    the ledger counts two sessions, no step lost and the time down."""
    out = tmp_path / "killed"
    records = run(out, 2, restarts=1, faults=["kill_rank@7:1"])
    assert_same_tail(records, ddp[1], resumed=6)
    decision = restart_decision(out)
    evidence = decision["evidence"]
    assert evidence["kind"] == "lost_rank" and evidence["ranks_to_blame"] == [1]
    assert evidence["step"] == 6 and evidence["resumed_step"] == 6 and evidence["steps_lost"] == 0
    assert evidence["world_before"] == evidence["world_after"] == 2 and evidence["down_s"] > 0
    assert "exit" in evidence["ranks"]["0"] and evidence["ranks"]["0"]["exit"] not in (None, "ended")
    (applied,) = decision["applied"]  # where the data resumes, as the decision's summary says it
    assert re.fullmatch(r"resumed at step 6 \(data at epoch \d+, row [\d,]+ of [\d,]+\) on 2 ranks", applied)
    goodput = read_goodput(out)
    assert goodput["sessions"] == 2 and goodput["incidents"] == 1 and goodput["steps_lost"] == 0
    seconds = goodput["seconds"]
    assert seconds["down"] > 0 and seconds["productive"] > 0
    assert 0 < goodput["ettr"] < 1
    ledger = read_json(out / "goodput.json")
    assert ledger["sessions"][0]["end"] is None and ledger["sessions"][1]["end"] == "completed"
    assert ledger["incidents"][0]["recover_s"] >= ledger["incidents"][0]["down_s"]


@pytest.mark.distributed
@pytest.mark.slow  # CI's sharded resume after a kill: test_async_checkpoint.py's FSDP2 rank killed in its write
def test_a_rank_killed_under_fsdp2_resumes_its_sharded_checkpoint_as_undisturbed(fsdp, tmp_path):
    """kill_rank@7:1 with FSDP2: each rank holds a shard of the weights and optimizer state; the
    restarted job reads the step-5 DCP checkpoint and ends with the undisturbed FSDP2 run's rows,
    losses and whole weights."""
    out = tmp_path / "killed"
    records = run(out, 2, restarts=1, faults=["kill_rank@7:1"], distributed={"strategy": "fsdp"})
    assert_same_tail(records, fsdp[1], resumed=5)
    evidence = restart_decision(out)["evidence"]
    assert (evidence["kind"], evidence["ranks_to_blame"], evidence["steps_lost"]) == ("lost_rank", [1], 1)


@pytest.mark.distributed
def test_a_4_rank_ddp_job_started_again_after_a_kill_ends_bit_for_bit_as_undisturbed(tmp_path):
    """debug-moe on 4 DDP ranks, rank 3 killed as step 7 begins and the job started again: it
    resumes from step 5 and ends with the undisturbed run's losses and weights bit for bit. With
    more than two replicas DDP never rebuilds its buckets (Parallel.find_unused), else the first
    step after the restart would add the ranks' gradients in another order than the undisturbed
    run did (7e-5 apart after 60 steps, measured)."""
    moe = {"preset": "debug-moe"}
    base = run(tmp_path / "base", 4, **moe)
    records, launches = run_relaunched(tmp_path / "killed", 4, faults=["kill_rank@7:3"], **moe)
    assert launches == 2
    for ours, theirs in zip(records, base):
        tail = [s for s in theirs["steps"] if s["step"] > 5]
        assert [s["rows"] for s in ours["steps"]] == [s["rows"] for s in tail]
        assert losses(ours) == [s["loss"] for s in tail] and ours["weights"] == theirs["weights"]


@pytest.mark.distributed
@pytest.mark.slow  # 40 s on 2 cores (4 ranks, two runs, one under torchrun); the 2-rank test above is CI's
def test_a_rank_of_a_4_process_fsdp2_job_killed_resumes_as_undisturbed(tmp_path):
    """The same on 4 ranks: rank 3 killed as step 7 begins; every rank's shard of the step-5
    checkpoint read back, the rows, losses and weights of the undisturbed 4-rank run."""
    sharded = {"distributed": {"strategy": "fsdp"}}
    base = run(tmp_path / "base", 4, **sharded)
    records = run(tmp_path / "killed", 4, restarts=1, faults=["kill_rank@7:3"], **sharded)
    assert_same_tail(records, base, resumed=5)
    evidence = restart_decision(tmp_path / "killed")["evidence"]
    assert (evidence["kind"], evidence["ranks_to_blame"], evidence["world_after"]) == ("lost_rank", [3], 4)


@pytest.mark.distributed
def test_a_hung_rank_is_ended_within_twice_its_timeout_with_every_stack_written(ddp, tmp_path):
    """hang_rank@7:1: rank 1 stops as step 7 begins and rank 0 waits for it in the gradient
    all-reduce. Both watchdogs end their process within twice the section's timeout (not the
    collective's 600 s), each rank's stack is in hangs/, the journal names rank 1 (in `data`
    while rank 0 waited further on), and the restarted job ends as the undisturbed run. Started again
    by the fork server (torchrun's restarts: the kill_rank tests above)."""
    out = tmp_path / "hung"
    resilience = {"min_timeout_s": 4.0, "first_timeout_s": 120.0}
    records, launches = run_relaunched(out, 2, faults=["hang_rank@7:1"], resilience=resilience)
    assert launches == 2
    assert_same_tail(records, ddp[1], resumed=5)
    evidence = restart_decision(out)["evidence"]
    assert evidence["kind"] == "hang" and evidence["ranks_to_blame"] == [1] and evidence["section"] == "data"
    assert evidence["timeout_s"] >= 4.0 and evidence["stalled_s"] <= 2 * evidence["timeout_s"]
    stacks = out / evidence["stacks"]
    assert "hang_rank" in (stacks / "rank1.txt").read_text() or "faults.py" in (stacks / "rank1.txt").read_text()
    assert "forward_backward" in (stacks / "rank0.txt").read_text().splitlines()[0]
    assert read_goodput(out)["incidents"] == 1


@pytest.mark.distributed
def test_a_rank_slowed_down_is_named_with_the_evidence_and_nothing_else_changes(ddp, tmp_path):
    """slow_rank@3:1:6: from step 3 rank 1's forwards take 6x as long. With windows of 2 steps and
    a patience of 2, the straggler rule names rank 1 (its compute below 0.75 of rank 0's, rank 0
    waiting for it), once, logged only: the losses are the undisturbed run's. 6x, not 10x: each
    slowed forward sleeps 5x its length, not 9x (the measure since distributed/work_clock.py read
    it 0.09-0.35 on a host at load 10; 10x read 0.09-0.42 there)."""
    out = tmp_path / "slow"
    straggler = {"window": 2, "patience": 2}
    records = run(out, 2, faults=["slow_rank@3:1:6"], orchestrator={"straggler": straggler})
    for ours, theirs in zip(records, ddp[1]):
        assert_close(losses(ours), losses(theirs), rel=1e-6)
    (named,) = [d for d in read_decisions(out) if d["rule"] == "straggler"]
    assert named["action"] == "none" and named["evidence"]["ranks"] == [1] and named["step"] <= 8
    scores = named["evidence"]["scores"]
    assert scores[0] == 1.0 and scores[1] < 0.75 and records[0]["decisions"] == records[1]["decisions"]


@pytest.mark.distributed
def test_a_bit_flipped_in_one_replica_is_caught_and_rolled_back_to_when_they_agreed(ddp, tmp_path):
    """bitflip@7:1: one mantissa bit of one weight flips on rank 1 as step 7 begins (finite: no
    rule on the loss sees it, and DDP, averaging gradients, keeps the replicas apart for good). The
    replica check every 2 steps finds the two checksums apart at step 8 (two replicas: no majority
    to say which one, so both are named), the run rolls back to the checkpoint of step 5 (they
    agreed at step 6) and ends with the undisturbed run's weights on both ranks."""
    out = tmp_path / "flip"
    records = run(out, 2, faults=["bitflip@7:1"], orchestrator={"replicas": {"every": 2}})
    (found,) = [d for d in read_decisions(out) if d["rule"] == "replicas"]
    assert found["step"] == 8 and found["evidence"]["ranks"] == [0, 1] and found["evidence"]["agreed_step"] == 6
    assert "no majority" in found["summary"]
    assert found["action"] == "rollback" and "to step 5" in found["applied"][0]
    for ours, theirs in zip(records, ddp[1]):
        assert ours["weights"] == records[0]["weights"]  # the replicas agree again
        assert_close(ours["weights"], theirs["weights"], rel=1e-5)
        assert ours["summary"] == theirs["summary"]


def test_the_replica_unlike_the_majority_is_named(monkeypatch):
    """Three replicas, one checksum apart: that rank alone; all alike: agreed, nothing found."""
    from trimtab.config import OrchestratorConfig
    from trimtab.orchestrator import replicas

    gathered = {}
    monkeypatch.setattr(replicas, "all_gather_floats", lambda mine: gathered["values"])
    check = replicas.Replicas(OrchestratorConfig())
    halves = lambda v: [float(v // replicas.HALF), float(v % replicas.HALF)]  # noqa: E731
    gathered["values"] = [halves(2**40 + 7)] * 3
    assert check.observe(50, 2**40 + 7) is None and check.agreed == 50
    assert check.due(100) and not check.due(60)  # a check every 50 steps (the default)
    gathered["values"] = [halves(2**40 + 7), halves(2**40 + 7 + 2**12), halves(2**40 + 7)]
    found = check.observe(100, 2**40 + 7)
    assert found.evidence["ranks"] == [1] and found.evidence["agreed_step"] == 50 and "rank 1 holds" in found.summary


def test_a_run_accounts_for_its_wall_time_and_a_stop_is_not_downtime(tmp_path):
    """One process: summary.json's goodput splits the session's time into its buckets (they sum
    to the wall time), the steps all productive; a session stopped on purpose and resumed adds a
    session but no incident and no down time, and its steps are productive too (none redone)."""
    import trimtab

    cfg = {
        "out": str(tmp_path / "r"),
        "train": {"max_steps": 8, "eval_every": 4, "precision": "fp32"},
        "data": {"max_bytes": 60_000},
        "checkpoint": {"every": 4},
        "log": {"progress": False, "tensorboard": False, "report": False},
    }
    first = trimtab.train(preset="debug", faults=["sigterm@6"], **cfg)
    assert first["status"].startswith("stopped")
    summary = trimtab.train(preset="debug", **cfg)
    goodput = summary["goodput"]
    assert goodput["sessions"] == 2 and goodput["incidents"] == 0 and goodput["steps_lost"] == 0
    seconds = goodput["seconds"]
    assert seconds["productive"] > 0 and seconds["checkpoint"] > 0 and seconds["evaluation"] > 0
    assert seconds["redone"] == 0 and seconds["down"] == 0 and seconds["start_up"] > 0
    assert abs(sum(seconds.values()) - goodput["wall_s"]) < 0.01 and 0 < goodput["ettr"] < 1
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["goodput"] == goodput
    assert [s["end"] for s in read_json(tmp_path / "r" / "goodput.json")["sessions"]] == [
        first["status"],
        "completed",
    ]


def test_checkpoints_come_at_youngs_interval_when_failures_are_expected_often(tmp_path):
    """With a mean time between failures of seconds (orchestrator.checkpoint_interval.mtbf_hours),
    Young's interval from the measured save stall and step time is far shorter than
    checkpoint.every=50: the rule sets it (journaled, action set_checkpoint_every) and the
    checkpoints come at the new interval; the knob is checkpointed, so a resume keeps it."""
    import trimtab
    from trimtab.checkpoint import list_checkpoints

    run_dir = tmp_path / "r"
    summary = trimtab.train(
        preset="debug",
        out=str(run_dir),
        train={"max_steps": 24, "eval_every": 0, "precision": "fp32"},
        data={"max_bytes": 60_000},
        checkpoint={"every": 50, "keep": 100},
        log={"progress": False, "tensorboard": False, "report": False},
        orchestrator={"checkpoint_interval": {"mtbf_hours": 0.0005}},
    )
    assert summary["status"] == "completed"
    (decision,) = [d for d in read_decisions(run_dir) if d["rule"] == "checkpoint_interval"][:1]
    every = decision["params"]["steps"]
    assert decision["action"] == "set_checkpoint_every" and 1 <= every < 50 and decision["mode"] == "auto"
    assert decision["evidence"]["mtbf_h"] == 0.0005 and decision["evidence"]["save_stall_s"] > 0
    saved = [int(p.name.split("_")[1]) for p in list_checkpoints(run_dir)]
    later = [s for s in saved if decision["step"] < s < 24]
    assert later and all(s % every == 0 for s in later) or every > 24 - decision["step"]
    last = json.loads((list_checkpoints(run_dir)[-1] / "state.json").read_text())
    assert (
        last["train"]["checkpoint_every"]
        == [d for d in read_decisions(run_dir) if d["rule"] == "checkpoint_interval"][-1]["params"]["steps"]
    )


@pytest.mark.distributed
def test_a_process_frozen_from_outside_is_found_and_the_cli_run_ends_as_undisturbed(ddp, tmp_path):
    """`torchrun --max-restarts 1 trimtab train` with the `ddp` run's settings (helpers.TORCHRUN, as
    test_ft starts its groups: the ranks forked from the agent, which imported torch once, not two
    fresh interpreters a session); once step 6 is logged the test freezes rank 1 (SIGSTOP: its
    watchdog thread stops with it). Rank 0 waits for it in a collective until its watchdog ends it
    (min_timeout_s 4), raises the alarm and, rank 1 writing no stack, kills it (same host): rank 0's
    collective fails and it saves the last completed step alone (before: no save, the run resumed
    from step 5 and trained 1-3 steps again); torchrun restarts both, the run resumes from that
    save and ends with the undisturbed run's losses. The journal blames rank 1: it did not answer;
    the wait is goodput's `hang` (before: `other`)."""
    sets = {
        "train.max_steps": 10,
        "train.eval_every": 0,
        "train.log_every": 1,
        "train.precision": "fp32",
        "data.max_bytes": 150000,
        "checkpoint.every": 5,
        "log.progress": "false",
        "log.tensorboard": "false",
        "log.report": "false",
        "resilience.min_timeout_s": 4,
    }
    out = tmp_path / "frozen"
    # the frozen rank never answers the alarm: rank 0 need not wait watchdog.GRACE_S (5 s) for its
    # stack (as tests/test_watchdog_restart.py); set in the agent, whose ranks are forked from it
    grace = "import trimtab.resilience.watchdog as w; w.GRACE_S = 1.0; "
    torchrun = [TORCHRUN[0], TORCHRUN[1], grace + TORCHRUN[2], *TORCHRUN[3:]]
    torchrun += ["--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    args = [TRIMTAB_MAIN, "train", "--preset", "debug", "--out", str(out)]
    args += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*torchrun, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not any(m.get("step", 0) >= 6 for m in read_metrics(out)):
        time.sleep(0.02)
    os.kill(read_json(out / "ranks" / "rank1.json")["pid"], signal.SIGSTOP)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    logged = [m for m in read_metrics(out) if "loss" in m]
    assert [m["step"] for m in logged] == list(range(1, 11))
    assert_close([m["loss"] for m in logged], losses(ddp[1][0]), rel=1e-5)
    evidence = restart_decision(out)["evidence"]
    assert evidence["kind"] == "hang" and evidence["ranks_to_blame"] == [1] and evidence["silent"] == [1]
    assert evidence["resumed_step"] >= 6 and evidence["steps_lost"] == 0 and evidence["down_s"] >= 0
    assert evidence["hang_s"] > 0 and "s waiting on the hang" in restart_decision(out)["summary"]
    assert f"rank 0 saved step {evidence['resumed_step']} alone" in stderr, stderr[-3000:]
    assert abs(read_goodput(out)["seconds"]["hang"] - evidence["hang_s"]) < 0.01
    assert (out / evidence["stacks"] / "rank0.txt").is_file() and not (out / evidence["stacks"] / "rank1.txt").exists()
    assert json.loads((out / "summary.json").read_text())["goodput"]["incidents"] == 1


def test_rank_faults_name_their_rank():
    fault = parse_fault("kill_rank@7:1")
    assert (fault.kind, fault.step, fault.rank, fault.count) == ("kill_rank", 7, 1, 1)
    assert parse_fault("hang_rank@3:0").rank == 0
    slow = parse_fault("slow_rank@3:1:2.5")
    assert (slow.rank, slow.param) == (1, 2.5) and parse_fault("slow_rank@3:1").param == 3.0
    for bad in ("kill_rank@7", "kill_rank@7:x", "hang_rank@7:1@rank1", "kill_rank@7:1:2", "slow_rank@3:1:0.5"):
        with pytest.raises(ConfigError, match="@STEP:RANK"):
            parse_fault(bad)
    assert parse_fault("grad_bitflip@5").rank == 0 and parse_fault("grad_bitflip@5:1").rank == 1  # one process: 0
    assert parse_fault("lose_node@6").param is None and parse_fault("lose_node@6:0").param == 0.0  # the last node
    for bad in ("lose_node@6:x", "lose_node@6@rank1"):
        with pytest.raises(ConfigError, match="lose_node@STEP"):
            parse_fault(bad)


def test_a_lost_node_needs_a_job_of_several_nodes(tmp_path):
    import trimtab

    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "r"), "faults": ["lose_node@3"]})
    with pytest.raises(ConfigError, match=r"lose_node@3 needs a job of several nodes: torchrun --nnodes MIN:MAX"):
        trimtab.train(cfg)


def test_young_interval_and_expected_ettr_follow_their_formulas():
    """Young's interval sqrt(2 C M); ETTR 1 - C/T - (R + T/2)/M; more devices, a shorter MTBF, a
    shorter interval and a lower ETTR; an asynchronous save stalls less and trains more."""
    from trimtab.plan.resilience import (
        FAILURES_PER_DEVICE_HOUR,
        expected_ettr,
        format_resilience,
        resilience_plan,
        young_interval,
    )

    assert young_interval(50.0, 3600.0) == pytest.approx(600.0)
    assert expected_ettr(50.0, 600.0, 300.0, 3600.0) == pytest.approx(1 - 50 / 600 - 600 / 3600)
    plans = [resilience_plan(n, 10 * 2**40) for n in (1024, 16_384)]
    assert plans[0].mtbf_h == pytest.approx(1 / (1024 * FAILURES_PER_DEVICE_HOUR))
    assert plans[1].mtbf_h < plans[0].mtbf_h
    for plan in plans:
        sync, async_, ft = plan.strategies
        assert async_.stall_s < sync.stall_s and async_.ettr > sync.ettr and async_.interval_s < sync.interval_s
        assert ft.ettr > async_.ettr  # no restart, no work redone: a group's share missing while it recovers
    assert plans[1].strategies[0].ettr < plans[0].strategies[0].ettr
    four = resilience_plan(4, 10 * 2**40)  # groups of 2: one node's 8 would be a single group, no failover
    assert "replica groups (resilience.ft) of 2 devices" in "\n".join(format_resilience(four))
    stepped = resilience_plan(1024, 10 * 2**40, step_s=7.0)
    assert all(s.interval_s % 7.0 == pytest.approx(0.0, abs=1e-9) for s in stepped.strategies)


def test_plan_shows_the_checkpoint_interval_and_ettr_for_many_gpus(tmp_path, capsys):
    from trimtab.cli import main

    assert main(["plan", "--preset", "dense-7b", "--gpu", "H100", "--gpus", "16384", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Resilience on 16,384 devices" in out and "(Young): expected ETTR" in out
    saved = json.loads((tmp_path / "plan.json").read_text())["resilience"]
    assert saved["devices"] == 16_384 and [s["name"] for s in saved["strategies"]] == [
        "synchronous save",
        "asynchronous save",
        "per-step FT",
    ]
    assert main(["plan", "--preset", "debug", "--out", str(tmp_path)]) == 0
    assert "Resilience" not in capsys.readouterr().out  # one device: nothing to plan


@pytest.mark.parametrize(
    "section, message",
    [
        ({"watchdog": "always"}, "resilience.watchdog"),
        ({"timeout_factor": 0.5}, "resilience.timeout_factor"),
        ({"min_timeout_s": 100, "first_timeout_s": 10}, "resilience.first_timeout_s"),
    ],
)
def test_resilience_settings_that_cannot_work_are_named(section, message):
    with pytest.raises(ConfigError, match=message):
        load_config(preset="debug", overrides={"resilience": section})


def test_the_watchdog_switches_read_as_written():
    """YAML 1.1 reads a bare on / off as true / false: `--set resilience.watchdog=off` means off."""
    for word in ("on", "off", "auto"):
        assert load_config(preset="debug", sets=[f"resilience.watchdog={word}"]).resilience.watchdog == word


# the loop's thread of a watched process, as the trainer's: one section that ends when stdin says so
WATCHED = """
import sys
from trimtab.resilience.watchdog import Watchdog
dog = Watchdog(sys.argv[1], 0, 1, first_timeout_s=1.5, timeout_factor=5.0, min_timeout_s=1.5, beat_s=60.0)
dog.start().beat("forward_backward", 7)
print("in the section", flush=True)
sys.stdin.readline()
dog.beat("optimizer")
dog.stop()
"""


def watched(run_dir):
    return subprocess.Popen(
        [sys.executable, "-c", WATCHED, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )


def test_a_process_stopped_and_continued_is_not_a_hang_but_one_that_stalls_is(tmp_path):
    """SIGSTOP then SIGCONT (`scontrol suspend`, Ctrl-Z then fg) for twice the section's 1.5 s
    timeout: the time stopped is not the section's, so the process goes on (its watchdog wakes on
    SIGCONT before the loop can beat: the loop waits on stdin). The same section stalled while
    the process runs is ended (exit 5) with its stack."""
    paused, stalled = watched(tmp_path / "paused"), watched(tmp_path / "stalled")
    assert paused.stdout.readline() and stalled.stdout.readline()
    os.kill(paused.pid, signal.SIGSTOP)
    time.sleep(3.0)
    os.kill(paused.pid, signal.SIGCONT)
    time.sleep(0.8)  # the watchdog's polls after SIGCONT, the section still open
    with contextlib.suppress(BrokenPipeError):  # (a watchdog that ended it: the assertion says so)
        paused.stdin.write("\n")
        paused.stdin.close()
    assert paused.wait(timeout=30) == 0 and not (tmp_path / "paused" / "hangs").exists()
    assert stalled.wait(timeout=30) == 5
    first = (tmp_path / "stalled" / "hangs" / "rank0.txt").read_text().splitlines()[0]
    assert first.startswith("rank 0 at step 7, section forward_backward for ") and "(timeout 1.5 s)" in first
    said = stalled.stderr.read()  # torchrun shows the exit code alone: the console says what and where
    assert "trimtab: rank 0 hung: forward_backward ran" in said and "at step 7" in said and "hangs" in said


def test_the_watchdog_discounts_a_stop_only_when_the_loop_thread_did_not_run(tmp_path, monkeypatch):
    """At the unit level, the clocks given: a poll 8.1 s late while the loop's thread used no CPU
    is a stopped process (7.6 s discounted from the section it stopped in, not from the next
    one); the same gap while the loop's thread computed (holding the GIL) is the section's; the
    length the loop learns for a section (its next timeouts) leaves the stop out too."""
    from trimtab.resilience.watchdog import Watchdog

    def dog():
        found = Watchdog(tmp_path, 0, 1, first_timeout_s=3.0, timeout_factor=5.0, min_timeout_s=3.0, beat_s=1e12)
        ended: list[dict] = []
        monkeypatch.setattr(found, "_end", lambda **record: ended.append(record))
        found.current, found._polled = ("forward_backward", 100.0), (100.0, 0.0)
        return found, ended

    stopped, ended = dog()
    stopped._poll(100.5, 0.1)
    stopped._poll(108.6, 0.2)  # 8.1 s since the poll before, 0.1 s of CPU: stopped 7.6 s
    stopped._poll(110.5, 2.0)
    assert ended == []
    stopped._poll(111.0, 2.5)  # 11 s in the section, 7.6 of them stopped: 3.4 s past its 3 s
    assert [(e["section"], round(e["elapsed"], 1)) for e in ended] == [("forward_backward", 3.4)]
    stopped.current = ("optimizer", 111.2)  # a later section began: the stop is not its time
    stopped._poll(114.5, 6.0)  # (a poll late while the loop ran: nothing stopped)
    assert [round(e["elapsed"], 1) for e in ended] == [3.4, 3.3]
    busy, ended = dog()
    busy._poll(108.1, 8.0)  # as late, but the loop thread ran through it: a section 8.1 s long
    assert [round(e["elapsed"], 1) for e in ended] == [8.1]
    # the loop learns a section's length net of the stop (else one pause would loosen its timeout
    # for the rest of the process), whether the watchdog saw the stop first or the loop beats first
    now = time.monotonic()
    seen, _ = dog()
    seen.current, seen._thawed = ("forward_backward", now - 9.0), (now - 9.0, 8.0)
    seen.beat("sync")
    unseen, _ = dog()
    unseen._thread = threading.Thread(target=print)  # started: its polls are due
    unseen.current, unseen._polled = ("forward_backward", now - 9.5), (now - 9.0, time.thread_time())
    unseen.beat("sync")
    for found in (seen, unseen):
        assert found.longest["forward_backward"] == pytest.approx(1.0, abs=0.2)
        assert found.timeout("forward_backward") == 5.0 * found.longest["forward_backward"]


def test_the_evidence_of_a_lost_session_says_whether_its_last_step_is_exact(tmp_path):
    """Without a rank's record of the step it ended in (no watchdog, or every rank killed) the
    newest step any file recorded is a lower bound, and the restart says so; an exit record (or a
    hang's) is exact, and a rank past its update (hooks, evaluation, checkpoint) completed its step."""
    from trimtab.resilience.incidents import done_step, last_life, localize, reach_words
    from trimtab.rundir import write_json

    unknown = localize(tmp_path, 0.0, "session1")  # no rank records at all: nothing tells what was lost
    assert unknown["kind"] == "lost_unknown" and unknown["step_exact"] is False
    assert reach_words({"step": 25, "steps_lost": 5, **unknown}) == (
        "after step 25 (the newest its files recorded)",
        "at least 5 steps",
    )
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    beat = {"host": "h", "node": 0, "pid": 1, "time": 10.0}
    write_json(ranks / "rank0.json", {"rank": 0, "step": 27, "section": "sync", "exit": "DistError: peer", **beat})
    write_json(ranks / "rank1.json", {"rank": 1, "step": 25, "section": "data", **beat})
    known = localize(tmp_path, 0.0, "session1")
    assert known["kind"] == "lost_rank" and known["ranks_to_blame"] == [1] and known["step_exact"] is True
    assert last_life(tmp_path, 0.0)[1] == 26 and reach_words({"step": 26, "steps_lost": 1, **known}) == (
        "at step 26",
        "1 step",
    )
    assert [done_step({"step": 27, "section": s}) for s in ("data", "optimizer", "hooks", "checkpoint")] == [
        26,
        26,
        27,
        27,
    ]
    assert reach_words({"step": 9, "steps_lost": 2}) == ("at step 9", "2 steps")  # a journal from before the key


def test_a_restarted_rank_beating_before_rank_0_reads_leaves_the_lost_sessions_record(tmp_path, monkeypatch):
    """A restart's rank 1 beats (its watchdog's first poll) before rank 0's restart hook reads the
    lost session's records: its beat moves the lost one aside instead of overwriting it, and rank
    0 reads the lost session's, never its own session's (it named rank 1 "stopped in start-up",
    0 s down, or no rank at all)."""
    from trimtab.resilience.elastic import SESSION_ENV
    from trimtab.resilience.incidents import last_life, localize
    from trimtab.resilience.watchdog import Watchdog
    from trimtab.rundir import write_json

    ranks = tmp_path / "ranks"
    ranks.mkdir()
    beat = {"host": "h", "node": 0, "pid": 1, "time": 10.0, "session": "lost"}
    write_json(ranks / "rank0.json", {"rank": 0, "step": 27, "section": "sync", "exit": "DistError: peer", **beat})
    write_json(ranks / "rank1.json", {"rank": 1, "step": 25, "section": "data", **beat})
    monkeypatch.setenv(SESSION_ENV, "restarted")
    times = dict(first_timeout_s=60.0, timeout_factor=5.0, min_timeout_s=60.0, beat_s=10.0)
    Watchdog(tmp_path, 1, 2, **times)._write_beat()  # the restarted rank 1, in start-up at step 0
    found = localize(tmp_path, 0.0, "session1")
    assert found["ranks_to_blame"] == [1] and found["ranks"]["1"]["section"] == "data"
    assert last_life(tmp_path, 0.0)[1] == 26


def test_a_run_asked_for_no_more_steps_than_its_checkpoint_says_what_it_is(tmp_path, caplog):
    """A session training to step 8 stopped at step 5 (its checkpoint there). Re-run with
    train.max_steps 5 it is at its length but not finished: that checkpoint was saved on the way
    to step 8; re-run with 3 (summary.json gone, as a killed session leaves it) the checkpoint is
    past the length. Nothing trains, nothing in the directory changes, exit 0 as before, and
    the summary given back is not "completed"."""
    import trimtab
    from test_trainer import debug_cfg, files_of

    run_dir = tmp_path / "r"
    stopped = trimtab.train(debug_cfg(run_dir, steps=8, sets=["checkpoint.every=4", "faults=[sigterm@5]"]))
    assert stopped["step"] == 5 and stopped["status"].startswith("stopped (")
    before = files_of(run_dir)
    with caplog.at_level(logging.WARNING):
        again = trimtab.train(debug_cfg(run_dir, steps=5))
    assert again == stopped and files_of(run_dir) == before
    assert f"{run_dir} is at step 5 of 5 (train.max_steps 5) but has not finished: the checkpoint at step 5 " in (
        caplog.text
    )
    assert "was saved on the way to step 8, the length the run trained with then" in caplog.text
    assert f"by a session that {stopped['status']} there" in caplog.text
    assert "A larger --max-steps (train.max_steps) trains on (8: the run as it was)" in caplog.text
    (run_dir / "summary.json").unlink()
    del before["summary.json"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        shorter = trimtab.train(debug_cfg(run_dir, steps=3))
    assert files_of(run_dir) == before and (shorter["step"], shorter["total_steps"]) == (5, 3)
    assert shorter["status"] == "stopped (at step 5 of 8: its last session ended without a summary)"
    assert f"{run_dir} has nothing to train: its newest checkpoint is at step 5, past the 3 steps asked for" in (
        caplog.text
    )
    assert "by a session that ended without writing summary.json" in caplog.text
    assert "--max-steps (train.max_steps) above 5 trains on (8: the run as it was)" in caplog.text
    assert "has finished" not in caplog.text


def test_a_finished_run_names_who_changed_its_length(tmp_path, caplog):
    """The step orchestrator.make_up added for a withheld update is attributed to it, not to the
    live planner; the journal's length changes are summed by rule, an unexplained one unnamed."""
    import trimtab
    from test_trainer import debug_cfg

    run_dir = tmp_path / "r"
    assert trimtab.train(debug_cfg(run_dir, steps=12, faults=["nan_loss@3"]))["step"] == 13
    with caplog.at_level(logging.WARNING):
        trimtab.train(debug_cfg(run_dir, steps=12))
    assert f"{run_dir} has finished: it is at step 13 of 13 (train.max_steps 12, +1 by orchestrator.make_up); " in (
        caplog.text
    )
    from trimtab.training.resume import _length_changes

    journal = [
        {"rule": "convergence", "action": "set_total_steps", "applied": ["total steps 40 -> 34"]},
        {"rule": "config", "action": "set_total_steps", "applied": ["total steps 50"]},  # a person's: phase_steps
        {"rule": "make_up", "action": "set_total_steps", "applied": ["total steps 34 -> 35"]},
        {"rule": "manual", "action": "set_total_steps", "applied": ["failed: would end pretraining"]},
    ]
    state = {"train": {"length_delta": -5}, "hooks": {"Orchestrator": {"journal": journal}}}
    assert _length_changes(state, 40) == ", -6 by the live planner, +1 by orchestrator.make_up"
    state["train"]["length_delta"] = 3  # the journal does not account for it: said, not attributed
    assert _length_changes(state, 40) == ", +3 by set_total_steps"


@pytest.mark.distributed
def test_a_bit_flipped_in_one_ranks_gradient_is_rerun_on_both_and_trains_as_undisturbed(ddp, tmp_path):
    """grad_bitflip@7:1 and @9:1: one gradient element of rank 1 gets its top exponent bit flipped
    in the backward, before the all-reduce (x 2^128, as silent corruption in one device). Both
    ranks see the overflowing norm, compute the step again together, find it clean and apply it:
    the rows, losses and weights are the undisturbed run's; the journal names a transient fault
    and the rank whose own gradient differed (rank 1), the second time as a suspect device."""
    out = tmp_path / "gradflip"
    records = run(out, 2, faults=["grad_bitflip@7:1", "grad_bitflip@9:1"])
    assert_same_tail(records, ddp[1], resumed=0)
    first, second = [d for d in read_decisions(out) if d["rule"] != "straggler"]
    for d, step in ((first, 7), (second, 9)):
        assert (d["step"], d["rule"], d["action"], d["evidence"]["verdict"]) == (
            step,
            "rerun",
            "rerun_step",
            "transient",
        )
        assert d["evidence"]["ranks"] == [1]
    assert first["evidence"]["suspects"] == [] and second["evidence"]["suspects"] == [1]
    assert "rank 1 2 times in this run: a suspect device" in second["summary"]
    assert "orchestrator.rerun.exclude is off" in second["reasoning"]
    assert records[0]["decisions"] == records[1]["decisions"]


def node(port: int, host_store: bool, cfg: dict, record: str, log, ranks: int = 1) -> subprocess.Popen:
    """One node's torchrun agent with `ranks` ranks in an elastic job of 1 to 2 nodes (c10d rendezvous
    on `port`, hosted by the first node's agent); its own store per attempt for the ranks
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE, docs/resilience.md)."""
    # a lost node leaves the rendezvous when it misses keep_alive_max_attempt beats (default 3 x 5 s;
    # here 3 x 1 s: at 3 x 2 s the rendezvous after a loss or an exclusion waited up to 6 s for the
    # gone node's beats to age out, before its last call: down_s 13.0 -> 9.2 s at load 11-19; a
    # live agent beats from a thread of its own while its main thread idles between polls);
    # last call: how long a rendezvous of 1 node waits for the second. At 2 s the second agent, started
    # 1 s after the first and importing torch on a host busy with the suite's other worker, missed the
    # first one (the job began on 1 node: sessions 1, 2, 2, and the straggler never measured); a full
    # rendezvous (2 nodes) closes at once, so only the one after the loss waits the longer call
    rdzv = (
        f"is_host={int(host_store)},last_call_timeout=6,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3"
    )
    command = [
        *(*TORCHRUN, "--nnodes=1:2", f"--nproc_per_node={ranks}"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic", f"--rdzv-conf={rdzv}"),
        *("--max-restarts=3", "--monitor-interval=0.2", str(WORKER), json.dumps(cfg), record),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": SRC}
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def lost_node(tmp_path, ranks: int) -> dict:
    """Two nodes of `ranks` ranks each (two torchrun agents, --nnodes 1:2; 2: 4 -> 2 -> 4 ranks).
    lose_node@6:1 kills node 1's agent and ranks as step 6 begins; node 0's agent restarts its
    ranks alone, which resume from step 5 (rank 0's emergency save); a node started again joins at the next rendezvous:
    node 0's agent stops its ranks (SIGTERM: a checkpoint at the step they reached) and the job
    resumes on both nodes from there. Returns what the test checks: the sessions, the restart
    decisions, what the sessions trained, the last session's record and the undisturbed run's."""
    steps, out = 24, tmp_path / "elastic"
    overrides = {"train": {"max_steps": steps}, "checkpoint": {"every": 4}}
    reference = run(tmp_path / "reference", 2 * ranks, **overrides)
    # slow: 0.25 s a step, from the loss on (node 0 alone outlasts the returning node's start); the
    # five steps before it need no wait
    cfg = config(out, **overrides, faults=["lose_node@6:1", f"slow@6:{steps - 5}"])
    record, port = str(tmp_path / "rec-{world}-{first}-{rank}.json"), free_port()
    sessions = lambda: read_json(out / "goodput.json")["sessions"]  # noqa: E731
    with open(tmp_path / "agents.log", "w") as log:
        first = node(port, True, cfg, record, log, ranks)
        time.sleep(1.0)  # its store first
        lost = node(port, False, cfg, record, log, ranks)
        assert lost.wait(timeout=120) == -signal.SIGKILL
        wait_for(
            lambda: len(sessions()) == 2 and sessions()[1]["step"] >= sessions()[1]["from_step"] + 2, "node 0 alone"
        )
        back = node(port, False, cfg, record, log, ranks)
        told = (first.wait(timeout=180), back.wait(timeout=60)), (tmp_path / "agents.log").read_text()[-6000:]
        assert told[0] == (0, 0), told[1]
    ran = {}  # step -> (rows of every rank, loss) as the sessions that were not lost trained it
    for path in tmp_path.glob("rec-*.json"):
        for s in json.loads(path.read_text())["steps"]:
            ran[s["step"]] = (ran.get(s["step"], ([], None))[0] + s["rows"], s["loss"])
    restarts = [d["evidence"] for d in read_decisions(out) if d["rule"] == "restart"]
    grown_from = sessions()[-1]["from_step"]
    last = json.loads((tmp_path / f"rec-{2 * ranks}-{grown_from + 1}-0.json").read_text())
    found = {"steps": steps, "sessions": sessions(), "restarts": restarts, "ran": ran, "last": last}
    return {**found, "reference": reference}


def straggler_node(tmp_path) -> dict:
    """orchestrator.straggler.exclude in an elastic job of two nodes of one rank, node 1's rank's
    forwards 30x slower from step 3 (at 10x, a loaded CI host read it 0.61x the fastest rank's speed:
    confidence 0.29, under min_confidence, advice only, and the stretch's one finding spent).
    Returns what the test checks: the decisions, the session after the
    exclusion and the undisturbed run's records."""
    steps, out = 16, tmp_path / "excluded"
    overrides = {"train": {"max_steps": steps}, "checkpoint": {"every": 4}}
    reference = run(tmp_path / "reference", 2, **overrides)
    straggler = {"window": 2, "patience": 2, "exclude": True}
    orchestrator = {"straggler": straggler}
    cfg = config(out, **overrides, faults=["slow_rank@3:1:30"], orchestrator=orchestrator)
    record, port = str(tmp_path / "rec-{world}-{first}-{rank}.json"), free_port()
    with open(tmp_path / "agents.log", "w") as log:
        first = node(port, True, cfg, record, log)
        time.sleep(1.0)  # its store first
        slow = node(port, False, cfg, record, log)
        told = (slow.wait(timeout=120), first.wait(timeout=120)), (tmp_path / "agents.log").read_text()[-6000:]
        assert told[0] == (-signal.SIGKILL, 0), told[1]
    sessions = [json.loads(p.read_text()) for p in tmp_path.glob("rec-1-*-0.json")]
    return {"steps": steps, "decisions": read_decisions(out), "sessions": sessions, "reference": reference}


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    """The two elastic jobs of two nodes, started together: each mostly waits (rendezvous beats, a
    node's slowed steps) with a core idle, so one after the other they held a test worker ~75 s
    (tests/conftest.py keeps both tests on one worker). Futures: a job's failure is raised in
    its own test."""
    with ThreadPoolExecutor(2) as pool:
        return {
            "lost": pool.submit(lost_node, tmp_path_factory.mktemp("lost"), 1),
            "straggler": pool.submit(straggler_node, tmp_path_factory.mktemp("straggler")),
        }


@pytest.mark.mostly_waits
@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_lost_node_leaves_the_run_on_the_rest_and_a_returning_node_grows_it_back(request, tmp_path, ranks):
    """lost_node: node 0's ranks alone resume from step 5 (rank 0's emergency save: node 1 was lost
    as step 6 began) reading every row of each step, as the undisturbed run on both nodes trains
    them, and the returning node grows the job back. The journal names the lost node and the
    growth; the losses and final weights are the undisturbed run's."""
    found = request.getfixturevalue("elastic")["lost"].result() if ranks == 1 else lost_node(tmp_path, ranks)
    sessions, reference = found["sessions"], found["reference"]
    assert [s["world"] for s in sessions] == [2 * ranks, ranks, 2 * ranks]
    assert [s["from_step"] for s in sessions][:2] == [0, 5]
    lost, grown = found["restarts"]
    assert (
        lost["kind"] == "lost_node"
        and lost["nodes_to_blame"] == [1]
        and lost["ranks_to_blame"] == list(range(ranks, 2 * ranks))
    )
    assert (lost["step"], lost["resumed_step"], lost["world_after"], lost["nodes_after"]) == (5, 5, ranks, 1)
    assert grown["kind"] == "resized" and (grown["world_before"], grown["world_after"], grown["nodes_after"]) == (
        ranks,
        2 * ranks,
        2,
    )
    assert grown["steps_lost"] == 0 and grown["resumed_step"] == sessions[2]["from_step"] > 5
    ran = found["ran"]
    assert sorted(ran) == list(range(6, found["steps"] + 1))
    for s in reference[0]["steps"][5:]:
        theirs = sorted(r for rank in reference for r in rank["steps"][s["step"] - 1]["rows"])
        assert sorted(ran[s["step"]][0]) == theirs, s["step"]
        assert_close([ran[s["step"]][1]], [s["loss"]], rel=1e-5)
    assert_close(found["last"]["weights"], reference[0]["weights"], rel=1e-5)


@pytest.mark.mostly_waits
@pytest.mark.distributed
def test_a_straggler_node_is_excluded_and_the_job_goes_on_without_it(elastic):
    """straggler_node: a score near 0.75, as a 4x forward measured on a busy 2-core host, is
    decided with too little confidence to act, advice only; this 30x rank is named, a checkpoint
    saved and node 1's agent and rank ended; node 0's agent restarts its rank alone, which resumes
    from that checkpoint, nothing lost, every step still training the undisturbed 2-rank run's rows."""
    found = elastic["straggler"].result()
    decisions, reference = found["decisions"], found["reference"]
    (named,) = [d for d in decisions if d["rule"] == "straggler"]
    assert named["action"] == "exclude_node" and named["params"] == {"node": 1} and named["evidence"]["ranks"] == [1]
    # a loaded host may start the job on node 0 alone (node 1's agent later than the rendezvous's last
    # call) and grow it to both at step 0: that restart is not the exclusion's
    (restart,) = [d["evidence"] for d in decisions if d["rule"] == "restart" and d["step"] > 0]
    assert restart["kind"] == "excluded" and restart["nodes_to_blame"] == [1] and restart["steps_lost"] == 0
    assert restart["resumed_step"] == named["step"] and restart["world_after"] == 1
    (session,) = [s for s in found["sessions"] if s["steps"] and s["steps"][0]["step"] > named["step"]]
    assert [s["step"] for s in session["steps"]] == list(range(named["step"] + 1, found["steps"] + 1))
    for ours in session["steps"]:
        theirs = [rank["steps"][ours["step"] - 1] for rank in reference]
        assert sorted(ours["rows"]) == sorted(theirs[0]["rows"] + theirs[1]["rows"])
        assert_close([ours["loss"]], [theirs[0]["loss"]], rel=1e-5)
    assert_close(session["weights"], reference[0]["weights"], rel=1e-5)


def test_a_first_ctrl_c_says_the_run_stops_after_the_step_and_a_second_interrupts_at_once(capfd):
    """The first SIGINT while training asks the trainer to stop after its step and says so in one
    console line (it said nothing, for the step and the save it can take); the second raises
    KeyboardInterrupt at once, which the CLI turns into one line and exit 130."""
    from types import SimpleNamespace

    from trimtab.training.services.signals import handle_signals

    asked: list[str] = []
    trainer = SimpleNamespace(
        stop_reason="",
        dist=SimpleNamespace(on_signal=lambda name: f"stopped ({name})"),
        request_stop=lambda reason: asked.append(reason),
    )
    before = signal.getsignal(signal.SIGINT)
    with handle_signals(trainer):  # type: ignore[arg-type]
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the next bytecode
        time.sleep(0.01)
        assert asked == ["stopped (SIGINT)"]
        trainer.stop_reason = asked[0]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    assert signal.getsignal(signal.SIGINT) is before
    assert capfd.readouterr().err.splitlines() == [
        "trimtab: SIGINT: stopping after this step and saving (Ctrl-C again stops at once, losing the steps "
        "since the last checkpoint)"
    ]
