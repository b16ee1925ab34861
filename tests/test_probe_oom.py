"""The orchestrator must never crash a run by looking: an out-of-memory error in a read of the
model outside a training step (the held-out probe, row scoring) is no probe / no scores, said on
the console, and the run goes on to save. (A sweep's run, its memory limit lowered mid-run, died
in the end check's probe with a raw traceback and never wrote its last checkpoint.)"""

import pytest

import trimtab
from test_orchestrator_loop import all_finite, debug_cfg, final_weights
from trimtab.checkpoint import list_checkpoints
from trimtab.hardware import is_oom
from trimtab.training.hooks import Hook
from trimtab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 16
CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1073741824 bytes. Error code 12"


def cpu_oom() -> RuntimeError:
    exc = RuntimeError(CPU_OOM)
    assert is_oom(exc)  # what the allocator raises is what the view tells apart
    return exc


def test_an_oom_in_the_end_checks_probe_skips_the_probe_and_the_run_saves(tmp_path, monkeypatch, capsys):
    real = Trainer.score
    probes = []

    def score(self, micro):
        # the probe's scoring (outside the evaluation) at the end; the evaluation itself scores as usual
        if self.state.step == STEPS and not self.evaluating:
            probes.append(self.state.step)
            raise cpu_oom()
        return real(self, micro)

    monkeypatch.setattr(Trainer, "score", score)
    run = tmp_path / "r"
    summary = trimtab.train(debug_cfg(run, steps=STEPS))
    assert probes, "the end check never probed: the test tests nothing"
    assert summary["status"] == "completed" and summary["exit_code"] == 0 and summary["step"] == STEPS
    assert list_checkpoints(run)[-1].name == f"step_{STEPS:06d}" and all_finite(final_weights(run))
    said = [ln for ln in capsys.readouterr().err.splitlines() if "out of memory scoring the held-out probe" in ln]
    assert len(said) == 1 and "skipped, the run goes on" in said[0] and "can't allocate memory" in said[0], said


class ScoresWithoutMemory(Hook):
    """At one step, row scoring's forward runs out of memory: what the view's reads return."""

    def __init__(self) -> None:
        self.seen: list = []

    def on_step_end(self, run, out) -> None:
        if run.step != 4:
            return
        trainer = run._t  # the test's way in: make the trainer's forward fail as the allocator does
        real = trainer.forward
        trainer.forward = lambda inputs: (_ for _ in ()).throw(cpu_oom())
        try:
            self.seen = [run.row_losses([0, 1]), run.held_out_row_losses(4), run.probe_loss()]
        finally:
            trainer.forward = real


def test_row_scoring_that_runs_out_of_memory_returns_no_scores(tmp_path, capsys):
    hook = ScoresWithoutMemory()
    summary = trimtab.train(debug_cfg(tmp_path / "r", steps=8), hooks=[hook])
    assert hook.seen == [{}, [], None]
    assert summary["exit_code"] == 0 and summary["step"] == 8
    err = capsys.readouterr().err
    for what in ("scoring training rows", "scoring held-out rows", "scoring the held-out probe"):
        assert err.count(f"out of memory {what}") == 1, what
