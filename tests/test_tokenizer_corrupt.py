"""A corrupt tokenizer.json (cut short, or JSON that is no tokenizer) is refused naming the file,
saying it is corrupt and what is wrong, and the fix: restore it, or point data.tokenizer at a good
one; never tokenizers' own parser text (serde's "EOF while parsing ...")."""

import shutil

import pytest

import trimtab
from helpers import FAST, trimtab_cli
from trimtab.config import load_config
from trimtab.data.tokenizer import TextTokenizer
from trimtab.errors import DataError

# one worker for the module (--dist loadgroup): its module-scoped trained run is made once, not on each worker
pytestmark = pytest.mark.xdist_group("test_tokenizer_corrupt")

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
def trained(debug_run):
    return debug_run  # each test damages a copy


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


def test_a_corrupt_tokenizer_put_into_a_new_run_directory_is_called_the_users_not_the_runs(tokenizer, tmp_path):
    """A tokenizer.json a user put into a new run directory was refused as "the run's tokenizer ... it
    is the tokenizer this run trained with": no run had started there. It is named as the user's."""
    from trimtab.training.run_tokenizer import given_tokenizer, tokenizer_source

    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "new")})
    cfg.run_dir.mkdir()
    tokenizer.save(cfg.run_dir / "tokenizer.json")
    damage(cfg.run_dir / "tokenizer.json", "truncated")
    with pytest.raises(DataError) as refused:
        given_tokenizer(cfg, tokenizer_source(cfg))
    message = str(refused.value)
    assert message.startswith("the tokenizer.json put into the new run directory (no run has started there")
    assert_says(message, cfg.run_dir / "tokenizer.json", "truncated")
    assert "trained with" not in message and "fix or remove it" in message


def test_a_resume_whose_tokenizer_changed_the_vocabulary_names_the_tokenizer(tmp_path):
    """Resumed with another tokenizer (data.tokenizer, or RUN_DIR/tokenizer.json replaced), the refusal
    said only "a different model (model.vocab_size: 512 there, 48 now)": no model setting had changed."""
    import yaml

    from trimtab.errors import CheckpointError
    from trimtab.training.setup import check_resume_compatible

    run = {"out": str(tmp_path / "run")}
    saved = load_config(preset="debug", overrides={**run, "model": {"vocab_size": 512}})
    saved.run_dir.mkdir()
    (saved.run_dir / "config.yaml").write_text(yaml.safe_dump(saved.to_dict()))
    now = load_config(preset="debug", overrides={**run, "model": {"vocab_size": 48}, "data": {"tokenizer": "t.json"}})
    with pytest.raises(CheckpointError) as refused:
        check_resume_compatible(now, vocab=48)  # 48: the tokenizer's, which model.vocab_size 0 followed
    assert "model.vocab_size: 512 there, 48 now" in str(refused.value)
    assert "the one read now, data.tokenizer (t.json), has 48 tokens where the run's had 512" in str(refused.value)
    with pytest.raises(CheckpointError) as set_by_hand:  # the user's model.vocab_size: no tokenizer to blame
        check_resume_compatible(now, vocab=300)
    assert str(set_by_hand.value).endswith("may change on resume)") and "the one read now" not in str(set_by_hand.value)


def test_a_corrupt_tokenizer_given_to_data_prepare_offers_prepares_own_fix(tokenizer, tmp_path, capsys):
    """`trimtab data prepare --tokenizer BAD` offered a run's fix ("the copy in checkpoint.dir's store if
    the run has one"): prepare has no run; its fix is another --tokenizer, or none (a BPE is trained)."""
    from trimtab.cli import main

    path = tmp_path / "tok.json"
    tokenizer.save(path)
    damage(path, "truncated")
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x\n" * 50)
    args = ["data", "prepare", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "prepared"), "--tokenizer"]
    assert main([*args, str(path)]) == 2
    message = capsys.readouterr().err
    assert_says(message, path, "truncated")
    assert "point --tokenizer at a good tokenizer.json" in message and "checkpoint.dir" not in message


def test_a_prepared_directory_without_its_tokenizer_names_prepare_as_the_fix(tmp_path):
    """rm a prepared directory's tokenizer.json, then train on it: "does not exist; check the path" said
    nothing of the fix; running the same prepare again rebuilds the tokenizer the shards were made with."""
    from trimtab.data.prepare import prepare
    from trimtab.training.phase_data import build_phases

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 200)
    out = tmp_path / "prepared"
    prepare([str(tmp_path / "src")], out, vocab_size=300, workers=1)
    (out / "tokenizer.json").unlink()
    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "run"), "data": {"source": str(out)}})
    with pytest.raises(DataError) as err:
        build_phases(cfg, None)
    said = str(err.value)
    assert f"the tokenizer of {out} ({out / 'tokenizer.json'}) is missing" in said, said
    assert "run the same `trimtab data prepare` again over the same files" in said, said
