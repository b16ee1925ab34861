"""A run lost mid-way and restored from its checkpoint.dir on a fresh machine: the steps its lost
session trained past the store's newest checkpoint are unknown, and its restart incident says a
lower bound, not an exact 0 (training/services/storage.py AT_CHECKPOINT, docs/resilience.md)."""

import shutil
import subprocess
import sys

import pytest

import trimtab
from trimtab.config import load_config, merge
from trimtab.rundir import STEP_FILE, read_jsonl
from trimtab.training.services.storage import _copy_records

KILLED = """
import os, signal, threading, trimtab
from trimtab.config import load_config, merge
from trimtab.training.hooks import Hook

class Kill(Hook):  # the machine lost after step 5, once step 4's upload is whole
    def on_step_end(self, run, out):
        if run.step == 5:
            for t in threading.enumerate():
                if t.name.startswith("upload-"):
                    t.join()
            os.kill(os.getpid(), signal.SIGKILL)

cfg = load_config(preset="debug", overrides=merge(%r, {}))
trimtab.train(cfg, hooks=[Kill()])
"""


def debug_cfg(out, store, steps):
    return {
        "out": str(out),
        "train": {"max_steps": steps, "eval_every": 0, "log_every": 1, "precision": "fp32"},
        "data": {"max_bytes": 150_000},
        "checkpoint": {"every": 2, "dir": store},
        "log": {"progress": False, "tensorboard": False, "report": False},
    }


def test_the_step_mark_is_not_uploaded_with_a_checkpoint(tmp_path):
    """Copied at a checkpoint's commit, goodput.step names that checkpoint's step, not where the
    session ended; it goes up at the run's end only, its session closed."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "goodput.json", STEP_FILE, "config.yaml"):
        (run / name).write_text("x\n")
    copied = _copy_records(run, tmp_path / "records")
    assert sorted(p.name for p in copied.iterdir()) == ["config.yaml", "goodput.json", "metrics.jsonl"]


@pytest.mark.slow
def test_a_session_lost_after_the_stores_newest_checkpoint_is_no_exact_zero_steps_lost(tmp_path):
    """debug, checkpoint.every 2, kill -9 after step 10, resumed on a fresh out dir from the store's
    step 8: "restart: the process ended without a word ... at step 8; resumed at step 8 ... (0 steps
    lost)", step_exact true, where 2 steps were lost. Here killed after step 5, store at step 4."""
    store, out = f"file://{tmp_path}/store", tmp_path / "run"
    code = KILLED % debug_cfg(out, store, 8)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    shutil.rmtree(out)  # the machine lost: only the store remains
    summary = trimtab.train(load_config(preset="debug", overrides=merge(debug_cfg(out, store, 8), {})))
    assert summary["status"] == "completed"
    restart = [d for d in read_jsonl(out / "decisions.jsonl") if d["rule"] == "restart"]
    assert len(restart) == 1 and restart[0]["evidence"]["resumed_step"] == 4
    assert restart[0]["evidence"]["step_exact"] is False
