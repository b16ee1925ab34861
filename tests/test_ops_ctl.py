"""`trimtab ctl` refuses at once, by the run's config.yaml, a command the job could only journal as
failed after the person had gone: a MoE or Mixture-of-Depths knob for every layer (no layer named)
of a model that has none of that kind, an RL knob on a run that is not `trimtab rl`. And a
pause-rule, resume-rule or mode that finds the state already as asked is journaled as changing
nothing, not as applied."""

from __future__ import annotations

import time

import pytest

from helpers import FakeTrainer
from trimtab.cli import main
from trimtab.config import dump_config, load_config
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.errors import ConfigError, RunStateError
from trimtab.orchestrator import ctl
from trimtab.orchestrator.core import Orchestrator
from trimtab.rundir import read_decisions, write_json, write_summary
from trimtab.runlock import run_lock


@pytest.mark.parametrize(
    ("verb", "args", "message"),
    [
        ("mod-capacity", ["0.5"], "has no Mixture-of-Depths layers .*dense only"),
        ("capacity-factor", ["1.0"], "has no MoE layers"),
        ("router-temperature", ["2.0"], "has no MoE layers"),
        ("rl-temperature", ["0.7"], "ctl rl-temperature: .* not an RL run .*rl.enabled"),
        ("dynamic-sampling", ["on"], "ctl dynamic-sampling: .* not an RL run"),
    ],
)
def test_a_knob_the_run_has_not_is_refused_when_sent(tmp_path, verb, args, message):
    dump_config(load_config(preset="debug"), tmp_path / "config.yaml")  # dense layers, no RL
    with pytest.raises(ConfigError, match=message):
        ctl.send(tmp_path, ctl.parse_command(verb, args), queue=True)
    assert not (tmp_path / "control").exists()  # nothing sent


def test_an_overlong_penalty_over_the_whole_budget_is_refused_when_sent(tmp_path):
    cfg = load_config(preset="debug", overrides={"rl": {"enabled": True, "max_new_tokens": 6}})
    dump_config(cfg, tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match=r"6 tokens is not under .*rl.max_new_tokens 6 .*pass 0 \(off\) to 5"):
        ctl.send(tmp_path, ctl.parse_command("overlong-penalty", ["6"]), queue=True)
    assert not (tmp_path / "control").exists()  # nothing sent
    ctl.send(tmp_path, ctl.parse_command("overlong-penalty", ["5"]), queue=True)
    assert [c["params"] for _, c in ctl.take_commands(tmp_path)] == [{"tokens": 5}]


def test_a_difficulty_for_a_task_read_from_a_file_is_refused_when_sent(tmp_path):
    """The job refused it (rl/curriculum.py) after the person had gone; the built-in task takes it."""
    for name, prompts in (("file", "prompts.jsonl"), ("builtin", "builtin:arithmetic:2")):
        run = tmp_path / name
        run.mkdir()
        dump_config(
            load_config(preset="debug", overrides={"rl": {"enabled": True, "prompts": prompts}}), run / "config.yaml"
        )
    with pytest.raises(ConfigError, match=r"rl-difficulty: .*'prompts.jsonl', a file with no difficulty"):
        ctl.send(tmp_path / "file", ctl.parse_command("rl-difficulty", ["3"]), queue=True)
    assert not (tmp_path / "file" / "control").exists()  # nothing sent
    ctl.send(tmp_path / "builtin", ctl.parse_command("rl-difficulty", ["3"]), queue=True)
    assert [c["action"] for _, c in ctl.take_commands(tmp_path / "builtin")] == ["set_rl_difficulty"]


def test_the_same_knobs_go_to_runs_that_have_them(tmp_path):
    moe, rl = tmp_path / "moe", tmp_path / "rl"
    for path, cfg in (
        (moe, load_config(preset="debug-moe")),
        (rl, load_config(preset="debug", overrides={"rl": {"enabled": True}})),
    ):
        path.mkdir()
        dump_config(cfg, path / "config.yaml")
    ctl.send(moe, ctl.parse_command("capacity-factor", ["1.0"]), queue=True)
    ctl.send(rl, ctl.parse_command("rl-temperature", ["0.7"]), queue=True)
    ctl.send(tmp_path / "moe", ctl.parse_command("scale-lr", ["0.5"]), queue=True)  # not a config's question
    assert [c["action"] for _, c in ctl.take_commands(moe)] == ["set_capacity_factor", "scale_lr"]
    assert [c["action"] for _, c in ctl.take_commands(rl)] == ["set_rl_temperature"]


def test_a_rule_or_mode_command_that_changes_nothing_says_so(tmp_path):
    (tmp_path / "config.yaml").write_text("{}")
    orchestrator, run = Orchestrator(OrchestratorConfig(), tmp_path), FakeTrainer(tmp_path)
    commands = [("pause-rule", "spike"), ("pause-rule", "spike"), ("resume-rule", "plateau"), ("resume-rule", "spike")]
    for verb, arg in [*commands, ("mode", orchestrator.mode), ("mode", "advise")]:
        ctl.send(tmp_path, ctl.parse_command(verb, [arg]), queue=True)
    orchestrator._take_commands(run)
    got = [(d["applied"], d["outcome"]["result"]) for d in read_decisions(tmp_path)]
    assert got == [
        (["paused rules: spike"], "applied"),
        (["spike was already paused; paused rules: spike"], "no effect"),
        (["plateau was not paused; paused rules: spike"], "no effect"),
        (["paused rules: none"], "applied"),
        (["mode auto (it was already)"], "no effect"),
        (["mode advise"], "applied"),
    ]
    assert orchestrator.paused == set() and orchestrator.mode == "advise"


def test_a_command_that_comes_after_the_last_step_is_answered_not_journaled_as_applied(tmp_path):
    """`ctl stop` sent while the run's final evaluation and save ran: the end of the run took the
    file and journaled the stop as applied, with nothing done (no point applies requests any more),
    and a resume then said it "went with the process"."""
    (tmp_path / "config.yaml").write_text("{}")
    orchestrator, run = Orchestrator(OrchestratorConfig(), tmp_path), FakeTrainer(tmp_path)
    ctl.send(tmp_path, ctl.parse_command("stop", ["late"]), queue=True)
    summary = {}
    orchestrator.on_train_end(run, summary)
    assert read_decisions(tmp_path) == [] and summary["decisions"] == 0
    (error,) = (tmp_path / "control").glob("*.error")
    assert "ended at step 3 before it could apply this command; nothing was applied" in error.read_text()
    assert not list((tmp_path / "control").glob("*.json")) and run.control.apply() == []


def test_a_command_sent_after_the_last_step_never_fires_at_the_next_resume(tmp_path):
    """`ctl scale-lr` sent after the orchestrator's on_train_end but before the run's lock was
    released (its report, trackers, summary) was sent as to a running job, lay in control/ and fired
    at the next resume. Now it is refused; one that slipped in as the run ended is answered there."""
    (tmp_path / "config.yaml").write_text("{}")
    scale = ctl.parse_command("scale-lr", ["0.5"])
    with run_lock(tmp_path):  # the session that ends
        Orchestrator(OrchestratorConfig(), tmp_path).on_train_end(FakeTrainer(tmp_path), {})
        with pytest.raises(RunStateError, match="not running .*last step, 3, is done.*--queue"):
            ctl.send(tmp_path, scale)
        addressed = {**scale, "session": ctl.session(tmp_path)}  # sent just before the inbox closed
        write_json(tmp_path / "control" / "1-1.json", addressed)
        queued = ctl.send(tmp_path, scale, queue=True)  # on purpose: for the next session
    time.sleep(0.01)  # the next session's lock record differs by its start
    with run_lock(tmp_path):
        orchestrator, run = Orchestrator(OrchestratorConfig(), tmp_path), FakeTrainer(tmp_path)
        orchestrator._take_commands(run)
    assert [d["evidence"].get("command") for d in read_decisions(tmp_path)] == ["scale_lr"]  # the queued one
    assert "ended at step 3 before it could apply" in (tmp_path / "control" / "1-1.error").read_text()
    assert not queued.with_suffix(".error").exists() and not list((tmp_path / "control").glob("*.json"))


def test_a_command_queued_for_a_completed_run_says_what_resumes_it(tmp_path, capsys):
    """Re-running the finished run's command changes nothing (it says so and exits 0): a queued
    command waits for a larger --max-steps, which the person is told when queueing it."""
    dump_config(load_config(preset="debug"), tmp_path / "config.yaml")
    write_summary(tmp_path, {"status": "completed", "step": 40, "total_steps": 40})
    assert main(["ctl", "--queue", str(tmp_path), "scale-lr", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "queued in" in out and "has completed (step 40 of 40)" in out and "larger --max-steps" in out
    write_summary(tmp_path, {"status": "stopped (stop requested)", "step": 20, "total_steps": 40})
    assert main(["ctl", "--queue", str(tmp_path), "scale-lr", "0.5"]) == 0
    assert "has completed" not in capsys.readouterr().out  # a stopped run resumes by the same command


def test_a_rollback_to_a_step_the_run_has_not_reached_is_refused(tmp_path):
    """`ctl rollback 750` at step 75 (a typo for 75 or 50) restored the newest checkpoint, throwing
    the steps since away, since the newest "at or before 750" is the newest of all."""
    run, lines = FakeTrainer(tmp_path), []
    run.rollback = lambda to: pytest.fail(f"rolled back to {to}")
    run.control.request("rollback", on_done=lines.append, to=750)
    run.control.apply()
    assert lines == ["failed: rollback 750: the run is at step 3; name a step at or before it"]


def test_a_queued_run_length_the_run_has_passed_is_refused_when_sent(tmp_path):
    """`ctl --queue RUN total-steps 30` on a run whose newest checkpoint is step 61 was taken, and
    the resume that took it journaled it as failed ("would end pretraining before the current
    step"), the person long gone. It is refused as it is sent, naming the step the run resumes at."""
    (tmp_path / "config.yaml").write_text("")
    (tmp_path / "checkpoints" / "step_000061").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"total-steps 30: .* resumes at step 61 .*at least 61"):
        ctl.send(tmp_path, {"action": "set_total_steps", "params": {"steps": 30}}, queue=True)
    assert not (tmp_path / "control").exists()  # nothing dropped
    assert ctl.send(tmp_path, {"action": "set_total_steps", "params": {"steps": 90}}, queue=True).is_file()


def test_a_run_length_sent_in_the_finetune_phase_is_refused_when_sent(tmp_path):
    """`ctl RUN total-steps 50` at step 45 of debug 40 + finetune 30 was sent, then journaled as
    failed ("only during pretraining"), the person gone. Refused as sent, naming the phase."""
    (tmp_path / "config.yaml").write_text("")
    (tmp_path / "metrics.jsonl").write_text('{"step": 45, "phase": "finetune", "loss": 5.3}\n')
    with run_lock(tmp_path), pytest.raises(ConfigError, match=r"total-steps 50: .* finetune phase \(step 45"):
        ctl.send(tmp_path, {"action": "set_total_steps", "params": {"steps": 50}})
    assert not (tmp_path / "control").exists()  # nothing dropped


def test_a_longer_run_length_queued_for_a_completed_run_is_refused_naming_train(tmp_path):
    """`ctl --queue RUN total-steps 10` on a run completed at step 5 said 'queued: it applies when it
    resumes', but re-running its command trains nothing (the run is at its length) and only
    `trimtab train --max-steps N` resumes it, which the queued length then overrode (--max-steps 8
    trained to 10). Refused when sent, naming that command; a run stopped short of its length queues it."""
    (tmp_path / "config.yaml").write_text("")
    (tmp_path / "checkpoints" / "step_000005").mkdir(parents=True)
    write_summary(tmp_path, {"status": "completed", "step": 5, "total_steps": 5})
    longer = {"action": "set_total_steps", "params": {"steps": 10}}
    with pytest.raises(ConfigError, match=r"total-steps 10: .* has completed \(step 5 of 5\).*--max-steps 10"):
        ctl.send(tmp_path, longer, queue=True)
    assert not (tmp_path / "control").exists()  # nothing dropped
    write_summary(tmp_path, {"status": "stopped (SIGTERM)", "step": 5, "total_steps": 8})
    assert ctl.send(tmp_path, longer, queue=True).is_file()  # its resume takes it
