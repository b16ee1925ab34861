"""A rank's own work, for the straggler rule (orchestrator/stragglers.py): the time from its step's
start to its arrival at the step's agreement point (Parallel.agree), where under DDP no collective
has run yet (forwards, and backwards before the last, run as under no_sync). After that point a
step holds waits for the other ranks, which its wall time less agree()'s wait counted as compute:
DDP's gradient all-reduce, the blocking gloo all-reduces of the loss and gradient norm, and the
update gain's second scoring of the batch (training/gain.py), a forward (slowed on a slow rank too)
whose all-reduce the fast rank waits in. Measured on a loaded 2-core host, slow_rank@3:1:30: that
way rank 0 read 1.8-3.6 s a step against rank 1's 4.6-6.9 s (0.38-0.67x: at 0.62x a finding's
confidence, 0.29, was under orchestrator.min_confidence); this way 0.16-0.18 s against 3.3-4.3 s (0.04-0.05x, the
forwards' 1/30 plus the unslowed loss head). It leaves out the last backward and the update, which
a throttled device slows alike, so the ranks' ratio holds.

On CUDA the host runs ahead of the device (a host timer around a forward measures its launches),
so the segment is timed with CUDA events on the current stream, read when the straggler rule
gathers a window (no sync inside the step). Under FSDP2, tensor or pipeline parallelism the
forwards hold collectives (all-gathers, stage sends), whose waits this segment still counts: there
every rank reads alike, so the straggler rule does not run (orchestrator/stragglers.py, unjudged).
A step retried after an out-of-memory error counts the retry's work too (Parallel.step_retried).
"""

from __future__ import annotations

import time

import torch


class WorkClock:
    """Seconds of a rank's own work: start() at a step's start, stop() at its agreement point."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.counted = 0.0  # seconds of finished segments
        self.began: float | torch.cuda.Event | None = None  # the open segment's start
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA segments not read yet

    def start(self) -> None:
        self.began = self._mark()

    def stop(self) -> None:
        """The step reached its agreement point: its segment counts (once: a re-run's second
        agreement, after a backward that communicated, does not)."""
        if self.began is None:
            return
        end, self.began, began = self._mark(), None, self.began
        if isinstance(began, float):
            self.counted += end - began
        else:
            self.pending.append((began, end))

    @property
    def seconds(self) -> float:
        """Seconds counted so far. CUDA: read once a window, when the newest segment's end (a
        forward launched a step's backward and update ago) is done or nearly, so its wait is short."""
        for began, end in self.pending:
            end.synchronize()
            self.counted += began.elapsed_time(end) / 1e3
        self.pending.clear()
        return self.counted

    def _mark(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
