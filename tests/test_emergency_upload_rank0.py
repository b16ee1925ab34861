"""checkpoint.dir where rank 0 is not the one that ends well (training/emergency.py _exit_store,
upload_before_hang_exit; training/services/storage.py RemoteCheckpoints.upload_before_exit; docs/storage.md):

- rank 0 lost, the survivor that wrote the emergency save uploads it (before: only rank 0 uploads, and it was
  gone: a fresh machine resumed up to checkpoint.every steps earlier); another survivor, whose claim lost, does not;
- the watchdog's os._exit for a hang with no loop save waits for the upload in flight (before: it cut it);
- an upload cut at any of its writes is never resumed from (checked: it never was).

The store is a local folder (file://) as in tests/test_emergency_upload.py; the lost peer, in one process, a
collective raising gloo's error, and once through torchrun, rank 0 SIGKILLed (`kill_rank@5:0`)."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from helpers import TORCHRUN, TRIMTAB_MAIN
from test_emergency_upload import held, lose_peer_in, slowed, trainer
from trimtab.checkpoint import save_checkpoint, verify
from trimtab.resilience import watchdog
from trimtab.resilience.watchdog import HUNG
from trimtab.rundir import read_jsonl
from trimtab.storage import Remote, open_remote, restore
from trimtab.training import emergency
from trimtab.training.hooks import Hook
from trimtab.training.services.storage import RemoteCheckpoints

pytestmark = pytest.mark.usefixtures("one_thread")


def as_survivor(t, claimed_by_another: bool = False):
    """What `then` does as the peer is lost: this process plays rank 1 from here, rank 0 (the one holding the
    RemoteCheckpoints hook, which uploaded steps 0 and 3) the one lost; `claimed_by_another`: a third rank's
    survivor claimed the step first (checkpoints/.emergency_step_N: training/emergency.py _claim)."""

    def then() -> None:
        t.hooks[:] = [h for h in t.hooks if not isinstance(h, RemoteCheckpoints)]
        t.dist.rank = 1
        if claimed_by_another:
            (t.cfg.run_dir / "checkpoints" / f".emergency_step_{t.state.step:06d}").touch()

    return then


def test_a_survivor_other_than_rank_0_uploads_the_emergency_save_it_wrote(tmp_path, monkeypatch, capfd):
    """Checkpoints every 3 steps, rank 0 lost in step 5: rank 1 saves step 4 and uploads it with the step mark
    (before: "not uploaded to checkpoint.dir: rank 0 uploads there, and was lost", the store's newest step 3)."""
    store = tmp_path / "store"
    monkeypatch.setattr(emergency, "RANK_0_FIRST_S", 0.0)
    hit = trainer(tmp_path / "run", f"file://{store}")
    lose_peer_in(hit, 5, monkeypatch, then=as_survivor(hit))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    said = capfd.readouterr().err
    assert held(store, 4), said
    assert (store / "run" / "goodput.step").read_text().split()[1] == "4"
    assert f"rank 1: step_000004 (the emergency save) uploaded to file://{store}" in said, said
    assert not any((tmp_path / "run" / "checkpoints" / ".upload_rank1").iterdir())  # its links gone with the upload


def test_a_survivor_that_did_not_write_the_save_uploads_nothing(tmp_path, monkeypatch, capfd):
    """3 ranks, rank 0 lost, another survivor claimed step 4 first: this one writes nothing and uploads nothing
    (the writer uploads its own save), so two survivors never upload two copies of one step."""
    store = tmp_path / "store"
    monkeypatch.setattr(emergency, "RANK_0_FIRST_S", 0.0)
    hit = trainer(tmp_path / "run", f"file://{store}")
    lose_peer_in(hit, 5, monkeypatch, then=as_survivor(hit, claimed_by_another=True))
    uploads = []
    upload = Remote.upload
    monkeypatch.setattr(Remote, "upload", lambda self, links: uploads.append(links.name) or upload(self, links))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    assert uploads == ["step_000000", "step_000003"] and not held(store, 4)  # rank 0's, before it was lost
    assert "emergency save" not in capfd.readouterr().err


class Stuck(Hook):
    """The loop stops for good in step `step`'s hooks (a deadlock): the watchdog's hang, no peer lost, no loop
    save. It goes on once the watchdog's (stubbed) os._exit came, so the test can end."""

    def __init__(self, t, step: int) -> None:
        self.t, self.step, self.exited = t, step, threading.Event()

    def on_step_end(self, run, out) -> None:
        if out.step == self.step:
            self.t.watchdog.beat("stuck")
            self.exited.wait(60)
            raise SystemExit(HUNG)


def test_a_hangs_exit_waits_for_the_upload_in_flight(tmp_path, monkeypatch, capfd):
    """Step 3's upload slowed to 2 s, the loop stuck at step 4 (timed out in 0.5 s): the watchdog ends the
    process (os._exit(HUNG), nothing saved by the loop) once step 3 is in the store. Before, the exit came with
    its upload under way, cut: the store's newest was step 0."""
    store = tmp_path / "store"
    slowed(monkeypatch, "step_000003", 2.0)
    hit = trainer(tmp_path / "run", f"file://{store}", "resilience.watchdog=on")
    stuck = Stuck(hit, 4)
    hit.hooks.append(stuck)
    limit = hit.watchdog.timeout
    monkeypatch.setattr(hit.watchdog, "timeout", lambda section: 0.5 if section == "stuck" else limit(section))
    at_exit = []

    def exit_(code: int) -> None:  # the watchdog's thread: what the store holds as the process would end
        at_exit.append((code, held(store, 3)))
        hit.watchdog._stop.set()  # its thread polls no more
        stuck.exited.set()

    monkeypatch.setattr(watchdog.os, "_exit", exit_)
    with pytest.raises(SystemExit):
        hit.fit()
    assert at_exit == [(HUNG, True)]  # before: [(5, False)], step 3's upload cut
    said = capfd.readouterr().err
    assert f"rank 0: the upload of step_000003 to file://{store} finished before the exit" in said, said
    assert (store / "run" / "goodput.step").read_text().split()[1] == "4"  # the record with the step mark


def upload_cut(remote: Remote, checkpoint, cut: int) -> None:
    """`checkpoint` uploaded to `remote` by a process that ends before its write number `cut` (from 0)."""
    writes, put, rm = [0], remote.fs.put_file, remote.fs.rm_file

    def counted(call):
        def write(*args, **kwargs):
            if writes[0] == cut:
                raise KeyboardInterrupt  # the process ends here
            writes[0] += 1
            return call(*args, **kwargs)

        return write

    remote.fs.put_file, remote.fs.rm_file = counted(put), counted(rm)
    try:
        with pytest.raises(KeyboardInterrupt):
            remote.upload(checkpoint)
    finally:
        remote.fs.put_file, remote.fs.rm_file = put, rm


def test_an_upload_cut_at_any_write_is_never_resumed_from(tmp_path):
    """A process ended in an upload (the watchdog's os._exit, a SIGKILL) at each of its writes, a new step's and a
    re-saved one's (its old state.json removed first): the store's listing reads it partial or as the whole copy
    it was, and a restore takes the newest whole one (measured the same with os._exit in a forked uploader and on
    memory://: step 6 cut at 1-2 writes of 3, restored step 3; past its state.json, step 6)."""
    run = tmp_path / "run"
    weights = {"w": torch.ones(8, 8)}
    old = save_checkpoint(run, 3, weights, {"optimizer": {}}, {"train": {"step": 3}}, 5, ())
    new = save_checkpoint(run, 6, {"w": weights["w"] * 2}, {"optimizer": {}}, {"train": {"step": 6}}, 5, ())
    for again in (False, True):
        for cut in range(4 if again else 3):  # a new step's 3 writes (2 files, state.json), a re-saved one's 4
            remote = open_remote(f"file://{tmp_path}/store-{again}-{cut}")
            for before in (old, new) if again else (old,):
                remote.upload(before)
            upload_cut(remote, new, cut)
            into = tmp_path / f"restored-{again}-{cut}"
            into.mkdir()
            found = restore(remote, into, verify)
            whole = again and cut == 0  # nothing written yet: the earlier whole copy of step 6
            assert found is not None and found[1]["train"]["step"] == (6 if whole else 3), (again, cut)


@pytest.mark.distributed
def test_rank_0_killed_under_torchrun_the_survivors_save_is_in_the_store(tmp_path):
    """`torchrun --nproc_per_node 2 trimtab train`, checkpoint.every=3, `kill_rank@5:0`: rank 1 saves step 4 and
    uploads it (before: rank 1 said "not uploaded to checkpoint.dir: rank 0 uploads there, and was lost", the
    store's newest step 3, no step mark); a fresh machine restored from the store resumes at step 4, 0 steps lost."""
    done, store, out = torchrun_losing_rank_0(tmp_path, "kill_rank@5:0")
    said = done.stderr[-6000:]
    assert "rank 1 saved step 4 alone" in said, said
    assert f"rank 1: step_000004 (the emergency save) uploaded to file://{store}" in said, said
    assert held(store, 4) and (store / "run" / "goodput.step").read_text().split()[1] == "4"

    fresh = trainer(tmp_path / "fresh", f"file://{store}", "train.max_steps=8")  # an empty run directory
    assert fresh.state.step == 4
    fresh.fit()
    (restart,) = [d for d in read_jsonl(tmp_path / "fresh" / "decisions.jsonl") if d["rule"] == "restart"]
    evidence = restart["evidence"]
    assert (evidence["resumed_step"], evidence["steps_lost"], evidence["step_exact"]) == (4, 0, True), evidence


def torchrun_losing_rank_0(
    tmp_path, fault: str, env: dict | None = None
) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """`torchrun --nproc_per_node 2 trimtab train` of a one-layer debug model, 8 steps, checkpoint.every=3 into a
    file:// store, `fault` injected (rank 0's loss); `env` over this one's. What it did, the store, the run."""
    store, out = tmp_path / "store", tmp_path / "run"
    sets = ["train.max_steps=8", "train.eval_every=0", "train.log_every=1", "train.precision=fp32"]
    sets += ["data.max_bytes=100000", "model.n_layers=1", "checkpoint.every=3", f"checkpoint.dir=file://{store}"]
    sets += ["log.progress=false", "log.tensorboard=false", "log.report=false"]
    args = [TRIMTAB_MAIN, "train", "--preset", "debug", "--out", str(out), "--inject", fault]
    args += [a for s in sets for a in ("--set", s)]
    launch = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([*launch, *args], env=env, capture_output=True, text=True, timeout=240), store, out
