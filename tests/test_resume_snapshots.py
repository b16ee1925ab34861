"""Lean snapshots around a kill and broken weights: what a SIGKILL in a snapshot's write leaves is
cleaned up (or put back, when it is a step's only copy), and weights that are not finite are never
written as a snapshot (the retention would make room for them by deleting the good ones)."""

import os
from types import SimpleNamespace

import torch
from torch import nn

from trimtab.snapshots import list_snapshots, save_snapshot, snapshot_root
from trimtab.training.checkpointing import Checkpointing


def weights(value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 4), value)}


def test_a_killed_snapshot_write_leaves_no_copy_behind_and_an_only_copy_is_put_back(tmp_path):
    for step in (1, 2):
        save_snapshot(tmp_path, step, weights(), {"tokens": step}, keep=3, keep_every=0)
    root = snapshot_root(tmp_path)
    leaked = root / ".tmp_step_000003_999999"  # a writer SIGKILLed before its rename
    leaked.mkdir()
    (leaked / "model.safetensors").write_bytes(os.urandom(4096))
    # killed between _replace_dir's two renames: step 2's only copy is the aside one
    os.replace(root / "step_000002", root / ".tmp_step_000002_replaced_999999")
    save_snapshot(tmp_path, 4, weights(), {"tokens": 4}, keep=3, keep_every=0)
    assert [p.name for p in list_snapshots(tmp_path)] == ["step_000001", "step_000002", "step_000004"]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp")) == []


class Tiny(nn.Linear):
    def moe_state(self):
        return {}

    def mod_state(self):
        return {}


def snapshotting(tmp_path, model, said):
    run = SimpleNamespace(
        cfg=SimpleNamespace(run_dir=tmp_path, checkpoint=SimpleNamespace(snapshot_keep=1, snapshot_keep_every=0)),
        state=SimpleNamespace(step=1, tokens=10),
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        dist=SimpleNamespace(
            all_finite=lambda params: all(bool(torch.isfinite(p).all()) for p in params),
            on_main=lambda fn, *args: fn(*args),
        ),
        say=said.append,
    )
    run._not_finite = lambda: Checkpointing._not_finite(run)
    return run


def test_weights_that_are_not_finite_are_not_snapshotted_and_the_good_ones_stay(tmp_path):
    said = []
    model = Tiny(4, 4)
    run = snapshotting(tmp_path, model, said)
    Checkpointing.snapshot(run)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    run.state.step = 2
    Checkpointing.snapshot(run)
    assert [p.name for p in list_snapshots(tmp_path)] == ["step_000001"]  # keep=1: step 1 is not pushed out
    assert said == ["step 2: the weights are not finite: no lean snapshot written"]


def test_a_nan_buffer_is_not_snapshotted_and_weights_finite_reads_it_as_a_save_does(tmp_path):
    """snapshot() checked the parameters alone (a NaN MoE expert_bias was written into the snapshot, which
    holds the buffers), and RunView.weights_finite the parameters and moments without the buffers, where
    a save refused all three: one list now (optim.state_tensors)."""
    from trimtab.training.view import RunView

    said = []
    model = Tiny(4, 4)
    model.register_buffer("expert_bias", torch.zeros(4))
    run = snapshotting(tmp_path, model, said)
    view = SimpleNamespace(_t=run)
    assert RunView.weights_finite(view)
    model.expert_bias[1] = float("nan")
    assert not RunView.weights_finite(view)
    Checkpointing.snapshot(run)
    assert list_snapshots(tmp_path) == [] and said == ["step 1: the buffers are not finite: no lean snapshot written"]


def test_a_checkpoint_with_a_nan_moment_or_buffer_is_not_written_and_says_which(tmp_path):
    """save() checked the parameters alone: a NaN in an Adam moment (or a buffer: MoE expert_bias) was
    checkpointed, and a resume's next update spread it to the weights. Each part is named in the refusal."""
    said, written = [], []
    model = Tiny(4, 4)
    model.register_buffer("expert_bias", torch.zeros(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    run = SimpleNamespace(
        cfg=SimpleNamespace(run_dir=tmp_path, checkpoint=SimpleNamespace(asynchronous=False, keep=2)),
        state=SimpleNamespace(step=5),
        model=model,
        optimizer=optimizer,
        scaler=None,
        best_eval=None,
        last_saved=0,
        last_good=0,
        _restored=False,
        dist=SimpleNamespace(
            all_finite=lambda ts: all(bool(torch.isfinite(t).all()) for t in ts),
            save=lambda *args, **kwargs: written.append(args[1]) or tmp_path,
        ),
        watchdog=SimpleNamespace(beat=lambda what: None),
        finish_save=lambda: None,
        _good=lambda: True,
        _call=lambda *args: None,
        _gate_tables=dict,
        _checkpoint_state=lambda good: {},
        _protected=tuple,
        say=said.append,
    )
    run._not_finite = lambda: Checkpointing._not_finite(run)
    optimizer.state[model.weight]["exp_avg_sq"][0, 0] = float("nan")
    assert Checkpointing.save(run) is False and written == []
    model.expert_bias[1] = float("inf")
    assert Checkpointing.save(run) is False and written == []
    assert said == [
        "step 5: the optimizer's moments are not finite: no checkpoint written (the resume point stays step 0)",
        "step 5: the buffers are not finite, nor the optimizer's moments: no checkpoint written (the resume point "
        "stays step 0)",
    ]
