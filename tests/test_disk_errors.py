"""The disk rule's remedy reads the save's errno: only a full disk (or quota) is met by deleting
older checkpoints, and the stop's message names the fix for the error it met. A checkpoint folder
made read-only (`chattr +i`, debug, 60 steps: EPERM at step 20) had older checkpoints deleted "to
free space" and the run stopped telling the user to "free space"."""

import errno
from pathlib import Path
from types import SimpleNamespace

import pytest

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator import remedies
from trimtab.orchestrator.monitors import Finding


def _failed_save(code: int, failures: int) -> Finding:
    evidence = {"error": f"[Errno {code}] ...", "errno": code, "failures": failures, "last_saved": 10}
    return Finding(
        rule="disk", family="disk", step=30, evidence=evidence, summary="checkpoint save failed", strength=1.0
    )


@pytest.mark.parametrize(
    ("code", "keep", "fix"),
    [
        (errno.ENOSPC, {"keep": 1}, "free space in /r and"),
        (errno.EDQUOT, {"keep": 1}, "free space in /r and"),
        (errno.EPERM, {}, "make /r/checkpoints writable"),
        (errno.EACCES, {}, "make /r/checkpoints writable"),
        (errno.EROFS, {}, "make /r/checkpoints writable"),
        (errno.EIO, {}, "check the storage under /r and"),
    ],
)
def test_only_a_full_disk_deletes_checkpoints_and_the_stop_names_the_errors_fix(code, keep, fix):
    view, cfg = SimpleNamespace(run_dir=Path("/r")), OrchestratorConfig()
    retry = remedies.disk(_failed_save(code, 1), view, cfg)
    assert retry.action == "save_checkpoint" and retry.params == keep
    stop = remedies.disk(_failed_save(code, 2), view, cfg)
    assert stop.action == "stop" and fix in stop.params["reason"]
    assert ("free space" in stop.params["reason"]) == bool(keep)


def test_saves_failing_for_less_than_an_interval_are_noted_and_retried_not_stopped():
    """The trainer tries a failed save again at the next steps (checkpointing.py _owe_save): each
    failure within a checkpoint interval of the first is a note; a whole interval of them stops."""
    view, cfg = SimpleNamespace(run_dir=Path("/r")), OrchestratorConfig()
    f = _failed_save(errno.ENOSPC, 3)
    f.evidence |= {"failing_since": 25, "every": 20}
    assert remedies.disk(f, view, cfg).action == "none"
    f.evidence["failing_since"] = 10
    assert remedies.disk(f, view, cfg).action == "stop"


def test_a_save_owed_when_a_rollback_comes_is_the_abandoned_trajectorys(tmp_path, capsys, monkeypatch):
    """The retry of a failed save (checkpointing.py _owe_save) outlived a rollback: the replay's first failed
    save waited twice the abandoned one's last wait (step 8: tried again at 10, not 9). Cleared by the rollback,
    the replay's retries are as a first failure's: 9, 11."""
    import trimtab
    from trimtab.config import load_config

    monkeypatch.setattr("trimtab.training.setup.peak_flops", lambda precision: (None, "not measured in tests"))
    train = {"max_steps": 10, "eval_every": 0, "batch_tokens": 1024, "eval_tokens": 1024, "precision": "fp32"}
    overrides = {
        "out": str(tmp_path / "r"),
        "train": train,
        "data": {"max_bytes": 150_000},
        "checkpoint": {"every": 8},
        "log": {"progress": False, "tensorboard": False},
        "faults": ["disk_full@8:6", "weights_nan@10"],
        "orchestrator": {"throughput": {"enabled": False}, "checkpoint_interval": {"rollbacks": False}},
    }
    assert trimtab.train(load_config(preset="debug", overrides=overrides))["status"] == "completed"
    err = capsys.readouterr().err
    assert "rolled back from step 10 to step 0" in err
    assert err.count("step 8: no checkpoint since step 0; the save is tried again at step 9") == 2
