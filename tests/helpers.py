"""Test helpers shared by several test modules (pytest puts tests/ on sys.path)."""

from trimtab.training.hooks import Hook

# `trimtab train` flags for quick CLI runs: a small corpus slice, no progress bar, TensorBoard or evals
FAST = [
    "--set",
    "data.max_bytes=150000",
    "--set",
    "log.progress=false",
    "--set",
    "log.tensorboard=false",
    "--set",
    "train.eval_every=0",
]


class StopAt(Hook):
    """Stops the run after `step`, as a signal or a person would (the trainer saves first)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, out):
        if out.step == self.step:
            trainer.control.request("stop", reason="test")
