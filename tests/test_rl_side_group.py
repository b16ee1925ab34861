"""Under torchrun every RL phase makes its rollout thread's side group (Trainer._enter_phase): a
synchronous run (rl.max_staleness 0) that `trimtab ctl RUN max-staleness N` makes asynchronous
then sums and gathers its thread's figures over the ranks, not each rank's alone."""

from types import SimpleNamespace

import pytest

from trimtab.config import load_config
from trimtab.distributed.group import gather_objects
from trimtab.rl.batches import RolloutLoader
from trimtab.training import phases as phases_module
from trimtab.training.state import TrainState
from trimtab.training.trainer import Trainer


@pytest.mark.parametrize("world", [1, 2])
def test_every_rl_phase_under_torchrun_makes_the_rollout_threads_side_group(monkeypatch, world):
    cfg = load_config(preset="debug", sets=["rl.max_staleness=0"])
    loader = RolloutLoader.__new__(RolloutLoader)  # the phase's loader, unbuilt: only its hooks are set
    phase = SimpleNamespace(optim=cfg.optim, loader=lambda *args: loader)
    monkeypatch.setattr(phases_module, "build_optimizer", lambda *args: None)
    monkeypatch.setattr(phases_module, "side_sum", lambda: "side group")
    trainer = Trainer.__new__(Trainer)
    trainer.__dict__.update(
        phases=[phase],
        state=TrainState(),
        model=None,
        device=None,
        cfg=cfg,
        tok=SimpleNamespace(pad_id=0),
        data_shard=(),
        dist=SimpleNamespace(world=world),
        control=SimpleNamespace(apply_knobs=lambda: None),
    )
    trainer._enter_phase(0)
    if world == 1:
        assert not hasattr(loader, "side_sum")  # one process: the loader's own (its sums are the rank's)
    else:
        assert loader.side_sum == "side group" and loader.gather is gather_objects
