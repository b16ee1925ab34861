"""Where `trimtab eval` records its results: a run's PATH/eval as before, never inside a Hugging Face
directory (an export is uploaded to the Hub as it is: its eval/ folder went up with the weights),
`--out DIR` where given; the output says where they went."""

import json

import pytest

from trimtab import api
from trimtab.cli import main
from trimtab.hf import export_run

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = {"log": {"progress": False, "tensorboard": False}, "data": {"max_bytes": 150000, "seq_len": 64}}
TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 6


@pytest.fixture(scope="module")
def run_and_export(tmp_path_factory):
    """A 3-step debug run (context 64) and its export."""
    root = tmp_path_factory.mktemp("eval_polish")
    train = {"max_steps": 3, "eval_every": 0}
    api.train(preset="debug", out=str(root / "run"), train=train, model={"max_seq_len": 64}, **FAST)
    return root / "run", export_run(root / "run", root / "export")


@pytest.fixture
def notes(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text(TEXT)
    return str(path)


def test_an_exported_directory_stays_clean_and_its_results_go_to_eval_name_here(
    run_and_export, notes, tmp_path, monkeypatch, capsys
):
    """`trimtab eval EXPORT` wrote EXPORT/eval/<time>.json, into the folder uploaded to the Hub as is."""
    _, export = run_and_export
    before = sorted(p.name for p in export.iterdir())
    monkeypatch.chdir(tmp_path)
    assert main(["eval", str(export), "--data", notes]) == 0
    assert sorted(p.name for p in export.iterdir()) == before  # no eval/ inside the export
    [record] = (tmp_path / "eval" / export.name).glob("*.json")
    assert json.loads(record.read_text())["data"]["tokens"] > 0
    assert f"results in eval/{export.name}/" in capsys.readouterr().out


def test_eval_from_inside_an_exported_directory_is_refused_before_its_model_loads(
    run_and_export, notes, monkeypatch, capsys
):
    _, export = run_and_export
    monkeypatch.chdir(export)
    assert main(["eval", ".", "--data", notes]) == 2
    err = capsys.readouterr().err
    assert "inside the Hugging Face model directory" in err and "pass --out DIR" in err
    assert not (export / "eval").exists()


def test_out_takes_the_results_and_a_run_keeps_its_own_eval_folder_and_summary(run_and_export, notes, tmp_path, capsys):
    run, export = run_and_export
    out = tmp_path / "scores"
    assert main(["eval", str(export), "--data", notes, "--out", str(out)]) == 0
    assert len(list(out.glob("*.json"))) == 1 and f"results in {out}/" in capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert main(["eval", str(run), "--data", notes, "--out", str(out)]) == 0  # --out: the run left as it was
    assert len(list(out.glob("*.json"))) == 2 and not (run / "eval").exists()
    assert json.loads((run / "summary.json").read_text()) == summary
    assert main(["eval", str(run), "--data", notes]) == 0  # the default for a run: unchanged
    [record] = (run / "eval").glob("*.json")
    assert json.loads((run / "summary.json").read_text())["eval"] == json.loads(record.read_text())
    assert f"results in {run}/eval/" in capsys.readouterr().out
