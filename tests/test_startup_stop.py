"""A SIGTERM in a session's start-up (training/services/signals.py) at the awkward moments: on a run
that has already finished, and while rank 0 waits in init_process_group for a peer (cluster5)."""

import json
import os
import signal

import pytest

from trimtab.rundir import write_summary
from trimtab.training.services.signals import StartUpInterrupted, handle_signals


def stopped_in_start_up(run_dir, length):
    """summary.json after a SIGTERM in the start-up of a session asking for `length` steps."""
    with pytest.raises(StartUpInterrupted), handle_signals(run_dir=run_dir, lengths=[length]):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode: here
    return json.loads((run_dir / "summary.json").read_text())


def test_a_start_up_sigterm_keeps_a_finished_runs_summary_and_not_one_asked_to_train_longer(tmp_path):
    """It replaced "completed" with "stopped (SIGTERM during start-up)": the Slurm script queued the
    finished job once more (it ended at once) and the run's record said it had stopped."""
    (tmp_path / "checkpoints" / "step_000012").mkdir(parents=True)
    finished = {"status": "completed", "step": 12, "total_steps": 12, "val_loss": 4.5}
    write_summary(tmp_path, finished)
    assert stopped_in_start_up(tmp_path, 12) == finished
    longer = stopped_in_start_up(tmp_path, 20)  # relaunched to train on: queued again to resume
    assert (longer["status"], longer["step"], longer["resumable"]) == ("stopped (SIGTERM during start-up)", 12, True)


def test_a_start_up_sigterm_keeps_the_summary_of_a_run_the_live_planner_shortened(tmp_path):
    """A run of 20 steps the live planner ended at 12 (set_total_steps: length_delta -8, in its
    checkpoint's state.json) completed; its relaunch with the same config, stopped in start-up,
    replaced "completed" by "stopped (SIGTERM during start-up)": by the config's 20 it was unfinished.
    Another train.max_steps is the run's length itself, as training/resume.py reads it."""
    from trimtab.rundir import write_json

    step = tmp_path / "checkpoints" / "step_000012"
    step.mkdir(parents=True)
    write_json(step / "state.json", {"train": {"step": 12, "length_delta": -8, "phase_steps": [20]}})
    finished = {"status": "completed", "step": 12, "total_steps": 12, "val_loss": 4.5}
    write_summary(tmp_path, finished)
    assert stopped_in_start_up(tmp_path, 20) == finished
    assert stopped_in_start_up(tmp_path, 30)["status"] == "stopped (SIGTERM during start-up)"  # 30 steps asked


def test_a_start_up_sigterm_on_a_finished_run_keeps_its_summary(tmp_path, monkeypatch):
    """The same through trimtab.train: the relaunch of a run finished at its length, stopped while it
    joins the process group (before it reads the checkpoint), leaves its summary.json as it was."""
    import trimtab
    from trimtab.training import setup as setup_py

    finished = {"status": "completed", "step": 3, "total_steps": 3, "val_loss": 4.5}
    write_summary(tmp_path, finished)

    def terminated_while_joining(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the handler runs at the line above")

    monkeypatch.setattr(setup_py.Parallel, "start", terminated_while_joining)
    stopped = trimtab.train(preset="debug", out=str(tmp_path), train={"max_steps": 3})
    assert stopped["status"] == "stopped (SIGTERM during start-up)"  # this call's own outcome
    assert json.loads((tmp_path / "summary.json").read_text()) == finished


@pytest.mark.distributed
def test_a_sigterm_while_rank_0_waits_for_a_peer_that_left_writes_the_start_up_summary(tmp_path):
    """Rank 0 of 2 blocked in init_process_group (its peer already gone: stopped in its own start-up)
    never ran its SIGTERM handler (the main thread waits in C++): torchrun's agent killed it later,
    no summary.json, and the Slurm script did not queue the preempted job again."""
    import socket
    import subprocess
    import sys
    import time

    from helpers import SRC, free_port

    port, run_dir = free_port(), tmp_path / "r"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC, "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    argv = [sys.executable, "-m", "trimtab", "train", "--preset", "debug", "--out", str(run_dir), "--max-steps", "1"]
    rank0 = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # its store listens: it waits for rank 1 in init_process_group
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    rank0.send_signal(signal.SIGTERM)
    try:
        err = rank0.communicate(timeout=20)[1]
    finally:
        rank0.kill()  # one still blocked (the fault) does not outlive the test
    summary = json.loads((run_dir / "summary.json").read_text())
    assert rank0.returncode == 143 and summary["status"] == "stopped (SIGTERM during start-up)", err[-2000:]
    assert "while waiting in init_process_group" in err
