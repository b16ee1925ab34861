"""An --out that is a data source directory (or a Hugging Face model directory) is refused before
anything is written: before, the first session trained into the user's corpus folder and every
resume then read the run's own metrics.jsonl as training records (a DataError: the run could not
go on)."""

import re

import pytest

from trimtab import api
from trimtab.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 200
ONE_STEP = {"max_steps": 1, "eval_every": 0, "batch_tokens": 256, "micro_batch_tokens": 256}


@pytest.mark.parametrize(
    "key, data",
    [
        ("data.source", lambda d: {"source": d}),
        ("data.mix[1].source", lambda d: {"mix": [{"source": "builtin", "weight": 1}, {"source": d, "weight": 1}]}),
        ("data.eval_source", lambda d: {"eval_source": [d]}),
    ],
)
def test_an_out_that_is_a_source_directory_is_refused_and_left_as_it_was(tmp_path, key, data):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(TEXT)
    with pytest.raises(ConfigError, match=rf"out '.*corpus' is {re.escape(key)} .*give --out another"):
        api.train(preset="debug", out=str(corpus), train=ONE_STEP, data={"seq_len": 64, **data(str(corpus))})
    assert sorted(p.name for p in corpus.iterdir()) == ["a.txt"]


def test_an_out_beside_the_source_trains(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(TEXT)
    data = {"source": str(corpus), "seq_len": 64}
    summary = api.train(preset="debug", out=str(tmp_path / "run"), train=ONE_STEP, data=data)
    assert summary["status"] == "completed"


def test_an_out_that_is_a_hugging_face_directory_is_refused_naming_init_from(tmp_path):
    """Before, `--out hf/base` trained a new model from scratch beside the export's weights (never
    reading them) and `from_pretrained(hf/base)` went on loading the stale export."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"Hugging Face model directory.*train.init_from=.*hf with a new --out"):
        api.train(preset="debug", out=str(hf_dir), train=ONE_STEP, data={"seq_len": 64})
    assert sorted(p.name for p in hf_dir.iterdir()) == ["config.json"]
