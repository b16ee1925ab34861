"""Gradient-norm spikes alone, withheld, through the real loop: the loss never spikes, the
held-out probe is sound and no row is an outlier, so the third spike in the window is skipped too
and the LR kept (it was cut x0.5 for good: debug-mod, spikes at steps 40-43, 4.23 against 4.07
with the orchestrator off); as many again within the window cut it."""

import pytest

import trimtab
from test_orchestrator_loop import debug_cfg, decisions

pytestmark = pytest.mark.usefixtures("one_thread")


def test_three_gradient_spikes_on_sound_weights_are_skipped_and_the_lr_kept(tmp_path):
    faults = [f"grad_spike@{s}:1e6" for s in (10, 11, 12)]
    summary = trimtab.train(debug_cfg(tmp_path / "r", steps=14, faults=faults))
    assert summary["status"] == "completed"
    grads = [d for d in decisions(tmp_path / "r") if d["rule"] == "grad"]
    assert [(d["step"], d["action"]) for d in grads] == [(10, "skip_step"), (11, "skip_step"), (12, "skip_step")]
    assert "the loss never spiked" in grads[-1]["reasoning"] and "keep the LR" in grads[-1]["reasoning"]
    assert not [d for d in decisions(tmp_path / "r") if d["action"] == "scale_lr"]
