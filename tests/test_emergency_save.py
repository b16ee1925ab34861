"""A DDP survivor's emergency save (training/emergency.py): a peer lost inside a step's collectives
leaves rank 0 with the last completed step's weights and optimizer, which it saves alone.

In one process: the lost peer is a collective raising gloo's error (what rank 0 saw when torchrun's
`--inject kill_rank@7:1` killed rank 1: docs/resilience.md), and the save is allowed as under DDP."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from trimtab.api import built_in_hooks
from trimtab.config import load_config
from trimtab.training.emergency import peer_lost
from trimtab.training.setup import setup
from trimtab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

GLOO = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:13971. This is typically caused by"
SETS = [
    "train.max_steps=3",
    "train.eval_every=0",
    "train.log_every=100",
    "log.progress=false",
    "log.tensorboard=false",
    "data.max_bytes=100000",
    "model.n_layers=1",
    "train.precision=fp32",
]


def trainer(out, every: int) -> Trainer:
    cfg = load_config(preset="debug", overrides={"out": str(out)}, sets=[*SETS, f"checkpoint.every={every}"])
    return Trainer(setup(cfg), hooks=built_in_hooks(cfg))


def lose_peer_in(t: Trainer, step: int, monkeypatch) -> None:
    """The step's gradient all-reduce fails as rank 1 dies in step `step`; DDP's conditions hold."""
    reduce = t.dist.reduce_step

    def reduce_step(*args, **kwargs):
        if t.state.step + 1 == step:
            raise RuntimeError(GLOO)
        return reduce(*args, **kwargs)

    monkeypatch.setattr(t.dist, "reduce_step", reduce_step)
    monkeypatch.setattr(t, "emergency_save_possible", lambda: None, raising=False)  # old code: none


def test_a_peer_lost_mid_step_leaves_the_last_completed_step_saved_as_a_normal_save_would(tmp_path, monkeypatch, capfd):
    """Checkpoints every 3 steps, rank 1 lost in step 3: step 2 is saved (it was lost before), its weights,
    optimizer, data position and RNG bit for bit those of an undisturbed run's save of step 2, and the
    restart resumes from it, saying so, and ends as the undisturbed run."""
    plain = trainer(tmp_path / "plain", every=1)
    plain.fit()
    hit = trainer(tmp_path / "hit", every=3)
    lose_peer_in(hit, 3, monkeypatch)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    saved = sorted(p.name for p in (tmp_path / "hit" / "checkpoints").glob("step_*"))
    assert saved == ["step_000000", "step_000002"]  # before: step 0 only
    ours, theirs = tmp_path / "hit/checkpoints/step_000002", tmp_path / "plain/checkpoints/step_000002"
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = (torch.load(p / "optim.pt", weights_only=False) for p in (ours, theirs))
    moments = [
        (oa["optimizer"]["state"][i][m], ob["optimizer"]["state"][i][m])
        for i in ob["optimizer"]["state"]
        for m in ("exp_avg", "exp_avg_sq", "step")
    ]
    assert len(moments) > 3 and all(torch.equal(x, y) for x, y in moments)
    assert torch.equal(oa["rng"]["torch"], ob["rng"]["torch"])
    sa, sb = (json.loads((p / "state.json").read_text()) for p in (ours, theirs))
    assert sa["data"] == sb["data"] and sa["row_gate"] == sb["row_gate"]
    assert {k: v for k, v in sa["train"].items() if k != "train_seconds"} == {
        k: v for k, v in sb["train"].items() if k != "train_seconds"
    }
    assert sa["emergency"] == {"rank": 0, "error": "RuntimeError: Connection closed by peer"} and sa["good"] is False

    capfd.readouterr()
    again = trainer(tmp_path / "hit", every=3)
    assert again.state.step == 2 and "resuming from step 2, an emergency save" in capfd.readouterr().err
    again.fit()
    end, base = again.model.state_dict(), plain.model.state_dict()
    assert all(torch.equal(end[k], base[k]) for k in base)


def test_no_emergency_save_once_the_update_began_nor_where_a_lost_rank_held_shards(tmp_path, monkeypatch):
    """A failure after the optimizer step began (the weights are no completed step's) saves nothing,
    and a sharded or one-process run says why it cannot."""
    hit = trainer(tmp_path / "late", every=3)
    monkeypatch.setattr(hit, "emergency_save_possible", lambda: None)
    update = hit._update

    def failing_update(skip):
        update(skip)
        if hit.state.step + 1 == 3:
            raise RuntimeError(GLOO)  # (in truth no collective runs here: the window is what is tested)

    monkeypatch.setattr(hit, "_update", failing_update)
    with pytest.raises(RuntimeError):
        hit.fit()
    assert not (tmp_path / "late/checkpoints/step_000002").exists()
    assert "no peer" in Trainer.emergency_save_possible(hit)
    monkeypatch.setattr(type(hit.dist), "sharded", property(lambda self: True))
    monkeypatch.setattr(hit.dist, "world", 2)
    assert "shards" in Trainer.emergency_save_possible(hit)
    assert (
        peer_lost(RuntimeError(GLOO))
        and not peer_lost(RuntimeError("shape mismatch"))
        and not peer_lost(ValueError("Connection closed by peer"))
    )
