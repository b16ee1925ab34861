"""A rollback whose load fails part-way (a checkpoint file unreadable after it verified, a disk error,
a sharded read failing once the weights came in): Control said "failed" and training went on from the
target's weights with a fresh optimizer and the data from row 0 (issue). Now the state from before the
load is put back, the checkpoint set aside in checkpoints/corrupt/, the next older one tried; none: exit 3."""

import errno

import pytest
import torch
from safetensors.torch import load_file

import trimtab
from test_moe_training import moe_cfg
from test_orchestrator_loop import debug_cfg
from trimtab.checkpoint import list_checkpoints, save_checkpoint
from trimtab.checkpoint_load import load_checkpoint
from trimtab.distributed.parallel import Parallel
from trimtab.errors import CheckpointError
from trimtab.training import checkpointing
from trimtab.training.hooks import Hook


class RollbackAt6(Hook):
    """At step 6 asks for a rollback to step 4; records each step's weights and data position."""

    def __init__(self):
        self.done, self.seen = [], {}

    def on_step_end(self, run, out):
        self.seen.setdefault(run.step, []).append((run.weight_checksum(), run.data_position))
        if run.step == 6 and not self.done:
            run.control.request("rollback", on_done=self.done.append, to=4)


def optimizer_fails_once(monkeypatch, loaded):
    """A disk error reading step 4's optimizer state, its weights loaded by then (a sharded load's order)."""
    load = Parallel.load_optimizer

    def optimizer_fails(self, model, optimizer, optim_state, path):
        loaded.append(path.name)
        if len(loaded) == 1:
            raise OSError(errno.EIO, "Input/output error", str(path / "optim.pt"))
        return load(self, model, optimizer, optim_state, path)

    monkeypatch.setattr(Parallel, "load_optimizer", optimizer_fails)


def truncated_once_verified(monkeypatch, loaded):
    """Step 4's optim.pt truncated between its verification and its read (torch.load: RuntimeError)."""
    find = checkpointing.find_checkpoint

    def found_then_truncated(run_dir, to):
        found = find(run_dir, to)
        loaded.append(found[0].name)
        if len(loaded) == 1:
            optim = found[0] / "optim.pt"
            optim.write_bytes(optim.read_bytes()[:100])
        return found

    monkeypatch.setattr(checkpointing, "find_checkpoint", found_then_truncated)


@pytest.mark.parametrize("fault", [optimizer_fails_once, truncated_once_verified])
def test_a_failed_load_puts_the_state_back_and_rolls_back_to_the_next_older(tmp_path, monkeypatch, fault):
    loaded = []
    fault(monkeypatch, loaded)
    hook, run = RollbackAt6(), tmp_path / "r"
    summary = trimtab.train(debug_cfg(run, steps=8, checkpoint={"every": 4}), hooks=[hook])
    assert summary["status"] == "completed" and loaded == ["step_000004", "step_000000"]
    assert hook.done == ["rolled back from step 6 to step 0"]
    # the replay from step 0 is the first trajectory again: weights and rows, step by step
    assert all(first == again for first, again in (hook.seen[s] for s in range(1, 7)))
    assert [p.name for p in (run / "checkpoints" / "corrupt").iterdir()] == ["step_000004"]


def test_no_checkpoint_that_loads_stops_with_the_weights_it_had(tmp_path, monkeypatch):
    def optimizer_fails(self, model, optimizer, optim_state, path):
        raise OSError(errno.EIO, "Input/output error", str(path / "optim.pt"))

    monkeypatch.setattr(Parallel, "load_optimizer", optimizer_fails)
    hook, run = RollbackAt6(), tmp_path / "r"
    summary = trimtab.train(debug_cfg(run, steps=8, checkpoint={"every": 4}), hooks=[hook])
    assert summary["exit_code"] == 3 and summary["step"] == 6, summary
    assert "step_000004/optim.pt" in summary["status"] and "step_000000/optim.pt" in summary["status"]
    assert hook.done[0].startswith("failed: no checkpoint at or before step 4 loads for a rollback")
    assert list(hook.seen) == list(range(1, 7)), "no step trained after the failed rollback"
    # the resume point is step 6 as it was before the rollback, no checkpoint's weights mixed in
    assert [p.name for p in list_checkpoints(run)] == ["step_000006"]
    saved = load_file(str(run / "checkpoints" / "step_000006" / "model.safetensors"))
    assert sum(int(w.view(torch.int32).sum(dtype=torch.int64)) for w in saved.values()) == hook.seen[6][0][0]


def test_a_checkpoint_file_that_changed_since_it_verified_is_a_checkpoint_error_naming_it(tmp_path):
    path = save_checkpoint(tmp_path, 2, {"w": torch.ones(64)}, {"optimizer": {"state": {}}}, {"good": True}, keep=3)
    optim = path / "optim.pt"
    optim.write_bytes(optim.read_bytes()[:50])
    with pytest.raises(CheckpointError, match=r"step_000002/optim\.pt: unreadable \(RuntimeError"):
        load_checkpoint(path, verified=True)


def test_a_failed_load_across_expert_surgery_puts_the_experts_and_their_optimizer_back(tmp_path, monkeypatch):
    """Step 4's checkpoint has 8 experts in layer 1, the run 9 since step 5: the load resized the layer
    (new tensors) before it failed; the optimizer put back holds the tensors the model trains again."""

    def optimizer_fails(self, model, optimizer, optim_state, path):
        raise OSError(errno.EIO, "Input/output error", str(path / "optim.pt"))

    class Surgery(RollbackAt6):
        def on_step_end(self, run, out):
            self.seen.setdefault(run.step, []).append((run.weight_checksum(), run.moe_knobs(1)["n_experts"]))
            if run.step == 5:
                run.control.request("add_expert", layer=1)
            if run.step == 6 and not self.done:
                run.control.request("rollback", on_done=self.done.append, to=4)

        def on_train_end(self, run, summary):
            t = run._t  # the trainer: what the view does not show
            held = {id(p) for group in t.optimizer.param_groups for p in group["params"]}
            self.end = (
                run.weight_checksum(),
                run.moe_knobs(1)["n_experts"],
                held == {id(p) for p in t.model.parameters()},
            )

    monkeypatch.setattr(Parallel, "load_optimizer", optimizer_fails)
    hook = Surgery()
    summary = trimtab.train(moe_cfg(tmp_path / "r", steps=8, checkpoint={"every": 4}), hooks=[hook])
    assert summary["exit_code"] == 3 and hook.done[0].startswith("failed: no checkpoint"), hook.done
    assert hook.seen[6] == [(hook.end[0], 9)] and hook.end[1:] == (9, True)


class RollbackTo2(RollbackAt6):
    def on_step_end(self, run, out):
        if run.step == 6 and not self.done:
            run.control.request("rollback", on_done=self.done.append, to=2)


def test_the_checkpoints_a_rollback_that_loads_nothing_retired_are_put_back(tmp_path, monkeypatch):
    """Retired before each load (checkpoint.retire_after), the checkpoints after the target stayed in
    checkpoints/rolled_back/ when no load worked, though the run kept their trajectory: out of resume's
    sight, and never pruned again. They are its checkpoints again."""

    def optimizer_fails(self, model, optimizer, optim_state, path):
        raise OSError(errno.EIO, "Input/output error", str(path / "optim.pt"))

    monkeypatch.setattr(Parallel, "load_optimizer", optimizer_fails)
    run = tmp_path / "r"
    summary = trimtab.train(debug_cfg(run, steps=8, checkpoint={"every": 2}), hooks=[RollbackTo2()])
    assert summary["exit_code"] == 3 and summary["step"] == 6, summary
    assert "step_000004" in [p.name for p in list_checkpoints(run)]
    assert "step_000004" not in [p.name for p in (run / "checkpoints" / "rolled_back").glob("*")]
