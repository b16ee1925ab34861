"""A run of one process killed from outside (SIGKILL, the OOM killer, a preemption without notice)
and started again: the restart's evidence says the process was lost, not that a rank of a job was
(`lost_rank` says the other ranks' collectives failed with it; a session of one has no others). One that failed with
a Python error wrote its exit record (watchdogs.NoWatchdog): a crash, with its error."""

import time
from types import SimpleNamespace

import pytest

import trimtab
from helpers import CrashAt
from test_orchestrator_loop import debug_cfg
from trimtab.orchestrator.remedies import restart
from trimtab.orchestrator.restarts import Resilience
from trimtab.resilience.goodput import Ledger, totals
from trimtab.rundir import GOODPUT_FILE, read_decisions, write_json


def lost_session(run_dir, world: int) -> None:
    """A session of `world` processes that trained to step 12 and never said it ended."""
    ledger = Ledger(run_dir)
    ledger.open(time.time() - 30.0, 0, world, 0, 0.0)
    for step in range(1, 13):
        ledger.step(step, 0.1)
    ledger.write(force=True)  # no close(): SIGKILL


def restarted(run_dir, step: int = 10) -> dict:
    """The restart's incident as rank 0 of a one-process session resumed at `step` reads it."""
    proposed, said = [], []
    run = SimpleNamespace(is_main=True, step=step, world=1, say=said.append, propose=proposed.append, data_position="")
    hook = Resilience(run_dir)
    hook.on_train_start(run)
    (finding,) = proposed
    assert said == []  # the orchestrator's decision says it (the hook's own line: orchestrator off)
    return finding


def test_a_single_process_killed_then_resumed_is_a_lost_process_not_a_lost_rank(tmp_path):
    lost_session(tmp_path, world=1)
    finding = restarted(tmp_path)
    evidence = finding.evidence
    assert evidence["kind"] == "lost_process" and evidence["ranks_to_blame"] == []
    assert (evidence["step"], evidence["resumed_step"], evidence["steps_lost"]) == (12, 10, 2)
    assert evidence["step_exact"] is True  # goodput.step holds step 12
    assert finding.summary.startswith("the process ended without a word")
    assert "collectives" not in restart(finding).reasoning  # no other rank failed with it
    ledger = Ledger(tmp_path)
    assert ledger.incidents[-1]["kind"] == "lost_process"  # goodput.json's record too


def test_a_lost_rank_of_a_job_of_two_is_still_a_lost_rank(tmp_path):
    """The ranks' records decide as before when the session had several processes."""
    from trimtab.resilience.incidents import localize
    from trimtab.rundir import write_json

    ranks = tmp_path / "ranks"
    ranks.mkdir()
    beat = {"host": "h", "node": 0, "pid": 1, "time": 10.0}
    write_json(ranks / "rank0.json", {"rank": 0, "step": 7, "section": "sync", "exit": "DistError: peer", **beat})
    write_json(ranks / "rank1.json", {"rank": 1, "step": 7, "section": "data", **beat})
    evidence = localize(tmp_path, 0.0, "session1", world=2)
    assert evidence["kind"] == "lost_rank" and evidence["ranks_to_blame"] == [1]
    write_json(ranks / "rank1.json", {"rank": 1, "step": 7, "section": "data", "exit": "RuntimeError: x", **beat})
    assert localize(tmp_path, 0.0, "session1", world=1)["kind"] == "crash"  # an exit record: not lost


def test_a_lost_sessions_time_after_its_last_ledger_write_is_in_the_runs_wall_time(tmp_path):
    """goodput.json is written at most every WRITE_S; a session killed after its last write lived on
    (its step mark, its ranks' beats say until when). That time was in no bucket and, its down time
    counted from the later sign of life, in no down either: the wall time (ETTR's denominator)
    lacked up to a second an incident (0.79 s measured on a single-process kill -9)."""
    seconds = {"productive": 15.0, "redone": 0.0, "checkpoint": 0.0, "evaluation": 0.0, "start_up": 5.0, "other": 0.0}
    lost = {"started": 1000.0, "beat": 1020.0, "end": None, "restart": 0, "world": 1, "from_step": 0, "step": 12}
    write_json(tmp_path / GOODPUT_FILE, {"sessions": [{**lost, "down_s": 0.0, "seconds": seconds}], "incidents": []})
    ledger = Ledger(tmp_path)
    ledger.open(1025.0, 10, 1, 0, 1020.8)  # alive until 1020.8 (its step mark), started again at 1025
    assert ledger.incidents[-1]["down_s"] == pytest.approx(4.2)
    wall = totals(ledger.sessions[:1], [])["wall_s"] + ledger.sessions[1]["down_s"]
    assert wall == pytest.approx(25.0)  # every second from the first start to the restart


def test_every_rank_silent_at_once_is_the_whole_job_lost_not_one_rank(tmp_path, monkeypatch):
    """Every rank of a job of two left no exit record (the node gone, the storage, a kill from
    outside): it was a lost_rank with none to blame, its resume saying "the other ranks' collectives
    failed with it", which none did. Now the whole job, with its nodes, hosts and how far apart the
    ranks' last beats are."""
    from trimtab.resilience.elastic import SESSION_ENV

    monkeypatch.delenv(SESSION_ENV, raising=False)
    lost_session(tmp_path, world=2)
    (tmp_path / "ranks").mkdir()
    last = time.time() - 20
    for rank in (0, 1):
        beat = {"rank": rank, "host": "h", "node": 0, "pid": 1, "step": 12, "section": "forward_backward"}
        write_json(tmp_path / "ranks" / f"rank{rank}.json", {**beat, "time": last + rank, "session": "s"})
    proposed = []
    run = SimpleNamespace(
        is_main=True, step=10, world=2, say=lambda line: None, propose=proposed.append, data_position=""
    )
    Resilience(tmp_path).on_train_start(run)
    (finding,) = proposed
    evidence = finding.evidence
    assert (evidence["kind"], evidence["ranks_to_blame"], evidence["nodes"], evidence["hosts"]) == (
        "lost_job",
        [],
        [0],
        ["h"],
    )
    assert evidence["beats_within_s"] == pytest.approx(1.0)
    assert finding.summary.startswith("every rank (2, host h) went silent at once, none with an exit record")
    assert "collectives failed with it" not in restart(finding).reasoning


def test_a_session_of_two_that_left_no_rank_record_blames_no_rank_and_says_why(tmp_path, monkeypatch):
    """resilience.watchdog off: no beats, no exit records. The lost session of two was a lost_rank
    with none to blame, its resume saying "the other ranks' collectives failed with it", which
    nothing recorded (a rank killed, one failed or the whole job ended look alike). Now it says so."""
    from trimtab.resilience.elastic import SESSION_ENV

    monkeypatch.delenv(SESSION_ENV, raising=False)
    lost_session(tmp_path, world=2)
    proposed = []
    run = SimpleNamespace(
        is_main=True, step=10, world=2, say=lambda line: None, propose=proposed.append, data_position=""
    )
    Resilience(tmp_path).on_train_start(run)
    (finding,) = proposed
    assert (finding.evidence["kind"], finding.evidence["ranks_to_blame"]) == ("lost_unknown", [])
    assert finding.summary.startswith("the session of 2 ranks ended with no record of what ended it")
    reasoning = restart(finding).reasoning
    assert "collectives failed with it" not in reasoning and "what ended it is not known" in reasoning
    assert Ledger(tmp_path).incidents[-1]["kind"] == "lost_unknown"  # goodput.json's record too


def test_the_steps_a_restart_trains_again_are_counted_replayed(tmp_path):
    """debug, 30 steps, checkpoint.every 5, sigkill@19: the lost session reached step 18, the restart resumed
    at 15 and trained 16-18 again, and summary.json said steps_replayed 0 (goodput.json counted them redone).
    A rollback's replay of them is the trainer's count already, not counted twice."""
    lost_session(tmp_path, world=1)  # reached step 12
    run = SimpleNamespace(is_main=True, step=10, world=1, say=print, propose=lambda f: None, data_position="")
    hook = Resilience(tmp_path)
    hook.on_train_start(run)
    for step in [*range(11, 16), *range(10, 16)]:  # 11-12 again after the restart; a rollback to 9 at 15
        hook.on_step_end(run, SimpleNamespace(step=step, seconds=0.01))
    summary = {"status": "completed", "steps_replayed": 6}  # the trainer's: the rollback's 10-15
    hook.on_train_end(run, summary)
    assert (summary["steps_replayed"], summary["steps_replayed_after_restart"]) == (8, 2)


def test_a_single_process_that_failed_with_an_error_is_said_to_have_failed_not_to_be_lost(tmp_path):
    """A Python error that ended a run of one process (a traceback on its console) read "the process ended
    without a word (SIGKILL, the OOM killer, its machine)" at the restart: no watchdog wrote its exit record."""
    run = tmp_path / "r"
    with pytest.raises(RuntimeError, match="crash"):
        trimtab.train(debug_cfg(run, steps=8), hooks=[CrashAt(5)])
    trimtab.train(debug_cfg(run, steps=8))
    (decision,) = [d for d in read_decisions(run) if d["rule"] == "restart"]
    assert decision["evidence"]["kind"] == "crash" and decision["evidence"]["ranks_to_blame"] == []
    assert decision["summary"].startswith("the job failed: RuntimeError: crash (test)"), decision["summary"]
    assert "its error ended it" in decision["reasoning"] and "without a word" not in decision["reasoning"]
