"""A run the orchestrator gave up on before its first logged step (out of memory at one row with
every block recomputed, step 2 of a preset that logs every 5) has its decisions and summary.json
and no metrics.jsonl yet. Its report was refused at the run's end ("report.html not written
(NotARunError: ... it has no metrics.jsonl)") and again by the `trimtab report RUN` the console
told the person to run: the report a run that gave up needs most."""

from __future__ import annotations

import pytest

from trimtab.api import train
from trimtab.cli import main
from trimtab.report import NotARunError, write_report


def test_a_run_that_gave_up_before_its_first_logged_step_has_a_report(tmp_path, capsys):
    run = tmp_path / "run"
    summary = train(preset="debug", out=str(run), train={"max_steps": 8}, faults=["oom@2:20"])
    assert summary["exit_code"] == 3 and not (run / "metrics.jsonl").exists()
    (run / "summary.json").rename(run / "later.json")  # the report at the run's end comes before summary.json
    page = write_report([run], summary=summary).read_text()
    assert "gave up (out of memory with a micro-batch of one row" in page
    (run / "later.json").rename(run / "summary.json")
    (run / "report.html").unlink()
    assert main(["report", str(run)]) == 0  # and on request, as the console says
    assert "gave up (out of memory" in (run / "report.html").read_text()
    capsys.readouterr()


def test_a_directory_with_a_config_alone_is_still_no_run(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.yaml").write_text("preset: debug\n")
    with pytest.raises(NotARunError, match=r"half is not a run directory: it has no metrics.jsonl and no summary"):
        write_report([tmp_path / "half"])
