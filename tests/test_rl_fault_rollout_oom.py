"""`--inject rollout_oom@S` where nothing generates rollouts (`trimtab train`, `trimtab dpo`):
refused naming the fault and what to inject instead. It was accepted and never fired, unsaid,
so a run "tested" for the heal had met no fault at all."""

from types import SimpleNamespace

from helpers import trimtab_cli

FAST = ["--set", "log.progress=false", "--set", "log.report=false"]


def test_rollout_oom_outside_rl_is_refused(tmp_path):
    args = ["--preset", "debug", "--out", str(tmp_path / "run"), "--max-steps", "2", *FAST]
    done = trimtab_cli(["train", *args, "--inject", "rollout_oom@1:2"], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "faults: rollout_oom@1:2 fails RL's generation of rollouts, and this run generates none" in done.stderr
    assert "oom@STEP[:TOKENS]" in done.stderr  # what fails a training step instead


def test_rollout_oom_fires_by_the_generating_policys_step_not_the_trainers_now(tmp_path):
    """Asynchronous RL generates in a thread on a copy of the weights of step `version`: the fault
    read the trainer's step and evaluation flag as they were when the thread ran, so twin runs
    (max_staleness 2, rollout_oom@8:8) failed generation at step 8 in one and 9 in the other."""
    import pytest
    import torch

    from trimtab.orchestrator.faults import FaultInjector

    injector = FaultInjector(["rollout_oom@8:8"], tmp_path)
    injector.run = SimpleNamespace(step=20, evaluating=True)  # the trainer's now: read no more
    injector._maybe_rollout_oom(16, 6, False)  # generates for step 7: before the fault
    injector._maybe_rollout_oom(16, 7, True)  # an evaluation's pass: never the fault's
    injector._maybe_rollout_oom(8, 7, False)  # fits
    with pytest.raises(torch.OutOfMemoryError, match="generating 16 rows at once, more than 8 fit"):
        injector._maybe_rollout_oom(16, 7, False)  # generates for step 8


def test_grad_spike_waits_for_a_step_with_a_gradient(tmp_path):
    """grad_spike@S at an RL step whose groups were all flat (zero advantage, zero gradient: x1000 is 0) was recorded
    as fired and the run read healthy; it is taken back, said once, and fires at the next step with a gradient."""
    import json

    import torch

    from trimtab.orchestrator.faults import FaultInjector

    injector = FaultInjector(["grad_spike@3"], tmp_path)
    said: list[str] = []
    run, batch = SimpleNamespace(step=2, say=said.append), SimpleNamespace(rows=[])
    for step, norm in ((2, 0.0), (3, 0.0), (4, 0.5)):  # steps 3 and 4 flat, step 5 with a gradient
        run.step = step
        injector.on_step_start(run, batch)
        assert injector._fire_grad is not None and injector._fire_grad.spec == "grad_spike@3"
        grad = injector._maybe_bad_grad(torch.full((4,), norm))
        injector.on_step_end(run, SimpleNamespace(grad_norm=grad.norm()))
    assert grad.tolist() == [500.0] * 4  # step 5's gradient was multiplied
    run.step = 5
    injector.on_step_start(run, batch)
    assert injector._fire_grad is None  # spent: once
    assert json.loads((tmp_path / "faults.json").read_text())["fired"] == {"grad_spike@3": 1}
    assert len(said) == 1 and "step 3's gradient was zero" in said[0] and "nothing to multiply" in said[0]
