"""Verifiable rewards: a response checked against a prompt's answer, in worker processes with a
real wall-clock limit (a verification that hangs, a sympy simplification that never ends, is
killed with its process: reward 0, said in the returned events, and the pool goes on).

A verifier is named by a spec (`rl.reward`):
    math              answer equivalence through Hugging Face's math-verify (extra `rl`): LaTeX,
                      \\boxed{}, fractions, sets, intervals
    exact             the response's final answer (the last \\boxed{...}, else what follows the
                      last '####', else its last line) equals the answer, spaces ignored
    regex:PATTERN     PATTERN's first group (or whole match) in the response equals the answer
    format:PATTERN    1 when the whole response, as generated (whitespace included), matches PATTERN
                      (a format reward), else 0
    python:MOD:FN     any function FN(response, answer) -> float, imported from module MOD
"""

from __future__ import annotations

import importlib
import math
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from trimtab.errors import ConfigError
from trimtab.extras import require

Verifier = Callable[[str, str], float]
STARTUP_S = 120  # a worker's imports (a Python verifier's module: perhaps torch)
PIPELINE = 4  # jobs a worker holds at once: one verifying, the rest waiting in its socket
PIPELINE_BYTES = 16 * 1024  # the largest job sent to wait behind another (a socket buffers ~200 KB)
POLL_S = 0.25  # the longest wait for a verdict before score() asks its `interrupt` again


@contextmanager
def taken(lock: threading.Lock, interrupt: Callable[[], None] | None) -> Iterator[None]:
    """`lock` held; while another holds it (async RL's rollout thread scoring a training batch: up to
    rl.verifier_timeout_s a verification), `interrupt` is asked every POLL_S and may raise to leave the
    wait (a held-out evaluation's stop signal: it waited on through the whole batch's scoring)."""
    if interrupt is None:
        lock.acquire()
    while interrupt is not None and not lock.acquire(timeout=POLL_S):
        interrupt()
    try:
        yield
    finally:
        lock.release()


def final_answer(text: str) -> str:
    """The answer a response ends with: the last \\boxed{...} (braces nested), else what follows
    the last '####', else the last non-empty line."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j].strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _exact(response: str, answer: str) -> float:
    return float(re.sub(r"\s+", "", final_answer(response)) == re.sub(r"\s+", "", answer))


def _math(response: str, answer: str) -> float:
    from math_verify import parse, verify

    # math-verify's own timeouts use signal.alarm, which only the main thread may set: this runs
    # in the worker's main thread, and the pool's wall-clock limit stands behind it
    return float(verify(parse(answer), parse(response)))


def _regex(pattern: str) -> Verifier:
    compiled = re.compile(pattern, re.DOTALL)

    def check(response: str, answer: str) -> float:
        found = compiled.search(response)
        said = (found.group(1) if compiled.groups else found.group(0)) if found else None
        return float(said is not None and said.strip() == answer.strip())

    return check


def _format(pattern: str) -> Verifier:
    """The whole response as generated, its whitespace included: the form is what a format reward
    teaches (a newline after </think>, an answer after a space), and a stripped response could
    never match a pattern that asks for leading or trailing whitespace. A pattern that allows it
    says so (\\s*); TRL's R1-style think_format_reward matches the raw completion too."""
    compiled = re.compile(pattern, re.DOTALL)
    return lambda response, answer: float(compiled.fullmatch(response) is not None)


def _imported(module: str, spec: str, key: str) -> Any:
    """A verifier's module; its own error at import (a syntax error, a failing statement) said as
    the config's: the module is the person's code, its traceback is not trimtab's."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):  # its own import: as is
            raise
        raise ConfigError(f"{key} '{spec}': no module named {exc.name} on the import path; {_where(module)}") from None
    except ImportError:
        raise
    except Exception as exc:
        raise ConfigError(f"{key} '{spec}': importing {module} failed: {type(exc).__name__}: {exc}") from None


def _where(module: str) -> str:
    """How to make a verifier's module importable. The `trimtab` command, unlike `python -m`, does
    not look in the working directory, where a person's verifier file most often is."""
    path = os.path.join(*module.split(".")) + ".py"
    if os.path.isfile(path) and "" not in sys.path and os.getcwd() not in sys.path:
        return f"{path} is in the working directory, which the trimtab command does not search: run with PYTHONPATH=."
    return "put the directory that holds it on PYTHONPATH, or install it (pip install -e)"


def verifier(spec: str, key: str = "rl.reward") -> Verifier:
    """The verifier a spec names; ConfigError (naming the config `key`) when it names none."""
    kind, _, rest = spec.partition(":")
    try:
        if kind == "exact" and not rest:
            return _exact
        if kind == "math" and not rest:
            require("math_verify", f"{key} '{spec}'")
            return _math
        if kind == "regex" and rest:
            return _regex(rest)
        if kind == "format" and rest:
            return _format(rest)
        if kind == "python" and rest.count(":") == 1:
            module, name = rest.split(":")
            return getattr(_imported(module, spec, key), name)
    except (ImportError, re.error, AttributeError) as exc:
        raise ConfigError(f"{key} '{spec}': {exc}") from None
    raise ConfigError(
        f"{key} '{spec}' names no verifier: use math, exact, regex:PATTERN, format:PATTERN or python:MODULE:FUNCTION"
    )


def _serve(spec: str, conn: Connection) -> None:
    """A worker: verify what it is sent until the pool closes its end."""
    check = verifier(spec)
    conn.send("ready")  # its imports done: the pool's clock starts with the first job
    while True:
        try:
            index, response, answer = conn.recv()
        except EOFError:
            return
        try:
            conn.send((index, _reward(check(response, answer)), ""))
        except Exception as exc:  # noqa: BLE001 - a verifier's error is a reward of 0, said
            conn.send((index, 0.0, f"{type(exc).__name__}: {exc}"))


MAX_REWARD = 1e6  # rewards are scores (0-1, a few points): far past this, fp32 advantages overflow


def _reward(value: Any) -> float:
    """A verifier's return as a reward: a finite number, else the verifier's error. A NaN or an
    infinity would make its whole group's advantages NaN, the step's loss NaN, and the
    orchestrator would take the model for broken (rule nonfinite) where the verifier is
    (rule rl_verifier); text is refused rather than read by float() ('1' would pass, 'yes' not)."""
    if value is None:  # the commonest slip: a branch without a return
        raise TypeError("the verifier returned None, not a number (a path through it without a return?)")
    if isinstance(value, (str, bytes)):
        raise TypeError(f"the verifier returned {type(value).__name__} {value[:40]!r}, not a number")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"the verifier returned {reward}, not a finite number")
    if abs(reward) > MAX_REWARD:  # finite, but its group's fp32 advantages would overflow the same way
        raise ValueError(f"the verifier returned {reward:g}, beyond the +-{MAX_REWARD:g} a reward may be")
    return reward


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    jobs: deque[int] = field(default_factory=deque)  # sent, in order: the first one is verifying
    since: float = 0.0  # when the first one started: its wall-clock limit counts from here


@dataclass
class Scored:
    rewards: list[float]
    # each verification that failed: index, kind (timeout | error | died) and detail
    events: list[dict[str, Any]] = field(default_factory=list)
    # the wall time of the longest verification that gave its verdict: timeouts far past it are
    # hangs on some responses, not a slow verifier (rule rl_verifier does not lengthen the limit)
    slowest: float = 0.0


class VerifierPool:
    """`workers` processes verifying under `timeout_s` each; a verification past it is killed
    with its process (a fresh one takes its place) and left without a verdict. One whose process
    died (a crash in native code, the OOM killer) is tried again up to `retries` times; one that
    timed out is not: a verifier is a function of (response, answer), so the same pair hangs again
    and each retry only waited the full limit once more (a step of 32 responses, one hanging,
    under a 2 s limit: 4.3-4.5 s with one retry, 2.2-2.3 s without). A slow verifier's timeouts are rule
    rl_verifier's, which lengthens the limit.

    A worker is a fresh interpreter (`python -m trimtab.rl.rewards`, ~0.2 s) on a socket pair,
    not a multiprocessing child: those re-run the parent's main module in every new process
    (Python 3.11's forkserver never preloads it), which under torchrun or a script that imports
    torch is seconds of CPU at each start and each replacement of a killed worker."""

    def __init__(
        self, spec: str, workers: int = 2, timeout_s: float = 5.0, retries: int = 1, key: str = "rl.reward"
    ) -> None:
        verifier(spec, key)  # a bad spec is told here, not by a worker
        self.spec, self.timeout_s, self.retries = spec, timeout_s, retries
        self._workers = [self._start() for _ in range(workers)]

    def _start(self) -> _Worker:
        ours, theirs = socket.socketpair()
        # the trainer's import path, so a python:MODULE:FUNCTION found here is found there
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
        process = subprocess.Popen(
            [sys.executable, "-m", "trimtab.rl.rewards", self.spec, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()
        conn = Connection(ours.detach())
        try:
            ready = conn.poll(STARTUP_S) and conn.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            process.kill()
            process.wait()
            raise RuntimeError(f"a verifier process for rl.reward '{self.spec}' did not start within {STARTUP_S} s")
        return _Worker(process, conn)

    def _replace(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.wait()
        worker.conn.close()
        self._workers[self._workers.index(worker)] = self._start()

    def score(self, responses: list[str], answers: list[str], interrupt: Callable[[], None] | None = None) -> Scored:
        """Each response's reward (0 for one that timed out or raised, each said in `events`). `interrupt`,
        called before each round of jobs sent and at least every POLL_S, raises to leave the scoring off (a
        held-out evaluation's stop signal, training/policy.py): the verifications under way are killed."""
        out = Scored([0.0] * len(responses))
        pending, failed = deque(range(len(responses))), [0] * len(responses)
        while pending or any(w.jobs for w in self._workers):
            self._give_way(interrupt)
            self._send(pending, responses, answers)
            busy = [w for w in self._workers if w.jobs]
            soonest = min(w.since for w in busy) + self.timeout_s
            # a signal does not end the wait (PEP 475 retries it): a slice of it, so a stop is heard within POLL_S
            left = max(0.0, soonest - time.monotonic())
            ready = wait([w.conn for w in busy], timeout=min(left, POLL_S) if interrupt else left)
            for w in busy:
                if w.conn in ready:
                    try:
                        while w.jobs and w.conn.poll():  # every verdict in (an error in the verifier: 0, said)
                            index, value, error = w.conn.recv()
                            out.rewards[index] = value
                            w.jobs.popleft()
                            now = time.monotonic()
                            out.slowest = max(out.slowest, 0.0 if error else now - w.since)
                            w.since = now  # the next one's verification begins
                            if error:
                                out.events.append({"index": index, "kind": "error", "detail": error})
                        continue
                    # the process died (a crash in native code): tried again. With jobs still in its
                    # socket the end is a reset, not an EOF (it raised out of score, and the RL step with it)
                    except (EOFError, ConnectionError):
                        error, kind = "the verifier's process died", "died"
                elif time.monotonic() - w.since < self.timeout_s:
                    continue
                else:
                    error, kind = f"no verdict within {self.timeout_s:g} s", "timeout"
                index = w.jobs.popleft()  # the one verifying failed; those sent behind it never began
                pending.extendleft(reversed(w.jobs))
                self._replace(w)
                failed[index] += 1
                if kind == "died" and failed[index] <= self.retries:  # a hang is not retried: see the class
                    pending.appendleft(index)
                else:
                    out.events.append({"index": index, "kind": kind, "detail": error})
        return out

    def _give_way(self, interrupt: Callable[[], None] | None) -> None:
        """`interrupt`'s error, if it raises, once the verifications under way are killed: their verdicts, still
        to come, would be read as the next score()'s (a worker dead and idle is replaced at its next job, _send)."""
        try:
            if interrupt is not None:
                interrupt()
        except BaseException:
            for w in [w for w in self._workers if w.jobs]:
                w.process.kill()
                w.process.wait()
                w.jobs.clear()
            raise

    def _send(self, pending: deque[int], responses: list[str], answers: list[str]) -> None:
        """Jobs to the workers, a turn each, up to PIPELINE queued in a worker's socket behind the
        one it verifies: a verdict's round trip no longer stands between two verifications (64
        responses of a cheap verifier on 2 workers: 1.8 -> 0.9-1.2 ms). Only a job under
        PIPELINE_BYTES waits in the queue: a send larger than the socket's buffer would block
        while the worker verifies (or hangs), and the limit could not be kept."""
        for w in [w for w in self._workers if not w.jobs and w.process.poll() is not None]:
            # died idle (between steps: the OOM killer): replaced before it is given a job, which its
            # death would otherwise charge a try (with rl retries 0, a reward of 0 it never earned)
            self._replace(w)
        for _ in range(PIPELINE):
            for w in self._workers:
                if not pending or len(w.jobs) >= PIPELINE:
                    continue
                job = pickle.dumps((pending[0], responses[pending[0]], answers[pending[0]]))
                if w.jobs and len(job) > PIPELINE_BYTES:
                    continue
                if not w.jobs:
                    w.since = time.monotonic()
                try:
                    w.conn.send_bytes(job)
                except ConnectionError:  # its process died verifying an earlier job: score() hears it
                    pass  # at its next read, and puts this one back with the others behind that job
                w.jobs.append(pending.popleft())

    def close(self) -> None:
        for w in self._workers:
            w.conn.close()  # an idle worker sees the end of its input and leaves
            try:
                w.process.wait(timeout=1)
            except subprocess.TimeoutExpired:  # one still verifying
                w.process.kill()
                w.process.wait()


if __name__ == "__main__":  # a worker (VerifierPool._start): SPEC, then its end of the socket pair
    _serve(sys.argv[1], Connection(int(sys.argv[2])))
