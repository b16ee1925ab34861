"""A real full disk, not the injected fault: `trimtab train` on a small tmpfs, through the CLI.

On a full file system the writers fail in their own ways (safetensors' SafetensorError, torch.save's
RuntimeError "unexpected pos", Python's OSError for the small files); every one of them must reach
the orchestrator's `disk` rule: free older checkpoints and retry, or stop with exit code 4 and a
resume point on disk, never a traceback. A debug checkpoint is ~2.2 MB at step 0 (no optimizer
moments yet) and ~6.6 MB after (weights + AdamW's two moments).
"""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from helpers import trimtab_cli
from trimtab.checkpoint import latest_valid, list_checkpoints
from trimtab.rundir import read_decisions

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="mounts a tmpfs (Linux)")


@pytest.fixture
def small_fs(tmp_path):
    """`small_fs(mb)`: a tmpfs of that size (re-sizable with `.resize(mb)`); skips where this
    process may not mount one (not root)."""
    mounted: list[Path] = []

    class FS:
        def __call__(self, mb: int) -> Path:
            where = tmp_path / "fs"
            where.mkdir()
            mount = ["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(where)]
            done = subprocess.run(mount, capture_output=True)
            if done.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
            mounted.append(where)
            return where

        def resize(self, mb: int) -> None:
            subprocess.run(["mount", "-o", f"remount,size={mb}m", str(mounted[0])], check=True)

    yield FS()
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def train(out: Path, steps: int, *sets: str) -> subprocess.CompletedProcess:
    """`trimtab train` to its end, forked by the tests' fork server (tests/forkserver.py: the same
    trimtab.cli.main in a fresh process, without the 3-4 s of imports)."""
    args = ["train", "--preset", "debug", "--out", str(out), "--max-steps", str(steps)]
    for s in ("checkpoint.every=10", "train.eval_every=0", "log.progress=false", "log.tensorboard=false", *sets):
        args += ["--set", s]
    return trimtab_cli(args, out.parent, {**os.environ, "OMP_NUM_THREADS": "1"})


def leftovers(run: Path) -> list[str]:
    """Temp files and half-written checkpoints: a failed write must leave none."""
    return [p.name for p in run.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_full_disk_frees_older_checkpoints_and_trains_to_the_end(small_fs, asynchronous):
    # 18 MB: step 0 + two full checkpoints fit, a third does not, so every save from step 15
    # on fails for real, and deleting the older ones makes room for the retry. Written in the
    # background, the failure is met at the next save (or the last): handled the same way.
    # Checkpoints every 5 steps: the same saves and failures as every 10 over 40 steps, in half the steps.
    run = small_fs(18) / "r"
    sets = ("checkpoint.every=5", "checkpoint.keep=3", "log.report=false", f"checkpoint.asynchronous={asynchronous}")
    done = train(run, 20, *sets)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    disk = [d for d in read_decisions(run, abandoned=True) if d["rule"] == "disk"]
    assert disk and all(d["evidence"]["errno"] == 28 for d in disk)  # ENOSPC, whoever raised it
    assert all(not str(a).startswith("failed") for d in disk for a in d["applied"])
    assert latest_valid(run)[0].name == "step_000020"
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 0
    assert not leftovers(run)


def test_a_disk_too_small_for_any_new_checkpoint_stops_with_exit_4_and_resumes_once_freed(small_fs):
    fs = small_fs(5)  # step 0 fits, nothing after it
    run = fs / "r"
    done = train(run, 10, "checkpoint.every=5")  # stopped at its first save (5), resumed from 0: two saves
    assert done.returncode == 4, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "free space" in done.stderr and "resume from step 0" in done.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit_code"] == 4
    assert [p.name for p in list_checkpoints(run)] == ["step_000000"] and latest_valid(run) is not None
    assert [d["action"] for d in read_decisions(run, abandoned=True) if d["rule"] == "disk"][-1] == "stop"
    assert not leftovers(run)
    # the 10 steps since step 0 were lost though their weights fit (~1.1 MB in bf16): now kept, and said so
    kept = run / "snapshots" / "step_000010"
    assert (kept / "model.safetensors").is_file()
    assert f"kept in {kept}" in summary["status"] and f"train.init_from={kept}" in done.stderr
    assert "weights alone (bf16: fp32 did not fit in the " in summary["status"]  # 2.8 MB left: 2.2 MB + margin not

    # re-run with less room than a second copy of step 10's weights: it stops at step 10 again, and those weights
    # are still on disk from the first stop (the space the new copy needed): kept, said so, never "lost"
    (fs / "filler").write_bytes(b"\0" * (1 << 20))
    twice = train(run, 10, "checkpoint.every=5")
    assert twice.returncode == 4, twice.stderr[-3000:]
    status = json.loads((run / "summary.json").read_text())["status"]
    assert f"this step's are in {kept} already, from an earlier stop" in status and "lost" not in status
    assert f"train.init_from={kept}" in status and (kept / "model.safetensors").is_file()
    (fs / "filler").unlink()

    small_fs.resize(40)  # a person frees space; the same command resumes and finishes
    again = train(run, 10, "checkpoint.every=5")
    assert again.returncode == 0, again.stderr[-3000:]
    # from the checkpoint (weights, optimizer, data position), never from the weights-only snapshot
    assert f"resuming from {run / 'checkpoints' / 'step_000000'} (step 0" in again.stderr
    assert latest_valid(run)[0].name == "step_000010"


def test_metrics_lines_a_full_disk_cut_short_are_written_once_each_when_space_returns(small_fs):
    # tmpfs allocates whole pages. Lines of 3 KB on a full disk: an append fails part-way; after
    # one page is freed the held line fits and the next does not, so the failed append left a
    # whole line on disk that is still waiting to be written: it must not be written twice.
    from trimtab.training.hooks import JsonlLogger

    fs = small_fs(1)
    logger = JsonlLogger(fs)
    line = {"loss": 1.0, "note": "x" * 3000}
    (fs / "page").write_bytes(b"x" * 4096)
    with pytest.raises(OSError), open(fs / "filler", "wb", buffering=0) as fh:
        while True:
            fh.write(b"x" * 4096)
    step = 1
    while not logger.unwritten:  # until an append no longer fits
        logger._write({"step": step, **line})
        step += 1
    (fs / "page").unlink()  # a page comes free: the held line fits, the next one does not
    logger._write({"step": step, **line})
    assert len(logger.unwritten) == 2
    (fs / "filler").unlink()
    logger._write({"step": step + 1, **line})
    steps = [json.loads(text)["step"] for text in (fs / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, step + 2)) and not logger.unwritten


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(small_fs, tmp_path, capsys):
    """Outside training (whose disk rule frees checkpoints) a full disk was a safetensors
    traceback; `trimtab export` (merge, data prepare alike) now says it in one line, exit 2,
    and its staging directory is gone. A debug model's weights are ~2.2 MB: 1 MB cannot hold them."""
    from trimtab.cli import main

    run = tmp_path / "r"
    done = train(run, 1, "log.report=false")
    assert done.returncode == 0, done.stderr[-3000:]
    disk = small_fs(1)
    assert main(["export", str(run), "--out", str(disk / "hf")]) == 2
    err = capsys.readouterr().err
    assert "trimtab: error: the disk is full" in err and "No space left on device" in err and "Traceback" not in err
    assert list(disk.iterdir()) == []  # no half-written export, no staging directory


def test_tensorboard_on_a_full_disk_misses_steps_and_writes_again_when_space_returns(
    small_fs, caplog, capfd, monkeypatch
):
    # TensorBoard's writer thread dies at its first failed write and raises it at every later
    # call: on rank 0 of a DDP run whose failed sharded save held the disk full, the next
    # add_scalar ended the run (exit 2) before the disk rule could free anything. The thread's
    # own traceback is not printed either (as a run has it: the trackers set up by api.built_in_hooks).
    from trimtab.config.log import LogConfig
    from trimtab.training.hooks import TensorBoardLogger
    from trimtab.training.services.tracking import tracking_hooks

    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # Python's, not pytest's
    tracking_hooks(LogConfig(tensorboard=True), Path("unused"))
    fs = small_fs(1)
    logger = TensorBoardLogger(fs / "tb")
    logger._open(1)
    with pytest.raises(OSError), open(fs / "filler", "wb", buffering=0) as fh:
        while True:
            fh.write(b"x" * 4096)
    wide = {f"metric_{i}": float(i) for i in range(200)}  # more than the writer's buffer per step
    for step in range(1, 40):
        logger._scalars("train", {"step": step, **wide})
    assert logger.failed and sum("its curves miss the steps" in r.message for r in caplog.records) == 1
    (fs / "filler").unlink()
    logger.retry_at = 0.0  # a minute later
    logger._scalars("train", {"step": 40, **wide})
    logger.on_train_end(None, {})
    assert not logger.failed
    assert len(list((fs / "tb").glob("events.*"))) == 2  # one new events file after the outage, not one per log
    assert "Traceback" not in capfd.readouterr().err  # the writer thread's death is the one warning, not a trace


def test_the_full_disks_weights_are_kept_in_fp32_where_they_fit_else_bf16_and_said(small_fs):
    """The disk rule's stop kept the weights in bf16 even with room for fp32: a run trained on from them
    (train.init_from) lost the trained weights' precision. On a real full tmpfs: fp32 when it fits, else bf16
    and the stop reason says why."""
    from safetensors.torch import load_file

    from trimtab.snapshots import save_last_weights

    fs = small_fs(4)
    (fs / "r").mkdir()
    weights = {"w": torch.randn(256, 1024) / 3, "steps": torch.arange(4)}  # 1 MiB in fp32
    path, said = save_last_weights(fs / "r", 7, weights, {"tokens": 1}, keep=2, keep_every=0)
    kept = load_file(str(path / "model.safetensors"))
    assert said == "fp32" and kept["w"].dtype == torch.float32 and torch.equal(kept["w"], weights["w"])
    assert json.loads((path / "state.json").read_text())["snapshot"] == "fp32"

    # 1.5 MiB left beside the fp32 one: bf16 (0.5 MiB) fits, fp32 and its margin do not
    (fs / "filler").write_bytes(b"\0" * (3 << 19))
    path, said = save_last_weights(fs / "r", 8, weights, {"tokens": 2}, keep=2, keep_every=0)
    kept = load_file(str(path / "model.safetensors"))
    assert kept["w"].dtype == torch.bfloat16 and torch.equal(kept["steps"], weights["steps"])
    assert said.startswith("bf16: fp32 did not fit in the ") and "MiB left" in said
    assert json.loads((path / "state.json").read_text())["snapshot"] == "bf16"


def test_the_full_disks_weights_replace_older_snapshots_never_the_newest(small_fs):
    """With no room for the stop's weights, the older lean snapshots but the newest make room for them: newer
    weights in place of older ones. The newest stays until the new one is whole; keep_every's stay too."""
    from trimtab.snapshots import list_snapshots, newest_weights, save_last_weights, save_snapshot

    fs = small_fs(3)
    run, snapshots = fs / "r", fs / "r" / "snapshots"
    run.mkdir()
    weights = {"w": torch.randn(256, 1024) / 3}  # 0.5 MiB in bf16
    for step in (3, 10, 20):
        save_snapshot(run, step, weights, {"tokens": step}, keep=5, keep_every=3)
    (fs / "filler").write_bytes(b"\0" * (5 << 18))  # ~0.25 MiB left: no bf16 copy fits
    path, said = save_last_weights(run, 30, weights, {"tokens": 30}, keep=5, keep_every=3)
    assert path == snapshots / "step_000030" and said.startswith("bf16")
    assert [p.name for p in list_snapshots(run)] == ["step_000003", "step_000020", "step_000030"]  # 10 made room
    with pytest.raises(OSError):  # 1 MiB in bf16: step 20 freed, not enough; 30 (the newest) and 3 (keep_every) stay
        save_last_weights(run, 40, {"w": torch.randn(512, 1024)}, {"tokens": 40}, keep=5, keep_every=3)
    assert [p.name for p in list_snapshots(run)] == ["step_000003", "step_000030"]
    assert newest_weights(run, 40) == snapshots / "step_000030"


def test_the_full_disks_bf16_weights_are_kept_in_bf16_not_upcast(small_fs):
    """Weights already in bf16 were upcast to fp32 by the disk rule's stop: twice the bytes (and the space a
    full disk has not) for no precision. Kept as they are, the fp32 ones beside them in fp32, and said so."""
    from safetensors.torch import load_file

    from trimtab.snapshots import save_last_weights

    fs = small_fs(4)
    (fs / "r").mkdir()
    weights = {"w": (torch.randn(256, 1024) / 3).bfloat16(), "norm": torch.ones(1024), "steps": torch.arange(4)}
    # 1.75 MiB left: the bf16 weights (0.5 MiB) and the 1 MiB margin fit; upcast to fp32 (1 MiB) they would not
    (fs / "filler").write_bytes(b"\0" * (9 << 18))
    path, said = save_last_weights(fs / "r", 7, weights, {"tokens": 1}, keep=2, keep_every=0)
    kept = load_file(str(path / "model.safetensors"))
    assert kept["w"].dtype == torch.bfloat16 and torch.equal(kept["w"], weights["w"])
    assert kept["norm"].dtype == torch.float32 and torch.equal(kept["steps"], weights["steps"])
    assert (path / "model.safetensors").stat().st_size < (1 << 20)  # fp32 "w" alone is 1 MiB
    assert said == "fp32+bf16: the weights' own, none upcast to fp32"
    assert json.loads((path / "state.json").read_text())["snapshot"] == "fp32+bf16"


def test_a_run_started_on_a_full_disk_names_its_out(tmp_path, monkeypatch, capsys):
    """A finetuning run started with --out on a full tmpfs stopped with "the disk is full ([Errno 28] No space
    left on device)" and no path: the run lock's write() names no file. The CLI names --out now."""
    import errno
    import os

    import trimtab.runlock
    from trimtab.cli import main

    def full(fd, record):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as os.pwrite raises it: no filename

    monkeypatch.setattr(trimtab.runlock, "_write_lock", full)
    out = tmp_path / "r"
    assert main(["train", "--preset", "debug", "--out", str(out), "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"trimtab: error: the disk is full under {out} ([Errno 28] No space left on device)" in err
