"""Early stopping on the validation loss and evaluations that fail or hang: journaled decisions,
and training goes on (or stops) as they say."""

import json
import logging

import pytest

import trimtab
from test_trainer import debug_cfg, logged

pytestmark = pytest.mark.usefixtures("one_thread")


def decisions(run_dir):
    return [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]


def test_no_improvement_for_patience_evaluations_stops_the_run_with_its_evidence(tmp_path):
    # min_delta of 10 nats: no evaluation after the first can count as an improvement
    sets = ["orchestrator.early_stop.enabled=true", "orchestrator.early_stop.patience=2"]
    sets += ["orchestrator.early_stop.min_delta=10", "train.eval_every=2"]
    summary = trimtab.train(debug_cfg(tmp_path / "r", steps=20, sets=sets))
    assert summary["step"] == 6 and summary["exit_code"] == 0
    assert summary["status"].startswith("stopped (early stopping: val_loss")
    [d] = [d for d in decisions(tmp_path / "r") if d["rule"] == "early_stop"]
    assert d["step"] == 6 and d["action"] == "stop" and d["mode"] == "auto"
    assert d["evidence"]["best_step"] == 2 and d["evidence"]["evaluations_without_improvement"] == 2
    assert [s for s, _ in logged(tmp_path / "r", "val_loss")] == [2, 4, 6]


def test_early_stopping_is_off_by_default_and_advise_only_journals(tmp_path):
    sets = ["orchestrator.early_stop.min_delta=10", "train.eval_every=2"]
    assert trimtab.train(debug_cfg(tmp_path / "off", steps=8, sets=sets))["step"] == 8
    # off, it is a note for a person (a 500-step debug-moe run's held-out loss rose 3.685 -> 3.749 unsaid)
    [note] = [d for d in decisions(tmp_path / "off") if d["rule"] == "early_stop"]
    assert note["step"] == 8 and note["action"] == "none" and note["evidence"]["evaluations_without_improvement"] == 3
    assert "early_stop.enabled=true stops a run here" in note["reasoning"]
    sets += ["orchestrator.early_stop.enabled=true", "orchestrator.early_stop.patience=1", "orchestrator.mode=advise"]
    assert trimtab.train(debug_cfg(tmp_path / "advise", steps=8, sets=sets))["step"] == 8
    advised = [d for d in decisions(tmp_path / "advise") if d["rule"] == "early_stop"]
    assert advised and all(d["mode"] == "advise" for d in advised)


def test_a_failing_evaluation_is_journaled_and_training_goes_on(tmp_path):
    cfg = debug_cfg(tmp_path / "r", steps=8, sets=["train.eval_every=2", "faults=[eval_error@4]"])
    summary = trimtab.train(cfg)
    assert summary["status"] == "completed" and summary["val_loss"] is not None
    assert [s for s, _ in logged(tmp_path / "r", "val_loss")] == [2, 6, 8]  # step 4's was abandoned
    [d] = [d for d in decisions(tmp_path / "r") if d["rule"] == "eval_error"]
    assert d["step"] == 4 and d["action"] == "none" and "injected by eval_error@4" in d["evidence"]["error"]


def test_an_evaluation_past_its_timeout_is_abandoned(tmp_path):
    # a timeout 8x a clean evaluation's ~0.2 s on a loaded host (0.5 s timed the clean ones at steps 2 and 6 out
    # under a CI's load); the hung one stalls each forward 2 s
    sets = ["train.eval_every=2", "faults=[eval_hang@4:2.0]", "train.eval_timeout=1.5"]
    summary = trimtab.train(debug_cfg(tmp_path / "r", steps=6, sets=sets))
    assert summary["status"] == "completed"
    [d] = [d for d in decisions(tmp_path / "r") if d["rule"] == "eval_error"]
    assert "timed out" in d["evidence"]["error"] and "after 1 of" in d["evidence"]["error"]
    assert [s for s, _ in logged(tmp_path / "r", "val_loss")] == [2, 6]


def test_a_run_stopped_early_stays_stopped_when_the_same_command_runs_again(tmp_path, caplog):
    """A wrapper that relaunches until exit 0 must not train past an early stop: the same config
    again trains nothing, changes nothing and says why and how to train on; with the rule
    changed (more patience) it trains on and the rule judges again."""
    from test_trainer import files_of

    sets = ["orchestrator.early_stop.enabled=true", "orchestrator.early_stop.patience=2"]
    sets += ["orchestrator.early_stop.min_delta=10", "train.eval_every=2"]
    run = tmp_path / "r"
    stopped = trimtab.train(debug_cfg(run, steps=20, sets=sets))
    assert stopped["step"] == 6 and stopped["status"].startswith("stopped (early stopping: val_loss")
    before = files_of(run)
    with caplog.at_level(logging.WARNING):
        again = trimtab.train(debug_cfg(run, steps=20, sets=sets))
    assert again == stopped and files_of(run) == before
    assert f"{run} stopped early at step 6 of 20, by orchestrator.early_stop (val_loss " in caplog.text
    assert "nothing in it changed. To train on: --set orchestrator.early_stop.enabled=false" in caplog.text
    (run / "summary.json").unlink()  # a session killed after its last save: the checkpoint's journal says it
    del before["summary.json"]
    rebuilt = trimtab.train(debug_cfg(run, steps=20, sets=sets))
    assert rebuilt["status"] == stopped["status"] and rebuilt["step"] == 6 and files_of(run) == before
    patient = trimtab.train(debug_cfg(run, steps=20, sets=[*sets, "orchestrator.early_stop.patience=3"]))
    assert patient["step"] == 8 and patient["status"].startswith("stopped (early stopping: val_loss")


def test_an_evaluation_of_nan_weights_is_no_val_loss_for_early_stopping(tmp_path):
    """`trimtab train --inject weights_nan@10`, train.eval_every=5, early_stop on with patience 1:
    step 10's evaluation, of NaN weights, read val_loss NaN, "had not beaten the best" and stopped the
    run before rule nonfinite's rollback (step 12). Such an evaluation measures no model: neither a
    best (a first one's NaN was one, which nothing beats) nor a point since the best."""
    from types import SimpleNamespace

    from trimtab.config.orchestrator import OrchestratorConfig
    from trimtab.orchestrator.core import Orchestrator

    cfg = OrchestratorConfig()
    cfg.early_stop.patience = 5  # counted, not acted on: the monitor's count is the evidence
    orch, nan = Orchestrator(cfg, tmp_path), float("nan")
    mon, weights = orch.monitors["early_stop"], {"probe": nan}  # RunView.probe_loss: NaN for non-finite weights
    run = SimpleNamespace(phase=0, weights_finite=lambda: weights["probe"] == weights["probe"])  # not NaN
    orch.on_eval(run, {"step": 5, "val_loss": nan})  # the phase's first evaluation
    assert mon.best is None
    weights["probe"] = 5.9  # rolled back, finite
    orch.on_eval(run, {"step": 5, "val_loss": 5.9})
    weights["probe"] = nan
    for val_loss in (nan, 7.2):  # NaN, or a finite loss of broken weights (a NaN weight may leave it finite)
        orch.on_eval(run, {"step": 10, "val_loss": val_loss})
    assert (mon.best, mon.best_step, mon.since, mon.recent) == (5.9, 5, 0, [])
    weights["probe"] = 5.8
    orch.on_eval(run, {"step": 10, "val_loss": 6.0})  # finite weights: a real evaluation counts
    assert (mon.since, mon.recent) == (1, [[10, 6.0]])
    orch.on_eval(run, {"step": 15, "val_loss": nan})  # finite weights, a NaN score (an evaluation's overflow)
    assert (mon.best, mon.since, mon.recent) == (5.9, 1, [[10, 6.0]])  # no evaluation: NaN beats nothing


def test_a_nan_first_evaluation_of_finite_weights_is_no_best(tmp_path):
    """A NaN val_loss of finite weights (an fp16 evaluation's overflow) taken as the phase's first best
    left every later evaluation unable to beat it (x < NaN is false): early stopping at `patience`."""
    from types import SimpleNamespace

    from trimtab.config.orchestrator import OrchestratorConfig
    from trimtab.orchestrator.core import Orchestrator

    orch = Orchestrator(OrchestratorConfig(), tmp_path)
    run = SimpleNamespace(phase=0, weights_finite=lambda: True)
    orch.on_eval(run, {"step": 5, "val_loss": float("nan")})
    for step, loss in ((10, 6.0), (15, 5.5)):
        orch.on_eval(run, {"step": step, "val_loss": loss})
    assert (orch.monitors["early_stop"].best, orch.monitors["early_stop"].since) == (5.5, 0)
