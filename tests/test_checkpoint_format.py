"""Checkpoints record their format (state.json "format"): this code's is written on save and read
back; one written before formats were recorded loads as before; one from a newer trimtab is
refused naming the checkpoint, its format, this code's, and the fix (upgrade trimtab), and is
never taken for corrupt (set aside, or passed over for an older one a run would train back from)."""

import json

import pytest
import torch

import trimtab
from trimtab.checkpoint import FORMAT, NewerCheckpointError, _sealed, find_checkpoint, latest_valid, save_checkpoint
from trimtab.checkpoint_load import load_checkpoint
from trimtab.config import load_config
from trimtab.errors import CheckpointError


def save(run_dir, step: int):
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    return save_checkpoint(run_dir, step, weights, {"optimizer": {}}, {"train": {"step": step}}, keep=5)


def rewrite_state(path, change) -> None:
    """state.json as another trimtab would have written it: `change`d, then sealed again (valid)."""
    state = json.loads((path / "state.json").read_text())
    change(state)
    state["manifest"].pop("state.json")
    (path / "state.json").write_text(json.dumps(_sealed(state)))


def test_the_format_is_written_and_read_back(tmp_path):
    path = save(tmp_path, 4)
    assert json.loads((path / "state.json").read_text())["format"] == FORMAT >= 1
    weights, _, state = load_checkpoint(path)
    assert state["format"] == FORMAT and state["step"] == 4 and torch.equal(weights["w"], torch.arange(6.0).view(2, 3))
    assert latest_valid(tmp_path)[0] == path


def test_a_checkpoint_without_a_format_loads_as_before(tmp_path):
    path = save(tmp_path, 4)
    rewrite_state(path, lambda state: state.pop("format"))
    _, _, state = load_checkpoint(path)
    assert "format" not in state and state["train"] == {"step": 4}
    assert latest_valid(tmp_path)[0] == path and find_checkpoint(tmp_path, 4)[0] == path


def test_a_checkpoint_of_a_newer_format_is_refused_with_the_fix_and_kept(tmp_path):
    older, newer = save(tmp_path, 4), save(tmp_path, 8)
    rewrite_state(newer, lambda state: state.update(format=FORMAT + 1, renamed_key={"x": 1}))
    with pytest.raises(NewerCheckpointError) as refused:
        load_checkpoint(newer)
    message = str(refused.value)
    assert message.startswith(f"{newer}: checkpoint format {FORMAT + 1} is newer than this trimtab's")
    assert f"({trimtab.__version__}: format {FORMAT} and older)" in message and "upgrade trimtab" in message
    for find in (lambda: latest_valid(tmp_path), lambda: find_checkpoint(tmp_path, 8)):
        with pytest.raises(NewerCheckpointError):  # not skipped for step 4 as a corrupt one would be
            find()
    assert find_checkpoint(tmp_path, 4)[0] == older  # a rollback to before it is still possible
    assert isinstance(refused.value, CheckpointError)  # exit 2, the user-facing error


def test_resuming_a_run_whose_checkpoint_is_newer_stops_and_leaves_it_in_place(tmp_path):
    """`trimtab train` resuming (an older trimtab on a newer run): the error, nothing set aside."""
    cfg = {"out": str(tmp_path / "run"), "train": {"max_steps": 2, "eval_every": 0}, "data": {"max_bytes": 50_000}}
    cfg["log"] = {"progress": False, "tensorboard": False, "report": False}
    trimtab.train(load_config(preset="debug", overrides=cfg))
    (newest,) = [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name == "step_000002"]
    rewrite_state(newest, lambda state: state.update(format=FORMAT + 1))
    cfg["train"]["max_steps"] = 4
    with pytest.raises(NewerCheckpointError, match="upgrade trimtab"):
        trimtab.train(load_config(preset="debug", overrides=cfg))
    assert newest.is_dir() and not (tmp_path / "run" / "checkpoints" / "corrupt").exists()


def test_the_version_has_moved_on():
    assert trimtab.__version__ != "0.1.0" and tuple(map(int, trimtab.__version__.split("."))) >= (0, 2, 0)
