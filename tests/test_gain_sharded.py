"""The update gain (training/gain.py) where the ranks hold the model between them: FSDP2 and tensor
parallelism on CPU (gloo, one thread per process) against one process on the same rows.

Both the measured run (tests/dist_worker.py's recorder asks for the gain every step and records it:
`measure_gain`) and the unmeasured one it must match bit for bit go through tests/helpers.py `run`:
ranks forked by the fork server. They were fresh interpreters, each importing torch: the two
tests spent 52 s of CPU, now 23 with the fork server's start-up (2026-12-02, a loaded host).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import trimtab
from helpers import assert_close, config, final_weights, run
from trimtab.config import load_config
from trimtab.training.hooks import Hook

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
    pytest.mark.usefixtures("one_thread"),
    # process groups: on their worker (tests/conftest.py PROCESS_GROUPS), one job at a time on the
    # cores, and `one_process` trained once, not on both workers
    pytest.mark.xdist_group("process_groups"),
]
STEPS = 4
# the hook alone asks for the gain: the orchestrator's rules would act on what they read
QUIET = {"train": {"max_steps": STEPS}, "orchestrator": {"mode": "off"}}


class Gains(Hook):
    """Asks for the gain every step; records it and the loss."""

    def __init__(self) -> None:
        self.gains: list[float | None] = []
        self.losses: list[float] = []

    def measure_gain(self, run) -> bool:
        return True

    def on_step_end(self, run, out) -> None:
        self.gains.append(None if out.update_gain is None else float(out.update_gain))
        self.losses.append(float(out.loss))


def _train(overrides: dict) -> dict:
    hook = Gains()
    trimtab.train(load_config(preset="debug", overrides=overrides), hooks=[hook])
    return {"gains": hook.gains, "losses": hook.losses}


def _measured(out: Path, nproc: int, **overrides) -> list[dict]:
    """Train in `nproc` gloo processes, the gain asked for every step; each rank's gains and losses."""
    records = run(out, nproc, measure_gain=True, **QUIET, **overrides)
    return [{"gains": [s["gain"] for s in r["steps"]], "losses": [s["loss"] for s in r["steps"]]} for r in records]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    before = torch.get_num_threads()  # (module-scoped: set up before the one_thread fixture)
    torch.set_num_threads(1)
    try:
        return _train(config(tmp_path_factory.mktemp("one") / "run", **QUIET))
    finally:
        torch.set_num_threads(before)


def _same_gains_as_one_process(records: list[dict], one: dict) -> None:
    """Every rank measured every step, the same value on all, equal to one process's. The gain is
    a ratio of small differences (the loss's change, a few % of it, over the dot product's), whose
    rounding the layouts' reduction orders change: measured within 2e-6 of one process's."""
    gains = records[0]["gains"]
    assert all(g is not None and math.isfinite(g) for g in gains), gains
    assert all(r["gains"] == gains for r in records), [r["gains"] for r in records]
    assert all(0.3 < g < 1.5 for g in one["gains"]), one["gains"]  # a sound LR's (training/gain.py)
    assert_close(gains, one["gains"], rel=1e-4)
    assert_close(records[0]["losses"], one["losses"], rel=1e-4)


@pytest.mark.distributed
def test_fsdp2_measures_the_one_process_gain_and_changes_nothing_in_the_run(tmp_path, one_process):
    """FSDP2 over 2 ranks: each dots its shards, one all-reduce sums them; the second scoring's
    all-gathers (the root kept gathered after it) leave the run bit-identical to one unmeasured."""
    fsdp = {"distributed": {"strategy": "fsdp"}}
    records = _measured(tmp_path / "measured", 2, **fsdp)
    _same_gains_as_one_process(records, one_process)
    unmeasured = run(tmp_path / "unmeasured", 2, **QUIET, **fsdp)
    assert [s["loss"] for s in unmeasured[0]["steps"]] == records[0]["losses"]
    theirs, ours = final_weights(tmp_path / "unmeasured"), final_weights(tmp_path / "measured")
    assert theirs.keys() == ours.keys() and all(torch.equal(ours[k], v) for k, v in theirs.items())


@pytest.mark.distributed
def test_tensor_parallelism_measures_the_one_process_gain(tmp_path, one_process):
    """TP over 2 ranks (sequence-parallel norms replicated: counted once, not twice)."""
    _same_gains_as_one_process(_measured(tmp_path / "tp2", 2, distributed={"tp": 2}), one_process)
