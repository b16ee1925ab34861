"""A console whose reader goes away: `trimtab train ... 2>&1 | head -3` ended the run at its next progress line
(BrokenPipeError caught as a finished command: no summary, exit 0); the run trains to its end."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_a_run_whose_console_pipe_closes_trains_to_its_end(tmp_path):
    out = tmp_path / "r"
    sets = ["train.max_steps=12", "train.eval_every=0", "train.log_every=1", "train.precision=fp32"]
    sets += ["data.max_bytes=60000", "checkpoint.every=0", "log.tensorboard=false", "log.report=false"]
    command = [sys.executable, "-m", "trimtab", "train", "--preset", "debug", "--out", str(out)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command + [a for s in sets for a in ("--set", s)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    first = [proc.stdout.readline() for _ in range(2)]  # the reader takes two lines, then goes (head -2)
    proc.stdout.close()
    assert proc.wait(timeout=300) == 0 and all(first)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 12
