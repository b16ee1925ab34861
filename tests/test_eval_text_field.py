"""`trimtab eval --data FILE` reads the file as the run's training read it: a run trained on JSONL
whose text is under another field (data.text_field=body) scores that same file, and `--set data.*`
says how to read it, for a Hugging Face directory too (before: always the `text` field, the error
told the user to set data.text_field, and --set was ignored for a run, refused for an export)."""

import json

import pytest

from trimtab import api
from trimtab.errors import ConfigError, DataError
from trimtab.evaluation import evaluate
from trimtab.hf import export_run

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 40


@pytest.fixture(scope="module")
def body_run(tmp_path_factory):
    """A 1-step debug run trained on JSONL records whose text is under `body`, and the file."""
    root = tmp_path_factory.mktemp("body")
    data = root / "notes.jsonl"
    data.write_text("".join(json.dumps({"body": TEXT[i:] + str(i), "id": i}) + "\n" for i in range(30)))
    out = root / "run"
    api.train(
        preset="debug",
        out=str(out),
        train={"max_steps": 1, "eval_every": 0, "batch_tokens": 256, "micro_batch_tokens": 256},
        data={"source": str(data), "text_field": "body", "seq_len": 64},
        log={"progress": False, "tensorboard": False},
    )
    return out, data


def test_a_run_scores_the_jsonl_it_trained_on_by_its_own_text_field(body_run):
    run, data = body_run
    scored = evaluate(run, data=str(data))["data"]
    assert scored["documents"] == 30 and scored["bytes"] > len(TEXT) * 10
    with pytest.raises(DataError, match="found 'body', 'id'"):  # --set over the run's config is obeyed
        evaluate(run, data=str(data), sets=["data.text_field=text"])


def test_a_hugging_face_directory_takes_set_data_keys_but_not_model_keys(body_run, tmp_path):
    run, data = body_run
    export_run(run, tmp_path / "hf")
    with pytest.raises(DataError, match="data.text_field=body"):  # an export knows no field: `text`
        evaluate(tmp_path / "hf", data=str(data))
    scored = evaluate(tmp_path / "hf", data=str(data), sets=["data.text_field=body"])["data"]
    assert scored["documents"] == 30
    assert scored["tokens"] == evaluate(run, data=str(data))["data"]["tokens"]  # the same tokenizer
    with pytest.raises(ConfigError, match="--set model.max_seq_len=128: .* Hugging Face model directory"):
        api.load_run_at(tmp_path / "hf", ["data.text_field=body", "model.max_seq_len=128"])
