"""A peer lost in the gain probe after the update (training/trainer.py _update_gain): the LR rule measures
each update's gain over a phase's first `orchestrator.above_start.gain_steps` steps with a scoring forward
that ends in an all-reduce, after the optimizer step. torchrun, 2 ranks, `kill -9` of rank 1 in step 15:
rank 0's all-reduce failed there and it refused the emergency save ("the optimizer's update had begun"),
so the restart went back to step 10. The update is whole by then: the step is saved as a completed one.

In one process, as tests/test_emergency_save.py: the lost peer is the probe's collective raising gloo's error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from test_emergency_save import GLOO, trainer
from trimtab.training.gain import GainProbe
from trimtab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_peer_lost_in_the_gain_probe_after_the_update_saves_that_step(tmp_path, monkeypatch, capfd):
    plain = trainer(tmp_path / "plain", every=1)
    plain.fit()
    hit = trainer(tmp_path / "hit", every=3)
    monkeypatch.setattr(hit, "emergency_save_possible", lambda: None)  # as under DDP
    measure, probed = GainProbe.after, []

    def after(probe, *args, **kwargs):
        probed.append(hit.state.step + 1)
        if hit.state.step + 1 == 2:  # step 2's update applied, its gain's all-reduce fails
            raise RuntimeError(GLOO)
        return measure(probe, *args, **kwargs)

    monkeypatch.setattr(GainProbe, "after", after)
    capfd.readouterr()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    assert probed == [1, 2]  # the probe ran in step 2: the loss came in it
    said = [line for line in capfd.readouterr().err.splitlines() if "peer was lost" in line]
    assert len(said) == 1 and "rank 0 saved step 2 alone" in said[0]  # before: "no emergency save (the optimizer's"
    ours, theirs = tmp_path / "hit/checkpoints/step_000002", tmp_path / "plain/checkpoints/step_000002"
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = (torch.load(p / "optim.pt", weights_only=False) for p in (ours, theirs))
    assert all(
        torch.equal(oa["optimizer"]["state"][i][m], moments[m])
        for i, moments in ob["optimizer"]["state"].items()
        for m in ("exp_avg", "exp_avg_sq", "step")
    )
    assert torch.equal(oa["rng"]["torch"], ob["rng"]["torch"])
    sa, sb = (json.loads((p / "state.json").read_text()) for p in (ours, theirs))
    assert sa["data"] == sb["data"] and sa["train"]["step"] == 2 and sa["train"]["tokens"] == sb["train"]["tokens"]
    monkeypatch.setattr(GainProbe, "after", measure)
    again: Trainer = trainer(tmp_path / "hit", every=3)
    assert again.state.step == 2
    again.fit()
    end, base = again.model.state_dict(), plain.model.state_dict()
    assert all(torch.equal(end[k], base[k]) for k in base)
