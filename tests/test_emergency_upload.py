"""A survivor's emergency save with checkpoint.dir (training/emergency.py _upload_before_exit, training/services/
storage.py RemoteCheckpoints.upload_before_exit): uploaded before the process ends, within UPLOAD_BY_S of the loss,
after the upload in flight; before, it never went through the hooks (a fresh machine resumed from the checkpoint
before it), and the exit (the CLI's return, the watchdog's os._exit) cut the upload in flight (a daemon thread).

In one process, as tests/test_emergency_save.py: the lost peer is a collective raising gloo's error; the store a
local folder (file://), as in tests/test_storage_end.py: what is tested is what goes up, not the protocol."""

from __future__ import annotations

import threading
import time

import pytest

from test_emergency_save import lose_peer_in
from test_emergency_save import trainer as save_trainer
from trimtab.resilience import watchdog
from trimtab.resilience.watchdog import HUNG
from trimtab.rundir import read_jsonl
from trimtab.storage import MANIFEST, Remote
from trimtab.training import emergency
from trimtab.training.services.storage import RemoteCheckpoints
from trimtab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def trainer(out, store: str, *sets: str) -> Trainer:
    """test_emergency_save's run (checkpoints every 3 steps), 6 steps logged each, uploaded to `store`."""
    upload = ["train.max_steps=6", "train.log_every=1", "log.report=false", f"checkpoint.dir={store}"]
    return save_trainer(out, 3, *upload, *sets)


def held(store, step: int) -> bool:
    """Whether the store holds checkpoint `step` whole (its manifest, written last)."""
    return (store / f"step_{step:06d}" / MANIFEST).is_file()


def slowed(monkeypatch, name: str, seconds: float) -> threading.Event:
    """Checkpoint `name`'s upload waits `seconds`, or until the event returned is set: a slow store."""
    upload, release = Remote.upload, threading.Event()

    def slow(self, links):
        if links.name == name:
            release.wait(seconds)
        return upload(self, links)

    monkeypatch.setattr(Remote, "upload", slow)
    return release


def test_an_emergency_save_is_uploaded_and_a_fresh_machine_resumes_from_it(tmp_path, capfd):
    """Checkpoints every 3 steps, rank 1 lost in step 5: step 4, saved alone, is in the store once the survivor's
    loop ends (before: steps 0 and 3 only), with the run's record and step mark, and a run directory restored from
    the store resumes from it: "resumed at step 4 ... (0 steps lost)", exact (before: resumed at step 3, "after
    step 0 (the newest its files recorded) ... at least 0 steps lost", 1 step lost unsaid)."""
    store, out = tmp_path / "store", tmp_path / "run"
    hit = trainer(out, f"file://{store}")
    with pytest.MonkeyPatch.context() as patch:
        lose_peer_in(hit, 5, patch)
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            hit.fit()
    assert held(store, 4), sorted(p.name for p in store.iterdir())
    assert (store / "run" / "goodput.step").read_text().split()[1] == "4"  # the session's last completed step
    said = capfd.readouterr().err
    assert f"step_000004 (the emergency save) uploaded to file://{store}" in said, said

    fresh = trainer(tmp_path / "fresh", f"file://{store}")  # a fresh machine: an empty run directory
    assert fresh.state.step == 4 and "resuming from step 4, an emergency save" in capfd.readouterr().err
    fresh.fit()
    restart = [d for d in read_jsonl(tmp_path / "fresh" / "decisions.jsonl") if d["rule"] == "restart"]
    assert len(restart) == 1, restart
    evidence = restart[0]["evidence"]
    assert (evidence["resumed_step"], evidence["steps_lost"], evidence["step_exact"]) == (4, 0, True), evidence


def test_the_upload_in_flight_ends_before_the_watchdogs_exit(tmp_path, monkeypatch, capfd):
    """Step 3's checkpoint uploading slowly (1.5 s), rank 1 lost in step 4 after the watchdog killed it as frozen:
    step 3 is the last completed step, saved already, and the process ends through the watchdog's os._exit(HUNG).
    Before, that exit came with step 3's upload under way, cut: the store's newest was step 0."""
    store = tmp_path / "store"
    slowed(monkeypatch, "step_000003", 1.5)
    hit = trainer(tmp_path / "run", f"file://{store}", "resilience.watchdog=on")
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))

    def killed_a_frozen_peer() -> None:  # what Watchdog._end sets once it killed a frozen peer for the loop to save
        hit.watchdog._hung_exit = "hung in sync"

    lose_peer_in(hit, 4, monkeypatch, then=killed_a_frozen_peer)
    with pytest.raises(SystemExit) as ended:
        hit.fit()
    assert ended.value.code == HUNG
    assert held(store, 3)  # before: step 3's upload still waiting, cut by the exit
    assert f"the upload of step_000003 to file://{store} finished before the exit" in capfd.readouterr().err


def test_an_upload_past_the_bound_is_said_and_the_survivor_ends_at_it(tmp_path, monkeypatch, capfd):
    """The emergency save's upload outlasts UPLOAD_BY_S (here 1 s): the survivor ends at the bound, as torchrun's
    SIGKILL 30 s after the loss would otherwise end it, says the save was not uploaded and that the restart resumes
    from the run directory's copy; the store holds no partial checkpoint read as whole."""
    store = tmp_path / "store"
    release = slowed(monkeypatch, "step_000004", 30.0)
    monkeypatch.setattr(emergency, "UPLOAD_BY_S", 1.0)
    hit = trainer(tmp_path / "run", f"file://{store}")
    lost = lose_peer_in(hit, 5, monkeypatch)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    ended = time.monotonic() - lost[0]
    assert not held(store, 4)  # its upload under way: a step_N/ without its manifest, never resumed from
    release.set()
    hook = next(h for h in hit.hooks if isinstance(h, RemoteCheckpoints))
    hook.wait()  # the test's own thread, let go: nothing left running after the test
    said = capfd.readouterr().err
    assert 1.0 <= ended < 5.0, ended
    assert "step_000004 (the emergency save) not uploaded to" in said and "cut at the exit" in said, said
    assert "the restart resumes from the run directory's copy" in said
