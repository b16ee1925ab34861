"""Asynchronous rollouts (rl.max_staleness = eta > 0), after AReaL's fully asynchronous RL (Fu et
al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
Reasoning"): the coming steps' batches are generated in a background thread, each by a copy of
the policy taken when it was asked for, while the trainer trains the batches before them; the
objective corrects for their staleness (rl/loss.py: decoupled PPO with truncated importance
weights).

The staleness is bounded and fixed, not left to timing: the batch trained at step s is generated
by the policy of step s - eta (in the first eta steps: the starting policy's), so an asynchronous
run is reproducible, and it resumes exactly: a checkpoint holds the batches already generated
(RolloutLoader.state_dict). Generation and training overlap where the machine has room: torch
releases the GIL inside its kernels. A batch whose generation failed (out of memory) stays in its
place and is generated again when the trainer asks for it next, after its handler (the
orchestrator's smaller generation passes): its error is raised in the trainer's thread, where a
synchronous run's would be. A serving engine in the thread's place (vLLM, SGLang)
receives the weights where this one copies the model (Trainer._policy_snapshot).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class RolloutQueue(Generic[T]):
    """The batches generated ahead of the one trained, oldest first, made in one background
    thread in the order they were asked for."""

    def __init__(self, depth: int) -> None:
        self.depth = depth  # eta: the batches kept generating ahead of the step's
        # The CPU's threads split between the trainer and the rollout thread (torch's thread
        # count is each thread's own): two threads each taking them all oversubscribe the cores
        # and overlap nothing (bench/rl_async.py measured it).
        self._threads = torch.get_num_threads()
        mine = max(1, self._threads // 2)
        torch.set_num_threads(max(1, self._threads - mine))
        self._thread = ThreadPoolExecutor(1, "trimtab-rollouts", torch.set_num_threads, (mine,))
        self._ahead: deque[tuple[Callable[[], T] | None, Future[T]]] = deque()  # (the job, its run)

    def next(self, job: Callable[[], Callable[[], T]]) -> T:
        """This step's batch. Before it is taken, the jobs that failed run again (in order, at
        the knobs as they are now) and the queue is filled to depth + 1 with jobs made by
        `job()` now (from the current weights): one a step once full, depth + 1 at the start.
        A job's error is raised here, in the trainer's thread; the job stays at the head."""
        for i, (fn, future) in enumerate(self._ahead):
            if fn is not None and future.done() and future.exception() is not None:
                self._ahead[i] = (fn, self._thread.submit(fn))
        while len(self._ahead) <= self.depth:
            fn = job()
            self._ahead.append((fn, self._thread.submit(fn)))
        result = self._ahead[0][1].result()
        self._ahead.popleft()
        return result

    def ahead(self) -> list[T]:
        """The queued batches, waited for, up to the first whose generation failed (a checkpoint
        holds them; a run resumed from it generates that one and those after it anew)."""
        done = []
        for _, future in self._ahead:
            if future.exception() is not None:
                break
            done.append(future.result())
        return done

    def restore(self, batches: list[T]) -> None:
        """Queue batches generated before a resume (ahead() then)."""
        for batch in batches:
            done: Future[T] = Future()
            done.set_result(batch)
            self._ahead.append((None, done))

    def close(self) -> None:
        """Drop what is queued; the batch generating now finishes first (a thread cannot be killed)."""
        for _, future in self._ahead:
            future.cancel()
        self._ahead.clear()
        self._thread.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(self._threads)
