"""`trimtab rl` / `trimtab dpo` with train.init_from set to a directory that holds no model (a run
that never saved, an empty directory): the error names the key's value and what it lacks. It had
said "the tokenizer ... is unknown; set train.init_from", the key the user had set."""

import pytest

from helpers import trimtab_cli


@pytest.mark.parametrize("command", ["rl", "dpo"])
def test_an_init_from_without_a_model_is_named(tmp_path, command):
    empty = tmp_path / "never-saved"
    empty.mkdir()
    (empty / "config.yaml").write_text("model: {}\n")  # a run killed before its first save
    args = ["--preset", "debug", "--out", str(tmp_path / "out"), "--max-steps", "1"]
    done = trimtab_cli([command, *args, "--set", f"train.init_from={empty}"], tmp_path)
    assert done.returncode == 2
    assert f"'train.init_from' = '{empty}'" in done.stderr and "set train.init_from" not in done.stderr
    assert str(empty / "tokenizer.json") in done.stderr  # what it looked for


def test_init_from_another_model_suggests_the_command_that_was_run(tmp_path, debug_run):
    """An RL or DPO run from weights of another model: the command suggested is `trimtab rl` /
    `trimtab dpo` with that run's config (it said `trimtab train`, which drops the RL / DPO section
    and would train the model on text instead)."""
    base = debug_run  # debug; debug-moe has other layers
    for command in ("rl", "dpo"):
        args = ["--preset", "debug-moe", "--out", str(tmp_path / command), "--max-steps", "1"]
        done = trimtab_cli([command, *args, "--set", f"train.init_from={base}"], tmp_path)
        assert done.returncode == 2 and "holds another model than this run's" in done.stderr
        assert f"trimtab {command} {base / 'config.yaml'} --set train.init_from={base} --out DIR" in done.stderr
