"""What a run's checkpoint.dir holds once the run ended (training/services/storage.py, api.py,
docs/storage.md): a finished run, its machine gone, restored whole on a fresh one. The store is a
local folder (file://) or fsspec's memory store: what is tested is which files travel, not the protocol."""

import uuid
from types import SimpleNamespace

import pytest

from trimtab.config import load_config
from trimtab.storage import MANIFEST, open_remote
from trimtab.training.resume import resume_point
from trimtab.training.services.storage import RemoteCheckpoints, newer_in_store, restore_from


def test_the_planners_status_and_the_report_travel_with_the_run(tmp_path):
    """plan_status.jsonl (the live planner's blocks, the report's convergence plot) was not among
    the record files uploaded with each checkpoint, nor report.html at the end: a fresh machine's
    run directory lacked both."""
    url = f"memory://trimtab-test-{uuid.uuid4().hex[:8]}/ckpt"
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000003").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000003" / MANIFEST).write_text('{"step": 3, "manifest": {}}')
    for name, text in {"config.yaml": "a: 1\n", "plan_status.jsonl": '{"step": 3}\n', "report.html": "<p>"}.items():
        (run_dir / name).write_text(text)
    (run_dir / "summary.json").write_text('{"step": 3}')
    hook = RemoteCheckpoints(url, run_dir, keep=3)
    hook.on_checkpoint(None, run_dir / "checkpoints" / "step_000003")
    hook.on_train_end(None, {})
    hook.on_summary()
    fresh = tmp_path / "fresh"
    found = restore_from(open_remote(url), fresh)
    assert found is not None and found[1]["step"] == 3
    for name in ("plan_status.jsonl", "report.html", "summary.json"):
        assert (fresh / name).read_text() == (run_dir / name).read_text(), name


def test_the_stores_config_follows_the_run_directorys(tmp_path):
    """run/config.yaml went up only while the store lacked it: a resume that rewrote config.yaml
    (train.max_steps 4 -> 6) left the store with the first session's, and a damaged copy was never
    repaired (`trimtab export URL` refused the run). It goes up after each checkpoint, as the record."""
    url = f"memory://trimtab-test-{uuid.uuid4().hex[:8]}/ckpt"
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("train: {max_steps: 4}\n")
    hook = RemoteCheckpoints(url, run_dir, keep=3)
    remote = open_remote(url)
    for step, text in ((3, "train: {max_steps: 4}\n"), (6, "train: {max_steps: 6}\n")):
        (run_dir / "config.yaml").write_text(text)
        checkpoint = run_dir / "checkpoints" / f"step_{step:06d}"
        checkpoint.mkdir()
        (checkpoint / MANIFEST).write_text(f'{{"step": {step}, "manifest": {{}}}}')
        hook.on_checkpoint(None, checkpoint)
        hook.wait()
        assert remote.fs.cat_file(f"{remote.root}/run/config.yaml").decode() == text


def test_a_put_killed_half_way_leaves_a_file_store_with_the_whole_old_file(tmp_path, monkeypatch):
    """A file:// store's put is a copy: a process killed in it (a preempted machine) left run/goodput.json
    or metrics.jsonl cut in half where a whole one stood, and a fresh machine restored it so."""
    remote = open_remote(f"file://{tmp_path}/store")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "goodput.json").write_text('{"sessions": ["first"]}')
    remote.put_run_files(run_dir, ("goodput.json",))
    (run_dir / "goodput.json").write_text('{"sessions": ["first", "second"]}')

    def killed(source, target, **kwargs):  # the copy's first half written, then the process gone
        with open(source, "rb") as src, open(target, "wb") as dst:
            dst.write(src.read()[:10])
        raise KeyboardInterrupt

    monkeypatch.setattr(remote.fs, "put_file", killed)
    with pytest.raises(KeyboardInterrupt):
        remote.put_run_files(run_dir, ("goodput.json",))
    assert (tmp_path / "store" / "run" / "goodput.json").read_text() == '{"sessions": ["first"]}'


def _checkpoints(run_dir, steps):
    for step in steps:
        checkpoint = run_dir / "checkpoints" / f"step_{step:06d}"
        checkpoint.mkdir(parents=True)
        (checkpoint / MANIFEST).write_text(f'{{"step": {step}, "train": {{"step": {step}}}, "manifest": {{}}}}')


def _metrics(run_dir, last):
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 4.0}}\n' for s in range(1, last + 1)))


def test_a_disk_left_behind_resumes_from_the_stores_newer_checkpoint_not_its_own(tmp_path):
    """A run moved to machine B (restored step 4 from the store, trained to 8, uploaded), then back
    to machine A with its old disk at step 4: A resumed from its own step 4, redid 4 -> 8 unsaid, and
    its first upload's retention deleted the store's step 8 as a rolled-back trajectory. The store's
    newer checkpoint of a step A never trained to is restored, with B's record; one of a step A
    trained past (a rollback's abandoned trajectory, a copy found corrupt here) is not."""
    url = f"memory://trimtab-test-{uuid.uuid4().hex[:8]}/ckpt"
    machine_b = tmp_path / "b"
    _checkpoints(machine_b, (4, 6, 8))
    _metrics(machine_b, 8)
    hook = RemoteCheckpoints(url, machine_b, keep=3)
    for step in (4, 6, 8):
        hook.on_checkpoint(None, machine_b / "checkpoints" / f"step_{step:06d}")
        hook.wait()
    remote = open_remote(url)
    machine_a = tmp_path / "a"
    _checkpoints(machine_a, (2, 4))
    _metrics(machine_a, 5)  # it trained on to step 5 before it was stopped
    (machine_a / "config.yaml").write_text("preset: debug\n")
    cfg = load_config(preset="debug", overrides={"out": str(machine_a)})
    here = SimpleNamespace(from_main=lambda f, *a: f(*a), on_main=lambda f, *a: f(*a))  # one process
    found = resume_point(cfg, here, remote)
    assert found[0] == machine_a / "checkpoints" / "step_000008" and found[1]["step"] == 8
    assert (machine_a / "metrics.jsonl").read_text() == (machine_b / "metrics.jsonl").read_text()  # B's record
    rolled_back, corrupt_here = tmp_path / "rolled_back", tmp_path / "corrupt_here"
    _checkpoints(rolled_back, (4,))
    _metrics(rolled_back, 5)
    (rolled_back / "checkpoints" / "rolled_back" / "step_000008").mkdir(parents=True)  # set aside by a rollback
    _checkpoints(corrupt_here, (4,))
    _metrics(corrupt_here, 9)  # trained past 8: the store's 8 is a trajectory this directory left
    for run_dir in (rolled_back, corrupt_here):
        mine = (run_dir / "checkpoints" / "step_000004", {"step": 4})
        assert newer_in_store(remote, run_dir, mine) == mine, run_dir.name
