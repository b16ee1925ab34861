"""A run's metrics.jsonl and decisions.jsonl holding lines trimtab did not write (a person's note
appended by hand, another tool's record, a field edited to null): the resume crashed on them
(TypeError comparing the step, KeyError on a decision's id) and so did `trimtab report`; now such
lines are left out by the readers and the resume goes on."""

import json

import pytest

from trimtab import api
from trimtab.cli import main
from trimtab.orchestrator.journal import Journal
from trimtab.rundir import healed, read_decisions, read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
FOREIGN = ['{"note": "lr changed by hand"}', '{"step": null, "loss": 3.0}', '{"step": "x", "id": "y", "rule": 3}']
TRAIN = {"eval_every": 0, "batch_tokens": 256, "micro_batch_tokens": 256}
LOG = {"progress": False, "tensorboard": False}


def append(path, lines):
    with open(path, "a") as fh:
        fh.write("".join(line + "\n" for line in lines))


def test_readers_leave_out_lines_without_a_whole_number_step_or_id(tmp_path):
    append(tmp_path / "metrics.jsonl", ['{"step": 5, "loss": 2.0}', *FOREIGN])
    append(tmp_path / "decisions.jsonl", [json.dumps({"id": 1, "step": 5, "rule": "spike"}), *FOREIGN])
    assert read_metrics(tmp_path) == [{"step": 5, "loss": 2.0}]
    assert [d["id"] for d in read_decisions(tmp_path, abandoned=True)] == [1]
    assert healed(read_decisions(tmp_path)) == 0  # int(None) raised in the report's summary row


def test_a_journal_resumes_past_foreign_lines(tmp_path):
    append(tmp_path / "decisions.jsonl", [json.dumps({"id": 1, "step": 5, "rule": "spike"}), *FOREIGN])
    journal = Journal(tmp_path / "decisions.jsonl")
    journal.load_state_dict([])  # KeyError: 'id' before
    assert [d["id"] for d in journal.dropped] == [1]


def test_a_run_with_foreign_metrics_and_journal_lines_resumes_and_reports(tmp_path):
    run = tmp_path / "run"
    api.train(preset="debug", out=str(run), train={**TRAIN, "max_steps": 2}, log=LOG)
    append(run / "metrics.jsonl", FOREIGN)
    append(run / "decisions.jsonl", FOREIGN)
    summary = api.train(preset="debug", out=str(run), train={**TRAIN, "max_steps": 3}, log=LOG)
    assert summary["step"] == 3
    assert [m["step"] for m in read_metrics(run)][-1] == 3
    assert main(["report", str(run)]) == 0
