"""A run frozen by SIGSTOP (Ctrl-Z, a suspended job) holds its run directory's lock: a second
`trimtab train` there is refused, and the refusal says that the holder is stopped and how to
continue it (`trimtab ctl stop` alone, as it advised, is never read by a stopped process)."""

import os
import signal
import subprocess
import sys

import pytest

from trimtab.errors import RunStateError
from trimtab.runlock import run_lock

HOLD = "import sys, time; from pathlib import Path; from trimtab.runlock import run_lock\n" \
    "with run_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)"  # fmt: skip


def test_a_stopped_holder_is_named_as_stopped_with_how_to_continue_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunStateError) as running, run_lock(tmp_path):
            pass
        assert "it is stopped" not in str(running.value)
        os.kill(holder.pid, signal.SIGSTOP)
        with pytest.raises(RunStateError, match=f"it is stopped .*`kill -CONT {holder.pid}`"), run_lock(tmp_path):
            pass
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
