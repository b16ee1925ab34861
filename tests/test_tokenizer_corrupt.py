"""A corrupt tokenizer.json (cut short, or JSON that is no tokenizer) is refused naming the file,
saying it is corrupt and what is wrong, and the fix: restore it, or point data.tokenizer at a good
one; never tokenizers' own parser text (serde's "EOF while parsing ...")."""

import shutil

import pytest

import trimtab
from helpers import FAST, base_run, trimtab_cli
from trimtab.config import load_config
from trimtab.data.tokenizer import TextTokenizer
from trimtab.errors import DataError

NOT_A_TOKENIZER = '{"hello": 1, "vocab": ["a", "b"]}'
RUST = ("EOF while parsing", "expected `,`", "expected value", "Missing vocab", "Model missing")


def damage(path, how: str) -> None:
    """Cut `path` short (a write that never finished) or replace it with JSON that is no tokenizer."""
    text = path.read_text()
    path.write_text(text[: len(text) // 3] if how == "truncated" else NOT_A_TOKENIZER)


def assert_says(message: str, path, how: str) -> None:
    assert f"'{path}' is corrupt or unreadable" in message, message
    what = "not valid JSON (cut short" if how == "truncated" else "JSON but not a tokenizer"
    assert what in message and not any(text in message for text in RUST), message


@pytest.mark.parametrize("how", ["truncated", "not_a_tokenizer"])
def test_a_corrupt_data_tokenizer_names_the_file_and_the_fix(tokenizer, tmp_path, how):
    path = tmp_path / "tok.json"
    tokenizer.save(path)
    damage(path, how)
    with pytest.raises(DataError) as refused:
        TextTokenizer.load(path, key="data.tokenizer")
    message = str(refused.value)
    assert message.startswith("data.tokenizer ") and "point data.tokenizer at a good tokenizer.json" in message
    assert_says(message, path, how)
    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "run"), "data": {"tokenizer": str(path)}})
    with pytest.raises(DataError) as training:  # `trimtab train` with it: the same words
        trimtab.train(cfg)
    assert str(training.value) == message


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return base_run(tmp_path_factory.mktemp("corrupt") / "run")


@pytest.mark.parametrize("how", ["truncated", "not_a_tokenizer"])
def test_a_runs_corrupt_tokenizer_is_refused_by_generate_the_api_and_a_resume(trained, tmp_path, how):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    path = run / "tokenizer.json"
    damage(path, how)
    with pytest.raises(DataError) as api:
        trimtab.load_run(run)
    assert_says(str(api.value), path, how)
    assert "restore a good copy of it" in str(api.value)
    said = trimtab_cli(["generate", str(run), "--prompt", "hi", "--max-new-tokens", "2"], tmp_path)
    assert said.returncode == 2 and f"'{path}' is corrupt or unreadable" in said.stderr, said.stderr[-2000:]
    resumed = trimtab_cli(["train", "--preset", "debug", "--out", str(run), "--max-steps", "3", *FAST], tmp_path)
    assert resumed.returncode == 2, resumed.stderr[-2000:]
    assert_says(resumed.stderr, path, how)
    assert "the run's tokenizer" in resumed.stderr and "restore it" in resumed.stderr
