"""A run resumed from a checkpoint that is not a good one (saved while an escalation was under
way) still knows the good checkpoint before it: the next saves' pruning spares it. It set
last_good to -1, so the first save after the resume deleted the run's only rollback target, and a
fault later stopped the run (exit 3, "no good checkpoint to roll back to"; soak: debug-moe, a
kill -9 while the divergence rule was climbing, weights_noise 300 steps later)."""

import trimtab
from trimtab.config import load_config, merge
from trimtab.training.hooks import Hook


class SickAfter1(Hook):
    """Calls the weights unhealthy after step 1: checkpoints after it are not good ones."""

    def healthy(self, run) -> bool:
        return run.step <= 1


def cfg(out, steps):
    base = {
        "out": str(out),
        "train": {
            "max_steps": steps,
            "eval_every": 0,
            "batch_tokens": 1024,
            "log_every": 1,
            "precision": "fp32",
            "eval_tokens": 1024,
        },
        "data": {"max_bytes": 30_000},
        "log": {"progress": False, "tensorboard": False, "report": False},
        "checkpoint": {"every": 1, "keep": 1},
        "orchestrator": {"mode": "off"},
    }
    return load_config(preset="debug", overrides=merge(base, {}))


def test_a_resume_from_a_checkpoint_that_is_not_good_keeps_the_good_one_before_it(tmp_path):
    run = tmp_path / "r"
    trimtab.train(cfg(run, 2), hooks=[SickAfter1()])  # good: 0, 1; not good: 2 (keep 1 spares step 1)
    assert (run / "checkpoints" / "step_000001").is_dir()
    trimtab.train(cfg(run, 3), hooks=[SickAfter1()])  # resumed at 2 (not good): saves 3
    assert (run / "checkpoints" / "step_000001").is_dir()  # still the run's rollback target
