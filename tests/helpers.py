"""Test helpers shared by several test modules (pytest puts tests/ on sys.path)."""

from trimtab.training.hooks import Hook


class StopAt(Hook):
    """Stops the run after `step`, as a signal or a person would (the trainer saves first)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, out):
        if out.step == self.step:
            trainer.control.request("stop", reason="test")
