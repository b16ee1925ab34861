"""A process killed while a rollback loads its target (seconds to minutes for a large model) resumed
from the newest checkpoint, the trajectory the rollback abandoned: its checkpoints were retired
only after the load. They are retired first now, so a resume starts from the rollback's target."""

from types import SimpleNamespace

import pytest
import torch

from trimtab.checkpoint import list_checkpoints, save_checkpoint
from trimtab.training import checkpointing
from trimtab.training.checkpointing import Checkpointing


class Killed(BaseException):
    """SIGKILL has no handler: the load simply never returns, and nothing after it runs."""


def test_a_kill_in_a_rollbacks_load_leaves_its_target_as_the_resume_point(tmp_path, monkeypatch):
    for step in (2, 4, 6):
        save_checkpoint(
            tmp_path, step, {"w": torch.full((2,), float(step))}, {}, {"tokens": step, "good": True}, keep=9
        )

    def load(path, before):
        raise Killed

    monkeypatch.setattr(checkpointing, "RestorePoint", lambda trainer: None)  # the host copy: no model here

    def now(fn, *args):  # one process: rank 0 is this one
        return fn(*args)

    trainer = SimpleNamespace(
        watchdog=SimpleNamespace(beat=lambda section: None),
        finish_save=lambda: None,
        dist=SimpleNamespace(from_main=now, on_main=now),
        cfg=SimpleNamespace(run_dir=tmp_path, checkpoint=SimpleNamespace(keep=3)),
        replicas=None,
        state=SimpleNamespace(step=7),
        model=SimpleNamespace(moe_layers=lambda: []),  # its MoE layers' expert counts, said if the load changes them
        _load_whole=load,
    )
    trainer._rollback_target = lambda to: Checkpointing._rollback_target(trainer, to)
    with pytest.raises(Killed):
        Checkpointing.rollback(trainer, to=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002"]
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "rolled_back").iterdir()) == [
        "step_000004",
        "step_000006",
    ]
