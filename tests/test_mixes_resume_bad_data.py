"""A run with bad data injected (bad_batch) and stopped resumes exactly: the resumed process
replaces its poisoned rows at its start, in sorted order, where the uninterrupted one replaced
them step by step in batch order. Packed rows share a token with their neighbour (row r is
stream[r*L : r*L + L + 1]), so writing the garbage into the shared stream made the data depend on
that order, and a resumed run trained on other tokens than the uninterrupted one (debug-moe,
bad_batch@20:2 + sigkill@60: losses apart from step 111 on, the final val_loss 4.0914 against 4.0912)."""

from __future__ import annotations

import numpy as np

from trimtab.api import train
from trimtab.data.packing import Rows
from trimtab.rundir import read_metrics


def packed_rows(n_rows: int = 4, length: int = 5) -> Rows:
    """Rows cut as pack_rows cuts them: each row's last token is the next row's first."""
    tokens = np.arange(n_rows * length + 1, dtype=np.int32)
    starts = np.arange(n_rows, dtype=np.int64) * length
    return Rows(tokens, np.ones(len(tokens), dtype=bool), starts, np.full(n_rows, length, dtype=np.int64))


def garbage(row: int) -> np.ndarray:
    return np.full(6, 100 + row)


def losses(run_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def test_replacing_neighbouring_rows_gives_the_same_rows_in_either_order():
    forward, backward = packed_rows(), packed_rows()
    for row in (1, 2):
        forward.replace(row, garbage(row))
    for row in (2, 1):
        backward.replace(row, garbage(row))
    for row in range(4):
        assert np.array_equal(forward.get(row)[0], backward.get(row)[0]), row
    assert forward.get(2)[0].tolist() == [102] * 6  # each replaced row holds its own tokens, whole
    assert forward.get(3)[0].tolist() == [15, 16, 17, 18, 19, 20]  # and the clean neighbour stays clean
    assert packed_rows().fingerprint() == forward.fingerprint()  # the data's digest is the data's own


def test_a_run_with_bad_data_stopped_and_resumed_trains_on_the_same_tokens(tmp_path):
    kw = {
        "preset": "debug",
        "train": {"max_steps": 16, "log_every": 1, "eval_every": 100},
        "data": {"max_bytes": 30000},  # ~140 rows: the poisoned ones recur every 5 steps
        "checkpoint": {"every": 4},
        "orchestrator": {"mode": "off"},  # the data under test, not the healing
    }
    train(out=str(tmp_path / "whole"), faults=["bad_batch@2:2"], **kw)
    stopped = ["bad_batch@2:2", "sigterm@6"]
    train(out=str(tmp_path / "resumed"), faults=stopped, **kw)
    assert train(out=str(tmp_path / "resumed"), faults=stopped, **kw)["status"] == "completed"
    whole, resumed = (losses(tmp_path / run) for run in ("whole", "resumed"))
    assert sorted(resumed) == list(range(1, 17))
    assert {s: resumed[s] for s in whole if resumed[s] != whole[s]} == {}
