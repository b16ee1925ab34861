"""Config files a user really passes by mistake: one that is not UTF-8 (a Latin-1 save, a binary
given in its place) and a directory (a run directory, given to resume it)."""

import pytest

from trimtab.cli import main
from trimtab.config import load_config
from trimtab.errors import ConfigError
from trimtab.tune.space import load_space


@pytest.mark.parametrize(
    "content, line",
    [
        ("preset: debug\ntrain:\n  max_steps: 3\n# caf\xe9\n".encode("latin-1"), 4),  # a Latin-1 editor's save
        (b"\x80\x02}q\x00(X\x05\x00\x00\x00model", 1),  # a pickle (.pt) given as the config
    ],
)
def test_a_config_that_is_not_utf8_is_refused_naming_its_line_and_the_fix(tmp_path, content, line):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"run\.yaml:{line}: not UTF-8 text .*save it as UTF-8"):
        load_config(path)


def test_a_tune_space_that_is_not_utf8_is_refused_naming_it(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_bytes("study: {name: caf\xe9}\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"space\.yaml:1: not UTF-8 text"):
        load_space(path)


def test_a_config_with_a_utf8_bom_is_read(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"\xef\xbb\xbfpreset: debug\ntrain:\n  max_steps: 7\n")
    assert load_config(path).train.max_steps == 7


def test_a_run_directory_given_as_the_config_says_how_to_resume_it(tmp_path, capsys):
    """It said "does not exist" of a directory that is there."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("preset: debug\n")
    assert main(["train", str(run)]) == 2
    err = capsys.readouterr().err
    assert "is a directory, not a YAML file" in err and f"pass its config: {run / 'config.yaml'}" in err
    assert "does not exist" not in err
    with pytest.raises(ConfigError, match="is a directory, not a YAML file; pass a YAML config file"):
        load_config(tmp_path)


@pytest.mark.parametrize("source", ["", " ", [], ["README.md", ""]])
def test_an_empty_data_source_is_refused_not_read_as_the_current_directory(source):
    """`--set data.source=$DATA` with $DATA unset: the empty name walked the current directory
    and trained on whatever was in it (or failed on some file there)."""
    with pytest.raises(ConfigError, match=r"'data.source' must name the data, got .*a file, a directory"):
        load_config(preset="debug", overrides={"data": {"source": source}})


def test_a_run_whose_config_yaml_got_a_bad_byte_resumes_and_generate_names_it(tmp_path, capsys):
    """A disk fault in the run's own config.yaml: a UnicodeDecodeError traceback on resume and in
    generate before; the resume now checks the model against the checkpoint, as for bad YAML."""
    from trimtab import api

    run = tmp_path / "run"
    small = {"eval_every": 0, "batch_tokens": 256, "micro_batch_tokens": 256}
    log = {"progress": False, "tensorboard": False}
    api.train(preset="debug", out=str(run), train={**small, "max_steps": 2}, log=log)
    with open(run / "config.yaml", "ab") as fh:
        fh.write(b"# \xe9\xff\n")
    assert main(["generate", str(run), "--prompt", "x", "--max-new-tokens", "2"]) == 2
    assert "config.yaml:" in capsys.readouterr().err
    assert api.train(preset="debug", out=str(run), train={**small, "max_steps": 3}, log=log)["step"] == 3
