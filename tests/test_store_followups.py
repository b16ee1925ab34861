"""checkpoint.dir where rank 0 of a DDP run is lost with no emergency save to write (training/emergency.py
emergency_save, _exit_store; training/services/storage.py RemoteCheckpoints.upload_before_exit `saved`), and a fresh
machine's restart from the store (resilience/incidents.py lost_elsewhere; docs/storage.md, docs/resilience.md):

- the last completed step saved just before the loss, rank 0 lost in its upload (or before it): the survivor whose
  claim wins uploads the run directory's newest checkpoint where the store lacks it whole, and the record with the
  step mark (before: nobody did, and a fresh machine resumed a checkpoint.every earlier);
- a fresh machine's restart says the lost session's rank records stayed where it ran (before: "resilience.watchdog
  off: no beats", and "torchrun's elastic agent restarted the job", both false there);
- a survivor's pruning of the store leaves a partial upload alone: a late rank 0's may be in flight (before: deleted
  under it, and rank 0's upload then ended as a step that reads complete and fails verification).

As tests/test_emergency_upload_rank0.py: in one process, the lost peer a collective raising gloo's error, the store a
local folder (file://); and once through torchrun, rank 0 SIGKILLed (`kill_rank@4:0`) as its upload runs."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from test_dist2_lost_process import lost_session
from test_emergency_upload import held, lose_peer_in, trainer
from test_emergency_upload_rank0 import torchrun_losing_rank_0
from trimtab.checkpoint import save_checkpoint, verify
from trimtab.orchestrator.remedies import restart
from trimtab.orchestrator.restarts import Resilience
from trimtab.resilience.elastic import SESSION_ENV
from trimtab.resilience.goodput import Ledger
from trimtab.rundir import read_jsonl
from trimtab.storage import MANIFEST, Remote, open_remote, restore
from trimtab.training import emergency
from trimtab.training.services.storage import RemoteCheckpoints, restore_from

pytestmark = pytest.mark.usefixtures("one_thread")


def rank_0_lost(t, claimed_by_another: bool = False):
    """What `then` does as the peer is lost in step 4: rank 0's upload of step 3 has ended (cut or whole), and this
    process plays rank 1 from here, rank 0 (the one holding the RemoteCheckpoints hook) the one lost;
    `claimed_by_another`: a third rank's survivor claimed the step first (training/emergency.py _claim)."""

    def then() -> None:
        hook = next(h for h in t.hooks if isinstance(h, RemoteCheckpoints))
        hook.wait()
        t.hooks.remove(hook)
        t.dist.rank = 1
        if claimed_by_another:
            (t.cfg.run_dir / "checkpoints" / f".emergency_step_{t.state.step:06d}").touch()

    return then


def uploads_by_rank(monkeypatch, cut: str = "") -> dict[str, list[str]]:
    """Each uploader's checkpoint uploads, by its links' folder (.upload: rank 0's hook, .upload_rank1: the
    survivor's); `cut`: rank 0's upload of that checkpoint ends after its first file (rank 0 killed in it)."""
    upload, seen = Remote.upload, {}

    def counted(self, links):
        seen.setdefault(links.parent.name, []).append(links.name)
        if links.parent.name == ".upload" and links.name == cut:
            first = min(p for p in links.rglob("*") if p.is_file() and p.name != MANIFEST)
            self._put(first, f"{self.root}/{links.name}/{first.relative_to(links).as_posix()}")
            raise ConnectionError("rank 0 killed in its upload")
        return upload(self, links)

    monkeypatch.setattr(Remote, "upload", counted)
    return seen


def step_mark(store) -> str | None:
    """The step in the store's goodput.step (None: no step mark there)."""
    mark = store / "run" / "goodput.step"
    return mark.read_text().split()[1] if mark.is_file() else None


def test_rank_0_lost_in_the_newest_checkpoints_upload_the_survivor_uploads_it(tmp_path, monkeypatch, capfd):
    """Checkpoints every 3 steps, rank 0 lost in step 4 with step 3's upload cut after its first file: step 3 is the
    last completed step, saved already (no emergency save), and rank 1 uploads it with the step mark. Before, nobody
    did: the store's newest whole checkpoint stayed step 0, and a fresh machine resumed 3 steps back."""
    store = tmp_path / "store"
    monkeypatch.setattr(emergency, "RANK_0_FIRST_S", 0.0)
    hit = trainer(tmp_path / "run", f"file://{store}")
    seen = uploads_by_rank(monkeypatch, cut="step_000003")
    lose_peer_in(hit, 4, monkeypatch, then=rank_0_lost(hit))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    said = capfd.readouterr().err
    assert seen == {".upload": ["step_000000", "step_000003"], ".upload_rank1": ["step_000003"]}, seen
    assert held(store, 3) and step_mark(store) == "3", said  # before: held(store, 3) False, no step mark
    line = f"rank 1: step_000003 (the newest checkpoint, saved before the loss) uploaded to file://{store}"
    assert line in said, said

    fresh = trainer(tmp_path / "fresh", f"file://{store}")  # a fresh machine: an empty run directory
    assert fresh.state.step == 3  # before: 0


def test_a_store_that_holds_it_whole_gets_the_step_mark_alone(tmp_path, monkeypatch, capfd):
    """Rank 0's upload of step 3 ended whole before it was lost in step 4: rank 1 uploads no checkpoint, only the
    record with the step mark (rank 0's upload after a checkpoint has none), so a fresh machine's restart says how
    far the session got exactly."""
    store = tmp_path / "store"
    monkeypatch.setattr(emergency, "RANK_0_FIRST_S", 0.0)
    hit = trainer(tmp_path / "run", f"file://{store}")
    seen = uploads_by_rank(monkeypatch)
    lose_peer_in(hit, 4, monkeypatch, then=rank_0_lost(hit))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    said = capfd.readouterr().err
    assert seen == {".upload": ["step_000000", "step_000003"]}, seen
    assert held(store, 3) and step_mark(store) == "3", said  # before: no step mark
    assert f"step_000003 (the newest checkpoint, saved before the loss) was in file://{store} whole" in said, said


def test_another_copy_of_the_step_in_the_store_is_replaced(tmp_path, monkeypatch):
    """The store's step_000003 is whole but another save's (its state.json differs: a rolled-back trajectory's,
    rank 0 lost before its upload of the step saved again began): the survivor uploads the run directory's."""
    store = tmp_path / "store"
    monkeypatch.setattr(emergency, "RANK_0_FIRST_S", 0.0)
    hit = trainer(tmp_path / "run", f"file://{store}")
    seen = uploads_by_rank(monkeypatch)
    then = rank_0_lost(hit)

    def another_copy() -> None:
        then()
        (store / "step_000003" / MANIFEST).write_text('{"another": "save"}')

    lose_peer_in(hit, 4, monkeypatch, then=another_copy)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    assert seen[".upload_rank1"] == ["step_000003"], seen
    local = tmp_path / "run" / "checkpoints" / "step_000003" / MANIFEST
    assert (store / "step_000003" / MANIFEST).read_bytes() == local.read_bytes()


def test_a_survivor_whose_claim_lost_uploads_nothing(tmp_path, monkeypatch, capfd):
    """3 ranks, rank 0 lost, another survivor claimed step 3 first: this one uploads nothing, neither the checkpoint
    nor the record (one survivor uploads)."""
    store = tmp_path / "store"
    monkeypatch.setattr(emergency, "RANK_0_FIRST_S", 0.0)
    hit = trainer(tmp_path / "run", f"file://{store}")
    seen = uploads_by_rank(monkeypatch, cut="step_000003")
    lose_peer_in(hit, 4, monkeypatch, then=rank_0_lost(hit, claimed_by_another=True))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    assert seen == {".upload": ["step_000000", "step_000003"]} and step_mark(store) is None, seen
    assert "newest checkpoint" not in capfd.readouterr().err


def test_a_fresh_machines_restart_says_the_rank_records_stayed_where_it_ran(tmp_path, monkeypatch):
    """A lost session of 2 ranks (their ranks/ records in its own run directory) and its record in the store; a
    fresh machine restores the run directory and resumes on 1 process. Before: "the session of 2 ranks ended with no
    record of what ended it (resilience.watchdog off: no beats ...)" and "torchrun's elastic agent restarted the job",
    both false (the watchdog ran; nothing restarted the job: a person launched it). Now lost_elsewhere, said so."""
    monkeypatch.delenv(SESSION_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    origin, fresh = tmp_path / "origin", tmp_path / "fresh"
    origin.mkdir()
    lost_session(origin, world=2)
    remote = open_remote(f"file://{tmp_path / 'store'}")
    remote.put_run_files(origin, ("goodput.json", "goodput.step"))
    assert restore_from(remote, fresh) is None  # no checkpoint in this store: the record alone restored
    proposed = []
    run = SimpleNamespace(is_main=True, step=10, world=1, say=None, propose=proposed.append, data_position="")
    Resilience(fresh).on_train_start(run)
    (finding,) = proposed
    assert finding.evidence["kind"] == "lost_elsewhere", finding.evidence  # before: lost_unknown
    assert finding.summary.startswith("the session of 2 ranks ended in another run directory"), finding.summary
    assert "watchdog off" not in finding.summary
    reasoning = restart(finding).reasoning
    assert "launched again" in reasoning and "torchrun's elastic agent" not in reasoning, reasoning


def test_a_session_lost_after_the_restore_reads_as_before(tmp_path, monkeypatch):
    """The restore's mark (ranks/restored.json) speaks for the sessions before it only: a session of this run
    directory lost later, with no rank record, is a lost process as it always was."""
    monkeypatch.delenv(SESSION_ENV, raising=False)
    origin, fresh = tmp_path / "origin", tmp_path / "fresh"
    origin.mkdir()
    lost_session(origin, world=2)
    remote = open_remote(f"file://{tmp_path / 'store'}")
    remote.put_run_files(origin, ("goodput.json",))
    restore_from(remote, fresh)
    ledger = Ledger(fresh)
    ledger.open(time.time() + 1.0, 12, 1, 0, 0.0)  # this machine's own session, begun after the restore, lost
    ledger.write(force=True)
    proposed = []
    run = SimpleNamespace(is_main=True, step=12, world=1, say=None, propose=proposed.append, data_position="")
    Resilience(fresh).on_train_start(run)
    assert proposed[0].evidence["kind"] == "lost_process", proposed[0].evidence


def test_a_survivors_pruning_leaves_a_late_rank_0s_upload_in_flight_alone(tmp_path):
    """Rank 0, late to the loss (its claim > RANK_0_FIRST_S after the survivor's), still uploading step 3 (paused after
    its first file) while the survivor uploads its emergency save, step 4, and prunes the store. Before, the
    survivor's pruning deleted the partial step_000003/ and rank 0 then wrote the rest and state.json: a step 3 that
    reads complete and fails verification (model.safetensors gone), refused at a restore. Now left alone, whole."""
    run, url = tmp_path / "run", f"file://{tmp_path / 'store'}"
    weights = {"w": torch.ones(64, 64)}
    steps = [save_checkpoint(run, s, weights, {"optimizer": {}}, {"train": {"step": s}}, 5, ()) for s in (0, 3, 4)]
    rank_0 = open_remote(url)
    rank_0.upload(steps[0])
    put, paused, go = rank_0._put, threading.Event(), threading.Event()

    def first_then_wait(local, remote) -> None:
        put(local, remote)
        paused.set()
        go.wait(30)

    rank_0._put = first_then_wait
    flight = threading.Thread(target=rank_0.upload, args=(steps[1],))
    flight.start()
    paused.wait(30)
    survivor = RemoteCheckpoints(url, run, 5, rank=1)
    line = survivor.upload_before_exit(steps[2], time.monotonic(), 20.0)
    assert "step_000004 (the emergency save) uploaded" in line, line
    assert open_remote(url).listing()[1] == ["step_000003"]  # before: [] (deleted in flight)
    go.set()
    flight.join(30)
    into, refused = tmp_path / "fresh", []
    into.mkdir()
    assert restore(open_remote(url), into, verify, only="step_000003", refused=refused) is not None, refused


SLOW_UPLOAD = """import time
import trimtab.storage as storage
upload = storage.Remote.upload
def slow(self, links):  # rank 0's upload of step 3 as a real store's of a real checkpoint: still running at step 4
    if links.parent.name == ".upload" and links.name == "step_000003":
        time.sleep(3.0)
    return upload(self, links)
storage.Remote.upload = slow
"""


@pytest.mark.distributed
def test_rank_0_killed_in_its_upload_under_torchrun(tmp_path):
    """`torchrun --nproc_per_node 2 trimtab train`, checkpoint.every=3, rank 0's upload of step 3 taking 3 s,
    `kill_rank@4:0`: rank 1 uploads step 3 with the step mark (before: the store's newest step 0, no step mark), and
    a fresh machine resumes at step 3, 0 steps lost, its restart line naming the run directory it was restored from
    (before: "resilience.watchdog off: no beats", "torchrun's elastic agent restarted the job")."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_UPLOAD)
    path = os.pathsep.join([str(slow), os.environ.get("PYTHONPATH", "")])
    done, store, out = torchrun_losing_rank_0(tmp_path, "kill_rank@4:0", {"PYTHONPATH": path})
    said = done.stderr[-6000:]
    assert f"rank 1: step_000003 (the newest checkpoint, saved before the loss) uploaded to file://{store}" in said
    assert held(store, 3) and step_mark(store) == "3", said

    fresh = trainer(tmp_path / "fresh", f"file://{store}", "train.max_steps=5")  # an empty run directory
    assert fresh.state.step == 3
    fresh.fit()
    (decision,) = [d for d in read_jsonl(tmp_path / "fresh" / "decisions.jsonl") if d["rule"] == "restart"]
    evidence = decision["evidence"]
    assert (evidence["kind"], evidence["resumed_step"], evidence["steps_lost"], evidence["step_exact"]) == (
        "lost_elsewhere",
        3,
        0,
        True,
    ), evidence
    assert "watchdog off" not in decision["summary"] and "torchrun's elastic agent" not in decision["reasoning"]
