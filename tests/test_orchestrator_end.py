"""The end of a run is guarded like its middle: a fault in its last steps leaves too few findings to
climb the ladder, yet the run must not say "completed", exit 0 and save broken weights as final."""

import json

import pytest

import trimtab
from test_orchestrator_loop import all_finite, debug_cfg, final_weights
from trimtab.checkpoint import list_checkpoints
from trimtab.rundir import read_decisions

pytestmark = pytest.mark.usefixtures("one_thread")


def test_weights_broken_at_the_last_step_are_rolled_back_and_the_steps_trained_again(tmp_path):
    run = tmp_path / "r"
    summary = trimtab.train(debug_cfg(run, steps=24, faults=["weights_nan@24"]))
    # the last step is non-finite and its weights are NaN: rule nonfinite rolls back at once (the end check,
    # which rolled them back after a skip, finds the replayed weights sound)
    assert [(d["rule"], d["action"]) for d in read_decisions(run)] == [("nonfinite", "rollback")]
    assert summary["status"] == "completed" and summary["exit_code"] == 0 and summary["step"] == 24
    assert list_checkpoints(run)[-1].name == "step_000024" and all_finite(final_weights(run))


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    """The undisturbed run both checkpointing modes below end as: trained once, not once each."""
    return trimtab.train(debug_cfg(tmp_path_factory.mktemp("clean") / "r", steps=24, train={"eval_every": 24}))


@pytest.mark.xdist_group("test_orchestrator_end-clean")  # both modes on one worker: `clean` computed once
@pytest.mark.parametrize("asynchronous", [False, True])
def test_wrecked_weights_that_never_spike_are_caught_at_the_end(tmp_path, clean, asynchronous):
    # Noise of 3x each block weight's std one step before the end: finite, and the last step's
    # spike alone climbs nothing. The end check finds the held-out loss far above the last good
    # checkpoint's, rolls back, and the replay (the fault has fired) ends where a clean run does.
    # With saves written in the background too (its reference was never set: no check).
    run, written = tmp_path / "r", {"checkpoint": {"every": 8, "asynchronous": asynchronous}}
    summary = trimtab.train(
        debug_cfg(run, steps=24, faults=["weights_noise@24:3"], train={"eval_every": 24}, **written)
    )
    assert [d["action"] for d in read_decisions(run) if d["rule"] == "end"] == ["rollback"]
    assert summary["exit_code"] == 0
    assert summary["val_loss"] == pytest.approx(clean["val_loss"], rel=1e-3)


def test_a_resumed_run_checks_its_end_against_the_checkpoint_it_resumed_from(tmp_path):
    """The end check's reference is the held-out loss at the last good checkpoint, kept in that
    checkpoint: a run trained to step 20 and extended to 40 compares with step 20's. (It kept the
    checkpoint before's, step 0's: far higher, and 2x noise at step 40 passed as a good end.)"""
    run, cfg = tmp_path / "r", {"checkpoint": {"every": 20}, "train": {"eval_every": 40}}
    trimtab.train(debug_cfg(run, steps=20, **cfg))
    trimtab.train(debug_cfg(run, steps=40, faults=["weights_noise@40:2"], **cfg))
    (end,) = [d for d in read_decisions(run) if d["rule"] == "end"]
    assert end["action"] == "rollback" and end["evidence"]["baseline"] < 6.0, end["evidence"]


def test_with_the_orchestrator_off_non_finite_final_weights_end_the_run_as_failed(tmp_path):
    run = tmp_path / "r"
    summary = trimtab.train(debug_cfg(run, steps=24, faults=["weights_nan@24"], orchestrator={"mode": "off"}))
    assert summary["exit_code"] == 3 and summary["status"].startswith("gave up (the weights are not finite at step 24")
    assert [p.name for p in list_checkpoints(run)][-1] == "step_000016"  # the resume point: finite weights
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 3
    again = trimtab.train(debug_cfg(run, steps=24, faults=["weights_nan@24"], orchestrator={"mode": "off"}))
    assert again["exit_code"] == 0 and again["step"] == 24  # the fault fired once: the re-run trains on
    assert all_finite(final_weights(run))
