"""Which checkpoints pruning keeps when the checkpoint interval shrinks at run time (rule
checkpoint_interval): the configured cadence's beside the newest checkpoint.keep (checkpoint.cadence_kept)."""

from pathlib import Path
from types import SimpleNamespace

from test_rl_reward_small_start import step_of
from trimtab.checkpoint import list_checkpoints, prune
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.training.checkpointing import Checkpointing


def kept(run_dir: Path, saves: list[int], knob: int | None, every: int = 20, keep: int = 3, hooks=()) -> list[int]:
    """The steps left after the save at saves[-1] pruned, `knob` the interval a decision set (None: none)."""
    for step in saves:
        (run_dir / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    trainer = Checkpointing.__new__(Checkpointing)  # the mixin's pruning inputs only, no model
    trainer.cfg = SimpleNamespace(
        run_dir=run_dir,
        checkpoint=SimpleNamespace(every=every, keep=keep),
        rl=SimpleNamespace(kl_coef=0.0),
        dpo=SimpleNamespace(enabled=False),
    )
    trainer.state = SimpleNamespace(step=saves[-1], checkpoint_every=knob)
    trainer.hooks, trainer.view = list(hooks), SimpleNamespace(step=saves[-1])
    trainer.last_good, trainer.best_checkpoint = saves[-1], -1
    prune(run_dir, keep, trainer._protected())
    return [int(p.name.split("_")[1]) for p in list_checkpoints(run_dir)]


def test_a_shrunk_interval_keeps_the_configured_cadences_checkpoints(tmp_path):
    """RL at lr 1e-2 (debug, checkpoint.every 20): rolled back to step 0, the interval set to 1 step;
    at step 11 rl_reward's target, the policy of step 0, had been pruned (the newest 3: 9-11) and
    the run stopped. Pretraining (debug, weights_nan@36: back to step 20, every 3 steps from step 21):
    at step 100 the newest 3 spanned 4 steps. Now the newest at or before each of the configured
    cadence's last 3 steps (100, 80, 60) stay too: keep x every of history, at most 2 x keep."""
    assert kept(tmp_path / "rl", list(range(12)), knob=1) == [0, 9, 10, 11]
    pretrain = [0, 20, *range(24, 100, 3), 100]
    assert kept(tmp_path / "pt", pretrain, knob=3) == [60, 78, 96, 99, 100]


def test_a_run_at_its_configured_interval_keeps_the_newest_only(tmp_path):
    """No decision set the interval (a fault-free run, checkpoint.every 20 and a last save at 110):
    pruning keeps what it kept, the newest 3, not the cadence's step 60 beside them."""
    assert kept(tmp_path / "r", [0, 20, 40, 60, 80, 100, 110], knob=None) == [80, 100, 110]


def test_the_checkpoint_a_rules_rollback_target_restores_is_kept(tmp_path):
    """rl_reward's target, the policy before the window that fell (good_step 23), is seldom a save's
    step: a rollback to it restores the newest checkpoint at or before it (20). Kept as the step
    alone, or not at all, that checkpoint was pruned (checkpoint.keep 2 at step 50: 40 and 50
    left) and the rollback landed further back than the rule named, or found none and stopped."""
    orch = Orchestrator(OrchestratorConfig(), tmp_path / "orch")
    reward = orch.monitors["rl_reward"]
    for i in range(1, 51):  # 30 steady steps, then every group fails
        reward.observe(step_of(i, [0.5] * 8 if i <= 30 else [0.0] * 8))
    assert reward.good_step == 23
    assert kept(tmp_path / "run", list(range(0, 51, 10)), knob=None, keep=2, hooks=[orch]) == [20, 40, 50]
