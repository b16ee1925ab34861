"""The first checkpoint a run saves after a rollback, steps past the restored one, is judged by the
hooks like any other: the restored checkpoint's own verdict belongs to a save of that same step.

debug-moe, 100 steps, weights_noise@30:3 + weights_nan@45: the rollback at 32 restored step 20;
the save at step 40, calm, was written "good": false (Checkpointing._good answered for the restored
step 20 at step 40), so the NaN at 45 rolled back to 20 again, read as the same breakage "before the
replay got clear of it", and cut the LR x0.1: val_loss 4.80 against 4.16 clean. With step 40 good:
4.16, the clean run's.
"""

from types import SimpleNamespace

from trimtab.training.checkpointing import Checkpointing


class _Healthy:
    def healthy(self, view):
        return True


def _saver(step, restored_step):
    saver = Checkpointing()
    saver._restored = True  # a rollback restored `restored_step`, and nothing was saved since
    saver.last_saved = saver.last_good = restored_step
    saver.state, saver.hooks, saver.view = SimpleNamespace(step=step), [_Healthy()], None
    return saver


def test_saving_the_restored_step_again_keeps_its_verdict():
    assert _saver(20, 20)._good()


def test_the_first_save_past_a_rollback_is_the_hooks_call():
    assert _saver(40, 20)._good()
