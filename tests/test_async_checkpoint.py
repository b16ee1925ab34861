"""Checkpoints written in the background (checkpoint.asynchronous: DCP's async save): the state
copied to host memory at the step, written by a thread while training goes on. What is on disk is
exactly the synchronous save's, and a process killed while the thread writes leaves no checkpoint
that resumes wrongly: the one before it is the resume point and the run ends as undisturbed."""

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from helpers import FAST, assert_close, run_relaunched, trimtab_cli
from trimtab.checkpoint import latest_valid, list_checkpoints

STEPS = ["--max-steps", "12", "--set", "checkpoint.every=4", "--set", "checkpoint.keep=5"]
# FAST's small corpus slice and no TensorBoard (what these tests compare is the checkpoints), and no report
QUIET = [*FAST, "--set", "log.report=false"]


def train(out, *args: str):
    return trimtab_cli(["train", "--preset", "debug", "--out", str(out), *STEPS, *QUIET, *args], cwd=out.parent)


def tensors(checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor a one-process checkpoint holds: weights and AdamW's moments, by name."""
    found = {f"model.{k}": v for k, v in load_file(checkpoint / "model.safetensors").items()}
    optim = torch.load(checkpoint / "optim.pt", weights_only=True)["optimizer"]["state"]
    found |= {f"optim.{i}.{k}": v for i, s in optim.items() for k, v in s.items()}
    return found


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync") / "run"
    done = train(out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_a_background_checkpoint_holds_exactly_the_state_of_its_step(undisturbed, tmp_path):
    """Training goes on while the thread writes; the host copy taken at the step is what lands:
    every checkpoint equals the synchronous run's, bit for bit."""
    out = tmp_path / "async"
    done = train(out, "--set", "checkpoint.asynchronous=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name for p in list_checkpoints(out)] == [p.name for p in list_checkpoints(undisturbed)]
    for ours, theirs in zip(list_checkpoints(out), list_checkpoints(undisturbed)):
        a, b = tensors(ours), tensors(theirs)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), ours.name


def test_a_process_killed_while_its_checkpoint_is_written_resumes_from_the_one_before(undisturbed, tmp_path):
    """kill_in_save@8: SIGKILL while the background thread writes step 8 (its files written, not
    committed). No step_000008 exists; the same command resumes from step 4 and ends with the
    undisturbed run's weights and moments."""
    out = tmp_path / "killed"
    args = ("--set", "checkpoint.asynchronous=true", "--inject", "kill_in_save@8")
    done = train(out, *args)
    assert done.returncode == -9, done.stderr[-3000:]
    assert [p.name for p in list_checkpoints(out)] == ["step_000000", "step_000004"]
    assert list((out / "checkpoints").glob(".tmp_step_000008_*"))  # the write it stopped
    again = train(out, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr and "step_000004" in again.stderr
    assert latest_valid(out)[0].name == "step_000012" and not list((out / "checkpoints").glob(".tmp*"))
    a, b = tensors(out / "checkpoints" / "step_000012"), tensors(undisturbed / "checkpoints" / "step_000012")
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_an_fsdp2_rank_killed_in_its_background_write_resumes_as_undisturbed(fsdp, tmp_path):
    """FSDP2 on 2 ranks, asynchronous: rank 1 is killed in its writer thread while step 5's
    shards are being written; rank 0 trains on until its next collective fails; the job started
    again resumes from step 0 (step 5 was never committed) and ends as the undisturbed run."""
    out = tmp_path / "killed"
    overrides = {"distributed": {"strategy": "fsdp"}, "checkpoint": {"every": 5, "asynchronous": True}}
    records, launches = run_relaunched(out, 2, faults=["kill_in_save@5:1"], **overrides)
    assert launches == 2 and not (out / "checkpoints" / ".tmp_step_000005_sharded").exists()
    for ours, theirs in zip(records, fsdp[1]):
        assert [s["rows"] for s in ours["steps"]] == [s["rows"] for s in theirs["steps"]]
        assert_close(ours["weights"], theirs["weights"], rel=1e-5)
