"""What a person sees of a run in report.html and `trimtab runs`, checked on run directories written
by hand (no training): a run before its first log line, decision markers on the loss curve, two
decisions at one step, the summary table's wording."""

import json
from pathlib import Path

import pytest

from trimtab.report import figures, markers, write_report
from trimtab.report.page import SUMMARY, summary_row
from trimtab.report.run import read_run
from trimtab.report.runs import list_runs
from trimtab.runlock import run_lock


def _run(path: Path, steps: tuple[int, ...] = (5, 10, 15), decisions: list[dict] | None = None) -> Path:
    """A run's files as trimtab writes them: log lines every 5 steps, a journal."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"preset: debug\nout: {path}\n")
    lines = [{"step": s, "loss": 6.0 - 0.1 * s, "tokens": 100 * s} for s in steps]
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (path / "decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decisions or []))
    return path


def _decision(step: int, rule: str, action: str, mode: str = "auto") -> dict:
    return {"id": step, "step": step, "rule": rule, "action": action, "mode": mode, "outcome": {"result": "recovered"}}


def test_a_run_before_its_first_log_line_is_listed_and_reported(tmp_path):
    """A run in its first train.log_every steps (or killed in them) has config.yaml, decisions.jsonl and
    its lock, no metrics.jsonl yet: `trimtab runs` left it out while it trained and `trimtab report`
    refused it as not a run directory."""
    run = tmp_path / "live"
    run.mkdir()
    (run / "config.yaml").write_text(f"preset: debug\nout: {run}\n")
    (run / "decisions.jsonl").write_text("")
    with run_lock(run):
        rows = list_runs(tmp_path)
        assert [(r["run"], r["status"]) for r in rows] == [("live", "running")]
        page = write_report([run], tmp_path / "live.html").read_text()
        assert ">running (locked by pid" in page
    assert [r["status"] for r in list_runs(tmp_path)] == ["failed"]  # killed before it logged a step


def test_decision_markers_sit_on_the_loss_curve_between_logged_steps(tmp_path):
    """Decisions between two logged steps (log_every 5) were drawn at the nearest logged step's loss:
    a staircase of markers off the line. Next to a NaN (a gap) the nearest finite loss stays."""
    run_dir = _run(tmp_path / "r", decisions=[_decision(7, "spike", "skip_data"), _decision(9, "data", "skip_data")])
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 20, "loss": float("nan"), "tokens": 2000}) + "\n")
    marks = {t.name: t for t in figures.loss([read_run(run_dir)]).data}["decision: skip_data"]
    assert list(marks.y) == pytest.approx([6.0 - 0.7, 6.0 - 0.9])  # on the line from step 5 to step 10
    on_curve = markers._value_at(read_run(run_dir), "loss")
    assert on_curve(18) == pytest.approx(6.0 - 1.5) and on_curve(10) == pytest.approx(5.0)


def test_decisions_at_one_step_each_name_the_others(tmp_path):
    """An out-of-memory fix and a person's `trimtab ctl scale-lr` at step 10 were drawn on one point:
    hover showed the top marker's alone, the LR cut could not be found on the plot."""
    journal = [_decision(10, "oom", "set_micro_batch_tokens"), _decision(10, "manual", "scale_lr", "manual")]
    run = read_run(_run(tmp_path / "r", decisions=[*journal, _decision(15, "lr", "scale_lr")]))
    traces = {t.name: t for t in figures.loss([run]).data}
    oom, lr = traces["decision: set_micro_batch_tokens"], traces["decision: scale_lr"]
    assert (oom.x[0], oom.y[0]) == (lr.x[0], lr.y[0])
    assert "also at step 10" in oom.hovertext[0] and "manual -&gt; scale_lr (manual)" in oom.hovertext[0]
    assert "oom -&gt; set_micro_batch_tokens" in lr.hovertext[0]
    assert "also at step" not in lr.hovertext[1]  # step 15 is alone


def test_the_summary_says_faults_healed_not_decisions_healed(tmp_path):
    """'12 (2)' under 'decisions (healed)' read as 2 of the 12 decisions healed, every one of which had
    recovered: the 2 are incidents (rundir.healed), the runs table's 'faults healed'."""
    journal = [_decision(s, "data", "skip_data") for s in (6, 7, 8)] + [_decision(5, "spike", "skip_data")]
    run = read_run(_run(tmp_path / "r", decisions=[{**d, "family": "data"} for d in journal]))
    column = SUMMARY.index("decisions (faults healed)")
    assert summary_row(run)[column] == "4 (1)"
    assert list_runs(tmp_path)[0]["healed"] == 1


def test_the_decisions_table_says_when_an_outcome_rests_on_fewer_steps_or_a_thrown_away_branch(tmp_path):
    """An RL rule's decision one step before the run ended was judged "recovered" on that one step, the
    trouble still there; a skipped step's "not recovered" was the branch a rollback threw away. The
    table showed both bare, as if measured over orchestrator.outcome_after steps of the kept run."""
    early = {**_decision(14, "rl_signal", "set_dynamic_sampling"), "outcome": {"result": "recovered", "steps": 1}}
    early["outcome"]["loss_after"] = 0.0
    cut = {**_decision(9, "nonfinite", "skip_step"), "outcome": {"result": "not recovered", "steps": 2}}
    cut["outcome"] |= {"loss_after": float("nan"), "rolled_back": True}
    full = {**_decision(6, "lr", "scale_lr"), "outcome": {"result": "recovered", "steps": 20, "loss_after": 5.0}}
    run_dir = _run(tmp_path / "r", decisions=[full, cut, early])
    (run_dir / "config.yaml").write_text(f"preset: debug\nout: {run_dir}\norchestrator: {{outcome_after: 20}}\n")
    page = write_report([run_dir], tmp_path / "r.html").read_text()
    assert "<td>recovered (on 1 of the 20 steps it is judged on: the run ended first)</td>" in page
    assert "<td>not recovered (judged on the branch a rollback then threw away)</td>" in page
    assert "<td>recovered</td>" in page  # judged on all 20 steps: said as the journal has it


def test_a_decisions_evidence_reads_with_its_quotes_in_the_hover(tmp_path):
    """The hover box showed every JSON evidence as {&quot;kind&quot;: &quot;oom&quot;, ...}: plotly's
    hover decodes &lt; &gt; &amp; and numeric entities, not &quot; (seen in chromium). A < is still
    escaped (it would start a tag)."""
    oom = {**_decision(10, "oom", "set_micro_batch_tokens"), "evidence": {"kind": "oom", "error": "1024 > 1023 <fit>"}}
    hover = figures.loss([read_run(_run(tmp_path / "r", decisions=[oom]))]).data[-1].hovertext[0]
    assert '"kind": "oom"' in hover and "&quot;" not in hover
    assert "&lt;fit&gt;" in hover and "<fit>" not in hover


def test_runs_linked_into_a_folder_are_listed_once_and_a_link_loop_ends(tmp_path):
    """`trimtab runs DIR` found nothing under a folder whose runs are symlinks (os.walk does not
    follow them); followed, a link back up the tree must not loop."""
    real = _run(tmp_path / "store" / "a")
    linked = tmp_path / "mine"
    linked.mkdir()
    (linked / "a").symlink_to(real, target_is_directory=True)
    (linked / "up").symlink_to(linked, target_is_directory=True)  # a loop
    assert [r["run"] for r in list_runs(linked, "run")] == ["a"]
