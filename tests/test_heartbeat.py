"""A host lost without a word is named in seconds by the ranks' heartbeats in torchrun's store, where it was;
a hang's line comes once every stack that can come is in; a torchrun survivor's SIGTERM line waits for the
ranks' agreement. Fake stores, no process group; and two ranks under torchrun, one SIGSTOPped."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from trimtab.resilience import procs, watchdog
from trimtab.resilience.elastic import SESSION_ENV
from trimtab.resilience.heartbeat import PERIOD_S, Heartbeat
from trimtab.resilience.incidents import localize
from trimtab.resilience.watchdog import Watchdog
from trimtab.rundir import read_json, write_json


class Store:
    """TCPStore's calls the heartbeat makes, over a dict; `frozen` set: add blocks (a frozen store host)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.frozen = threading.Event()

    def add(self, key: str, n: int) -> int:
        while self.frozen.is_set():
            time.sleep(0.01)
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def set(self, key: str, value: str) -> None:
        self.add("calls", 1)  # blocks too where frozen
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


def beating(store: Store, rank: int, world: int = 3) -> Heartbeat:
    beat = Heartbeat(rank, world, 3 * PERIOD_S, lambda: store, "trimtab/heartbeat/s1")
    beat._store = store
    return beat


def test_a_rank_whose_heartbeat_stopped_is_named_where_it_froze_and_one_that_ended_is_not():
    store = Store()
    ranks = [beating(store, r) for r in range(3)]
    ranks[1].poke(16, "forward_backward")
    ranks[1]._write_position()
    stopped_at = time.time() - 2.6  # rank 1 stopped mid-section 2.6 s ago, its last beat up to a period before
    store.data["trimtab/heartbeat/s1/pos1"] = f"16 forward_backward {stopped_at:.3f}".encode()
    for beat in reversed(ranks):  # rank 0 reads the others' first beats
        beat._round()
    assert ranks[0].lost(0.5) is None
    ranks[2]._store.set("trimtab/heartbeat/s1/end2", "1")  # rank 2 ended (its exit marked the store)
    for _ in range(3):  # rank 1 frozen (its rounds stop), rank 2 ended: rank 0 goes on beating
        ranks[0]._round()
    # its last position's time, not 3 rounds of PERIOD_S (a period more than it had been stopped)
    assert ranks[0].lost(0.5) == {"ranks": [1], "seconds": 2.6}
    assert ranks[0].positions[1]["step"] == 16 and ranks[0].positions[1]["section"] == "forward_backward"
    assert ranks[0].quiet() == [1]
    # rank 0 itself stopped (SIGSTOP) for longer than that counts no rounds: nothing lost on its SIGCONT
    assert ranks[2].lost(0.5) is None and ranks[1].lost(0.5) is None


def test_a_store_that_stops_answering_is_found_by_the_watchdogs_polls():
    store = Store()
    beat = Heartbeat(0, 2, 1.0, lambda: store, "trimtab/heartbeat/s1").start()
    try:
        deadline = time.monotonic() + 5
        while "trimtab/heartbeat/s1/beat0" not in store.data and time.monotonic() < deadline:
            time.sleep(0.01)
        store.frozen.set()
        beat.poke(3, "sync")  # the thread's next call blocks
        time.sleep(0.1)
        found = [beat.lost(0.5) for _ in range(2)]
        assert found[0] is None and found[1]["store"] and found[1]["seconds"] >= 0
    finally:
        store.frozen.clear()
        beat.stop()
    assert store.data["trimtab/heartbeat/s1/end0"] == b"1"


def test_a_silent_peers_line_comes_without_waiting_for_its_stack_and_names_where_it_froze(tmp_path, monkeypatch, capfd):
    """Rank 1, on this host, is stopped (SIGSTOP): it will write no stack. Rank 0's watchdog ends the job at
    once, not GRACE_S (5 s) later, and names rank 1 where its heartbeat last said (forward_backward of step
    16), not where its beat file, written at most once a second, did (hooks of step 15)."""
    monkeypatch.setenv(SESSION_ENV, "s1")
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    (tmp_path / "ranks").mkdir()
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        stale = {"rank": 1, "host": socket.gethostname(), "node": 0, "pid": frozen.pid, "step": 15}
        write_json(
            tmp_path / "ranks" / "rank1.json", {**stale, "section": "hooks", "session": "s1", "time": time.time()}
        )
        dog = Watchdog(tmp_path, 0, 2, first_timeout_s=60.0, timeout_factor=5.0, min_timeout_s=10.0, beat_s=60.0)
        dog.beat("forward_backward", 16)
        dog.heartbeat = SimpleNamespace(
            quiet=lambda: [1], positions={1: {"step": 16, "section": "forward_backward", "time": time.time() + 1}}
        )
        began = time.monotonic()
        with pytest.raises(SystemExit):
            dog._end(raised=True, section="forward_backward", elapsed=11.0, limit=10.0)
        took = time.monotonic() - began
        assert frozen.wait(timeout=5) == -signal.SIGKILL  # frozen on this host: killed (no SIGTERM reaches it)
    finally:
        if frozen.poll() is None:
            frozen.kill()
    said = capfd.readouterr().err
    assert took < 2.0, took
    assert "rank 1 stopped in forward_backward at step 16 and did not answer the alarm" in said, said


def two_ranks(tmp_path, monkeypatch, grace_s: float):
    """Rank 0's watchdog, whose os._exit raises SystemExit, with its heartbeat and rank 1's on one fake store."""
    monkeypatch.setenv(SESSION_ENV, "s1")
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr(watchdog, "GRACE_S", grace_s)
    store = Store()
    dog = Watchdog(tmp_path, 0, 2, first_timeout_s=60.0, timeout_factor=5.0, min_timeout_s=60.0, beat_s=60.0)
    dog.heartbeat, peer = beating(store, 0, 2), beating(store, 1, 2)
    return dog, peer


def test_the_watchdog_ends_the_job_when_a_heartbeat_stops_and_names_the_rank(tmp_path, monkeypatch, capfd):
    dog, peer = two_ranks(tmp_path, monkeypatch, grace_s=0.2)
    peer.poke(16, "data")
    peer._write_position()
    peer._store.data["trimtab/heartbeat/s1/pos1"] = f"16 data {time.time() - 3.2:.3f}".encode()
    peer._round()
    dog.beat("forward_backward", 16)
    dog._poll(time.monotonic(), 0.0)  # nothing lost yet: the poll goes on
    for _ in range(4):
        dog.heartbeat._round()
    with pytest.raises(SystemExit) as ended:
        dog._poll(time.monotonic(), 0.0)
    assert ended.value.code == watchdog.HUNG
    said = capfd.readouterr().err
    assert "rank 0 found rank 1 silent: its heartbeat stopped 3 s ago in data at step 16" in said, said
    # the restart's journal: rank 1 left no beat file, only its heartbeat's word
    evidence = localize(tmp_path, 0.0, "session1")
    assert evidence["kind"] == "hang" and evidence["ranks_to_blame"] == [1] and evidence["silent"] == [1]
    assert evidence["section"] == "data" and evidence["ranks"]["1"]["step"] == 16


def test_a_torchrun_survivors_sigterm_says_the_stop_only_once_the_ranks_agreed_on_it(capfd):
    """Under torchrun a signal's stop waits for the ranks' agreement (Parallel.on_signal returns ''): a peer
    lost before it fails that collective and the survivor's emergency save follows, so the line that said
    'stopping after this step' at the signal said what did not happen. It comes with the agreement now
    (Trainer._agree)."""
    from trimtab.training.services.signals import handle_signals

    asked: list[str] = []
    trainer = SimpleNamespace(
        stop_reason="", dist=SimpleNamespace(on_signal=lambda name: ""), request_stop=asked.append, peer_loss=None
    )
    with handle_signals(trainer):  # type: ignore[arg-type]
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
    assert asked == [""] and capfd.readouterr().err == ""
    from trimtab.training.trainer import Trainer

    trainer.dist.agree = lambda: "SIGTERM"  # every rank reached the agreement: the stop will come
    Trainer._agree(trainer)  # type: ignore[arg-type]
    assert asked == ["", "SIGTERM"]
    assert capfd.readouterr().err == "trimtab: SIGTERM: stopping after this step and saving\n"


def test_a_survivor_saving_for_a_loss_its_collective_found_is_not_ended_by_the_heartbeat_of_the_same_loss(
    tmp_path, monkeypatch
):
    """Rank 1 gone, rank 0's collective failed for it and its emergency save is under way (training/emergency.py
    sets loss_known): the heartbeat, finding rank 1 silent heartbeat_s on, leaves the save to the section's
    timeout (before: os._exit(HUNG) mid-write, a save longer than resilience.heartbeat_s cut)."""
    dog, peer = two_ranks(tmp_path, monkeypatch, grace_s=0.0)
    peer._round()
    for _ in range(5):
        dog.heartbeat._round()
    assert dog.heartbeat.lost(watchdog.POLL_S) is not None  # rank 1 found silent
    dog.loss_known = True
    dog.beat("checkpoint", 12)
    dog._poll(time.monotonic(), 0.0)  # the save goes on
    dog.loss_known = False
    with pytest.raises(SystemExit):
        dog._poll(time.monotonic(), 0.0)


def test_a_survivor_writing_its_emergency_save_answers_another_ranks_alarm_and_saves_on(tmp_path, monkeypatch):
    """3 ranks: rank 2 lost, rank 0's collective failed for it and its emergency save is under way (loss_known);
    rank 1, waiting in a collective, raises the hang alarm. Rank 0 writes its stack (rank 1 neither waits GRACE_S
    for it nor SIGKILLs it as mute) and saves on, under its section's timeout (before: os._exit mid-write)."""
    monkeypatch.setenv(SESSION_ENV, "s1")
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    (tmp_path / "ranks").mkdir()
    dog = Watchdog(tmp_path, 0, 3, first_timeout_s=60.0, timeout_factor=5.0, min_timeout_s=10.0, beat_s=60.0)
    dog.loss_known = True
    dog.beat("checkpoint", 12)
    (tmp_path / "hangs").mkdir()
    write_json(tmp_path / "hangs" / "alarm.json", {"rank": 1, "section": "sync", "step": 13, "time": time.time()})
    dog._poll(time.monotonic(), 0.0)  # the save goes on
    said = (tmp_path / "hangs" / "rank0.txt").read_text()
    assert "saving the last completed step for a lost peer" in said and "File " in said  # its stack
    assert "exit" not in read_json(tmp_path / "ranks" / "rank0.json")  # its exit record comes with its end
    (tmp_path / "hangs" / "rank0.txt").unlink()
    dog._alarm_checked = 0.0
    dog._poll(time.monotonic(), 0.0)
    assert not (tmp_path / "hangs" / "rank0.txt").exists()  # answered once
    with pytest.raises(SystemExit):  # still bounded: the save's section timeout ends it
        dog.current = ("checkpoint", dog.current[1] - 61.0)  # the save ran past its timeout
        dog._poll(time.monotonic(), 0.0)


# torchrun with its ranks forked from its agent, which imported what they use (tests/helpers.py TORCHRUN: the
# trainer's imports, seconds more, are not needed here); its monitor polls the ranks every 0.1 s, not 5
LEAN_TORCHRUN = [
    sys.executable,
    "-c",
    "import trimtab.distributed.group, trimtab.resilience.watchdog; from torch.distributed.run import main; main()",
    "--run-path",
    "--start-method=fork",
    "--monitor-interval=0.1",
]
# Two ranks under torchrun beat the loop's sections as training does, each with the heartbeat through torchrun's own
# store (distributed/group.py heartbeat_store), as setup.py makes them (make_watchdog).
RANKS = """
import sys, time
import torch.distributed as dist
from trimtab.config.resilience import ResilienceConfig
from trimtab.distributed.group import heartbeat_store
from trimtab.resilience.elastic import name_session
from trimtab.resilience.watchdogs import make_watchdog

dist.init_process_group("gloo")
name_session("s1")
cfg = ResilienceConfig(heartbeat_s=float(sys.argv[2]))
dog = make_watchdog(cfg, sys.argv[1], dist.get_rank(), dist.get_world_size(), lambda: heartbeat_store(30.0))
with dog.watching():
    for step in range(1, 100_000):
        for section in ("data", "forward_backward", "optimizer", "hooks"):
            dog.beat(section, step)
            time.sleep(0.005)
"""


def beating_rank(run_dir, rank: int, job: subprocess.Popen) -> dict:
    """Rank `rank`'s beat file once the loop beats (its watchdog and heartbeat started)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and job.poll() is None:
        beat = read_json(run_dir / "ranks" / f"rank{rank}.json")
        if isinstance(beat, dict) and beat.get("step", 0) > 0:
            return beat
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} never beat (torchrun: {job.poll()})")


@pytest.mark.distributed
@pytest.mark.mostly_waits
def test_a_rank_stopped_under_torchrun_is_named_by_its_peers_heartbeat_within_its_bound(tmp_path):
    """Rank 1 of 2 SIGSTOPped mid-loop (a frozen host's rank: no socket closes, no collective fails): rank 0's
    heartbeat names it, where it was, within heartbeat_s, a period and a poll, and rank 0 ends (HUNG: torchrun
    ends the job); the seconds said are the seconds it had been stopped (before: up to a period more)."""
    script, heartbeat_s, said = tmp_path / "ranks.py", 2.0, tmp_path / "stderr.txt"
    script.write_text(RANKS)
    with open(said, "w") as err:
        job = subprocess.Popen(
            [*LEAN_TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), str(tmp_path), str(heartbeat_s)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    ranks: list[dict] = []
    try:
        ranks = [beating_rank(tmp_path, 0, job), beating_rank(tmp_path, 1, job)]
        time.sleep(1.5 * PERIOD_S)  # rank 0 has read rank 1's counter move
        stopped_at = time.time()
        os.kill(ranks[1]["pid"], signal.SIGSTOP)
        deadline = time.monotonic() + heartbeat_s + 10
        while time.monotonic() < deadline and not procs.gone(ranks[0]["pid"], ranks[0]["time"]):
            time.sleep(0.1)
    finally:  # rank 0 ended and SIGKILLed rank 1 (frozen on its host); what is left, this test ends
        for beat in ranks:
            if procs.alive_since(beat["pid"], beat["time"]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(beat["pid"], signal.SIGKILL)
        job.kill()  # its agent, whose teardown takes seconds more: not this test's
        job.wait(timeout=10)
    text = said.read_text()
    found = read_json(tmp_path / "hangs" / "rank0.json")
    assert isinstance(found, dict) and found["raised"], text[-3000:]
    assert read_json(tmp_path / "ranks" / "rank0.json")["exit"].startswith("hung in"), text[-3000:]
    took = found["time"] - stopped_at
    assert took <= heartbeat_s + PERIOD_S + watchdog.POLL_S + 0.5, took  # the heartbeat's bound, and a little
    line = next(x for x in text.splitlines() if "rank 0 found rank 1 silent" in x)
    seconds = float(line.split("its heartbeat stopped ")[1].split(" s ago")[0])
    assert abs(seconds - took) <= 0.8, (seconds, took, line)  # said to the second (the line rounds it)
    assert re.search(r" s ago in \w+ at step \d+ ", line), line  # where it stopped
