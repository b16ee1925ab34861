"""A run taken up on a fresh machine from its checkpoint.dir, against a real S3 API server
(test_storage.py's): what a user meets when the machine a run trained on is gone."""

import shutil

import pytest

import trimtab
from trimtab.rundir import read_json

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
from test_hf_inputs import corpus, hf_tok, llama  # noqa: E402, F401  (a tiny Llama and its tokenizer)
from test_storage import bucket, debug_cfg, endpoint  # noqa: E402, F401  (the fixtures: a bucket on moto's server)


def test_a_completed_run_restored_from_the_bucket_is_not_journaled_as_a_lost_session(tmp_path, bucket):  # noqa: F811
    """A run that completed, its machine then gone, lengthened on a fresh one from the bucket: the
    ledger's first session ended on purpose, so no restart incident and no down time."""
    url, out = f"{bucket}/done", tmp_path / "a"
    assert trimtab.train(debug_cfg(out, steps=3, checkpoint={"dir": url}))["status"] == "completed"
    shutil.rmtree(out)
    trimtab.train(debug_cfg(out, steps=5, checkpoint={"dir": url}))
    ledger = read_json(out / "goodput.json")
    assert [s["end"] for s in ledger["sessions"]] == ["completed", "completed"]
    assert ledger["incidents"] == []


def test_a_run_of_a_hugging_face_model_resumes_from_the_bucket_with_the_model_directory_gone(tmp_path, bucket, hf_tok):  # noqa: F811
    """Its tokenizer_config.json (the tokenizer is the model's, read as theirs) and hf_source.json
    (the model it was made from) were not uploaded: the fresh machine read the tokenizer as
    trimtab's own and refused it; and with them restored, the config's preset sizes were compared
    with the bucket's run before the model was known ("another model")."""
    model_dir = llama(tmp_path / "hf", hf_tok)
    url, out = f"{bucket}/hf-run", tmp_path / "run"

    def train(steps):
        return trimtab.train(
            debug_cfg(
                out,
                steps=steps,
                train={"init_from": str(model_dir), "batch_tokens": 256, "micro_batch_tokens": 256},
                data={"source": str(corpus(tmp_path)), "seq_len": 32},
                checkpoint={"dir": url, "every": 1},
            )
        )

    assert train(2)["status"] == "completed"
    shutil.rmtree(out)
    shutil.rmtree(model_dir)
    summary = train(3)
    assert (summary["status"], summary["step"]) == ("completed", 3)
    assert (out / "hf_source.json").is_file() and (out / "tokenizer_config.json").is_file()
