"""A run's sizes follow its experts across a load: summary.json's parameter counts (and MFU's FLOPs
per token) after a resume from a checkpoint saved after expert surgery, and after a rollback that
undid one. Both gave a model other than the one trained (soak3: `trimtab ctl add-expert`, then a
resume: 899,424 parameters said for a model of 936,384; a rollback across it: 938,904 for 901,944)."""

import pytest

import trimtab
from trimtab.config import load_config
from trimtab.training.instrument import Instrument

pytestmark = pytest.mark.usefixtures("one_thread")


def moe_cfg(out, steps):
    base = {
        "out": str(out),
        "train": {"max_steps": steps, "eval_every": 0, "batch_tokens": 512, "micro_batch_tokens": 512},
        "data": {"max_bytes": 60_000},
        "log": {"progress": False, "tensorboard": False, "report": False},
        "checkpoint": {"every": 2},
        "plan": {"status_every": 0},
    }
    return load_config(preset="debug-moe", overrides=base)


class Person(Instrument):
    """`trimtab ctl` by hand (an expert added at step `add`, a rollback to step 0 at step `back`), and
    at every step the run's sizes against the live model (an instrument: its handle sees the trainer)."""

    def __init__(self, add=None, back=None):
        self.add, self.back, self.sent, self.seen = add, back, set(), []

    def on_step_end(self, trainer, out):
        model, sizes = self.handle.model, self.handle._trainer.sizes
        self.seen.append((out.step, sizes["params"], sum(p.numel() for p in model.parameters())))
        for action, at, params in (("add_expert", self.add, {"layer": 1}), ("rollback", self.back, {"to": 0})):
            if out.step == at and action not in self.sent:
                self.sent.add(action)
                trainer.control.request(action, **params)


def test_sizes_follow_the_experts_across_a_resume_and_a_rollback(tmp_path):
    first = Person(add=1)
    trimtab.train(moe_cfg(tmp_path / "r", 2), hooks=[first])  # step 2's checkpoint holds 9 experts in layer 1
    second = Person(back=3)  # resumed at 2 (9 experts), rolled back to step 0 (8)
    summary = trimtab.train(moe_cfg(tmp_path / "r", 4), hooks=[second])
    grown, steps = first.seen[-1][2], [s for s, _, _ in second.seen]
    assert steps == [3, 1, 2, 3, 4] and second.seen[-1][2] < grown  # the rollback undid the expert
    assert all(said == live for _, said, live in first.seen + second.seen), second.seen
    assert summary["params"] == second.seen[-1][2]
