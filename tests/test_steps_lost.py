"""A SIGKILLed session's steps lost are exact at default settings: rank 0 marks each completed step
in RUN_DIR/goodput.step (one pwrite, no sync), which outlives the kill where goodput.json (every
second) and metrics.jsonl (every train.log_every) are behind."""

import re
import subprocess
import sys
import textwrap

from helpers import trimtab_cli
from trimtab.resilience.goodput import STEP_FILE, Ledger, read_mark
from trimtab.resilience.incidents import last_life, localize, reach_words
from trimtab.rundir import read_decisions, read_json

KILLED_AFTER_7 = """
    import os, signal, sys, time
    from trimtab.resilience.goodput import Ledger
    ledger = Ledger(sys.argv[1])
    ledger.open(float(sys.argv[2]), 3, 1, 0, 0.0)
    for step in range(4, 8):
        ledger.step(step, 0.01)  # goodput.json's own write is due at most once a second: still at step 3
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_last_completed_step_outlives_a_sigkill_and_is_exact(tmp_path):
    started = 1796000000.123456
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_AFTER_7), str(tmp_path), repr(started)])
    assert done.returncode == -9
    assert read_json(tmp_path / "goodput.json")["sessions"][0]["step"] == 3  # the ledger lags the kill
    assert read_mark(tmp_path, started)[0] == 7 and read_mark(tmp_path, started + 1.0) is None  # another session's
    life, step = last_life(tmp_path, started)
    evidence = localize(tmp_path, started, "session1")
    assert step == 7 and life >= started and evidence["step_exact"] is True
    assert reach_words({"step": step, "steps_lost": step - 5, **evidence}) == ("at step 7", "2 steps")
    # the next session's first step replaces the mark: until then the lost session's stays readable
    ledger = Ledger(tmp_path)
    ledger.open(started + 60.0, 5, 1, 0, life)
    assert read_mark(tmp_path, started)[0] == 7
    ledger.step(6, 0.01)
    assert read_mark(tmp_path, started) is None and read_mark(tmp_path, started + 60.0)[0] == 6
    ledger.close("completed")
    assert (tmp_path / STEP_FILE).stat().st_size == 64


def test_a_killed_run_journals_its_steps_lost_exactly_at_default_settings(tmp_path):
    """SIGKILL at step 9's start (log_every 10 by default: metrics.jsonl's newest line is older),
    resumed from the step-5 checkpoint: steps 6-8 were lost, said exactly in the journal and goodput.json."""
    run = tmp_path / "r"
    args = ["train", "--preset", "debug", "--out", str(run), "--max-steps", "12", "--set", "checkpoint.every=5"]
    args += ["--set", "log.progress=false", "--set", "train.eval_every=0", "--set", "data.max_bytes=150000"]
    assert trimtab_cli([*args, "--inject", "sigkill@9"], tmp_path).returncode == -9
    done = trimtab_cli(args, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    (restart,) = [d for d in read_decisions(run) if d["rule"] == "restart"]
    assert (restart["evidence"]["step"], restart["evidence"]["steps_lost"]) == (8, 3)
    assert restart["evidence"]["step_exact"] is True
    # where the data resumes too (data/position.py): the step alone does not say it on another world size
    said = r"at step 8; resumed at step 5 \(data at epoch 0, row [\d,]+ of [\d,]+\) on 1 rank \(3 steps lost,"
    assert re.search(said, restart["summary"]), restart["summary"]
    (incident,) = read_json(run / "goodput.json")["incidents"]
    assert (incident["steps_lost"], incident["step_exact"]) == (3, True)
