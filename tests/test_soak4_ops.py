"""Found by using trimtab as a user does after a first run (soak4): merges of a run whose newest
checkpoint is corrupt, ctl total-steps against a relaunch's --max-steps, a standing MoE advice."""

import dataclasses
import logging
from types import SimpleNamespace

import pytest

from trimtab.checkpoint import save_checkpoint
from trimtab.config import OptimConfig, load_config
from trimtab.merge import average, merge
from trimtab.model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(path, tokenizer, steps):
    """A run directory (hf_helpers.write_run's, step 0) with healthy checkpoints at `steps` besides."""
    from hf_helpers import write_run

    model = build_model(dataclasses.replace(load_config(preset="debug").model, vocab_size=tokenizer.vocab_size))
    write_run(path, model, tokenizer)
    for step in steps:
        state = {"moe": {}, "mod": {}, "train": {"tokens": step * 1000}, "good": True}
        save_checkpoint(path, step, model.state_dict(), {}, state, keep=9)
    return path


def _flip(path):
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # a flipped bit: same size, other checksum
    path.write_bytes(bytes(data))


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_merge_says_a_corrupt_newest_checkpoint_once_with_what_it_uses(tmp_path, tokenizer, caplog):
    """A recipe merge said the corrupt checkpoint ("falling back to .../step_000000 (step 0)"), then
    load_run_at's own "using step_000000, the newest checkpoint that verifies": two lines for one
    fact. An average of the last 2 said "falling back to (step 4)" and "using step_000004" of a run
    it averaged at steps 2 and 4: it names the steps it averages, once."""
    run = _run(tmp_path / "run", tokenizer, [4])
    _flip(run / "checkpoints" / "step_000004" / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        merge({"merge_method": "linear", "models": [{"model": str(run)}]}, tmp_path / "m")
    (said,) = _warnings(caplog)
    assert said.startswith(f"skipping corrupt checkpoint {run}/checkpoints/step_000004 (")
    assert said.endswith(f"falling back to {run}/checkpoints/step_000000 (step 0)")
    run2 = _run(tmp_path / "run2", tokenizer, [2, 4, 6])
    _flip(run2 / "checkpoints" / "step_000006" / "model.safetensors")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        average(run2, 2, tmp_path / "avg")
    (said,) = _warnings(caplog)
    assert said.startswith(f"skipping corrupt checkpoint {run2}/checkpoints/step_000006 (")
    assert said.endswith("; averaging steps 2, 4")


def test_another_max_steps_on_resume_is_the_length_a_ctl_total_steps_had_moved():
    """`ctl total-steps 30` on a --max-steps 40 run stuck as an offset (length_delta -10): a
    relaunch with --max-steps 50 trained to 40, one with --max-steps 30 refused as past "the 20
    steps asked for". The person's newest word is the length: --max-steps N trains to N."""
    from trimtab.training.schedule import apply_lengths, phase_lr, reconcile

    ps = [SimpleNamespace(start=0, steps=0, optim=OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=4))]
    apply_lengths(ps, [40], -10)
    state = SimpleNamespace(step=30, phase=0, phase_steps=[40], length_delta=-10, restarts=[])
    (change,) = reconcile(state, ps, [50])
    assert apply_lengths(ps, state.phase_steps, state.length_delta) == 50
    assert "its 20 added steps re-warm" in change["effect"]  # from step 30, where it had ended
    assert change["effect"].endswith("it replaces set_total_steps' -10 to the old one (30 steps)")
    assert state.restarts == [
        [0, 30, pytest.approx(phase_lr(SimpleNamespace(start=0, steps=30, optim=ps[0].optim), 0, 29, []))]
    ]


def test_a_finished_run_whose_length_ctl_set_is_finished_at_that_max_steps(tmp_path):
    """A run that `ctl total-steps 3` ended at step 3 (--max-steps 4), relaunched with
    --max-steps 3, is finished, not "past the 2 steps asked for"."""
    from test_checkpoint import OneProcess, Tied
    from trimtab.errors import RunFinished, RunPastLength
    from trimtab.rundir import write_summary
    from trimtab.training.resume import resume_point

    train = {"step": 3, "tokens": 30, "phase_steps": [4], "length_delta": -1}
    save_checkpoint(tmp_path, 3, Tied().state_dict(), {"optimizer": {}}, {"train": train}, keep=3)
    write_summary(tmp_path, {"status": "completed", "step": 3, "total_steps": 3})
    cfg = load_config(preset="debug", sets=[f"out={tmp_path}", "train.max_steps=3"])
    with pytest.raises(RunFinished, match=r"has finished: it is at step 3 of 3 \(train.max_steps 3\);") as said:
        resume_point(cfg, OneProcess())
    assert not isinstance(said.value, RunPastLength)
    cfg = load_config(preset="debug", sets=[f"out={tmp_path}", "train.max_steps=4"])
    with pytest.raises(RunFinished, match=r"at step 3 of 3 \(train.max_steps 4, -1 by set_total_steps\)"):
        resume_point(cfg, OneProcess())  # the length ctl set, kept


ADVICE = [  # an advised pruning repeated to the end (folded: seen_again), advice later applied, a note
    {
        "id": 1,
        "step": 60,
        "rule": "moe",
        "action": "prune_expert",
        "params": {"layer": 1, "expert": 5},
        "mode": "advise",
    }
    | {"summary": "layer 1: expert 5 dead again", "evidence": {"seen_again": 11, "last_seen_at": 140}},
    {"id": 2, "step": 70, "rule": "moe", "action": "set_balance_coef", "params": {"value": 0.04}, "mode": "advise"},
    {"id": 3, "step": 90, "rule": "manual", "action": "set_balance_coef", "params": {"value": 0.04}, "mode": "manual"},
    {"id": 4, "step": 95, "rule": "straggler", "action": "none", "params": {}, "mode": "advise"},
]


def test_advice_standing_at_the_end_is_said_in_the_end_summary_and_the_report(tmp_path, capsys):
    """An advised MoE pruning that stayed advised was folded into its first line (seen_again) and
    never said again: the end summary named no advice, the report's row read "not applied" at
    step 60 of a pruning advised to step 140. Now both name the advice no one carried out."""
    import json

    from trimtab.cli_train import _print_summary
    from trimtab.report.page import _decisions_table

    (tmp_path / "decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in ADVICE))
    summary = {"status": "completed", "step": 150, "total_steps": 150, "steps_this_session": 150, "seconds": 1}
    summary |= {"tokens": 1, "tokens_per_s": 1, "params": 1, "non_embedding_params": 1, "device": "cpu"}
    _print_summary(summary | {"precision": "fp32", "run_dir": str(tmp_path)})
    out = capsys.readouterr().out
    assert "advice standing, not applied (1;" in out
    said = 'step 60 moe: prune_expert {"layer": 1, "expert": 5} (layer 1: expert 5 dead again; advised 12 times, '
    assert f"{said}last at step 140)" in out and "set_balance_coef" not in out  # a person applied that one
    page = _decisions_table(SimpleNamespace(name="r", decisions=ADVICE, config={}))
    assert "Advice standing at the end, not applied (1)" in page and "advised 12 times, last at step 140" in page


def test_advice_for_two_collapsed_moe_layers_in_turn_is_each_folded_into_its_first(tmp_path):
    """debug-moe, orchestrator.mode=advise, expert_collapse@10:5: the rule advised reset_router for
    layer 1, then layer 3, in turn every 5 steps; folding matched the action's latest advice alone
    (the other layer's), so 80 steps journaled 26 router resets, none folded. By parameters, each
    layer's advice is one decision seen again."""
    from trimtab.orchestrator.journal import Decision, Journal

    journal = Journal(tmp_path / "decisions.jsonl")
    for i, layer in enumerate((1, 3)):
        params = {"layer": layer, "expert": 0}
        journal.add(Decision(id=i, step=19 + i, rule="moe", evidence={}, reasoning="", action="reset_router",
                             params=params, confidence=0.75, mode="advise"))  # fmt: skip
    again = journal.advised_again("moe", "reset_router", {"layer": 1, "expert": 0}, 24, 50)
    assert again is journal.decisions[0]
    assert journal.advised_again("moe", "reset_router", {"layer": 2, "expert": 0}, 24, 50) is None  # another layer


def test_a_run_length_a_running_job_has_passed_is_refused_when_sent(tmp_path):
    """`ctl RUN total-steps 60` to a job at step 88 was sent ("it applies it at its next step"), then
    said "set_total_steps 60 -> run length 60 steps" and failed in the job, the person gone."""
    import json

    from trimtab.errors import ConfigError
    from trimtab.orchestrator import ctl
    from trimtab.runlock import run_lock

    (tmp_path / "config.yaml").write_text("")
    (tmp_path / "checkpoints" / "step_000080").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 4.0}) + "\n" for s in (85, 88)))
    with run_lock(tmp_path):
        with pytest.raises(ConfigError, match=r"total-steps 60: .* is running, at step 88 .*at least 88"):
            ctl.send(tmp_path, {"action": "set_total_steps", "params": {"steps": 60}})
        assert not (tmp_path / "control").exists()  # nothing dropped
        assert ctl.send(tmp_path, {"action": "set_total_steps", "params": {"steps": 90}}).is_file()
