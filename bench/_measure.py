"""What every benchmark measures with, so a figure says how sure it is: other processes' share of
the CPUs while it ran (a busy second core slows two-thread torch 3-10x), a bootstrap interval
for a median, and ratios of paired repetitions with an interval and a verdict against a target
that says "not resolved" when the interval holds it."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class Contention:
    """Share of the machine's CPU time used by processes other than this one and its children,
    over the `with` block."""

    def __enter__(self) -> Contention:
        self.busy0, self.ours0, self.t0 = _busy_seconds(), _our_cpu(), time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        busy, ours = _busy_seconds() - self.busy0, _our_cpu() - self.ours0
        self.other = max(0.0, busy - ours) / ((time.monotonic() - self.t0) * (os.cpu_count() or 1))


def emit(result: dict) -> None:
    """A child process's result, for `run_child`: one `RESULT {json}` line on stdout."""
    print("RESULT " + json.dumps(result), flush=True)


def run_child(
    cmd: list[str],
    what: str,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    tolerate: str | None = None,
    echo: bool = False,
) -> dict:
    """Run a benchmark's child process; its `RESULT {json}` line (`emit`), with the other
    processes' share of the CPUs meanwhile as "other_cpu". A child that prints none stops the
    benchmark, showing its stderr, unless its stderr holds `tolerate` (any case): then the
    result is {"failed": True, "other_cpu": ...}. `echo`: the child's stderr is also copied to
    ours as it comes, so a benchmark killed by a time limit still shows how far each child got."""
    with Contention() as busy:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
        err: list[str] = []
        pump = threading.Thread(target=_copy_lines, args=(proc.stderr, err, echo), daemon=True)
        pump.start()
        try:
            stdout = proc.stdout.read()
            proc.wait()
        except BaseException:  # interrupted: the child must not outlive us
            proc.kill()
            raise
        pump.join()
    stderr = "".join(err)
    line = _result_line(stdout)
    if line is None:
        if tolerate is not None and tolerate.lower() in stderr.lower():
            return {"failed": True, "other_cpu": busy.other}
        sys.exit(f"{what} failed (exit {proc.returncode}):\n{stdout[-1000:]}\n{stderr[-3000:]}")
    return {**json.loads(line[7:]), "other_cpu": busy.other}


def run_here(child: Callable[[], object], what: str) -> dict:
    """`child` (a function that ends by calling `emit`) run in this process, its result as `run_child`
    returns it: for a dry run, which checks that a child runs, not what it measures (a fresh
    interpreter spent ~3 s of CPU importing torch, and transformers where it is used)."""
    printed = io.StringIO()
    with Contention() as busy, contextlib.redirect_stdout(printed):
        child()
    line = _result_line(printed.getvalue())
    if line is None:
        sys.exit(f"{what} emitted no result:\n{printed.getvalue()[-1000:]}")
    return {**json.loads(line[7:]), "other_cpu": busy.other}


def _result_line(stdout: str) -> str | None:
    return next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("RESULT ")), None)


def _copy_lines(stream, into: list[str], echo: bool) -> None:
    for line in stream:
        into.append(line)
        if echo:
            sys.stderr.write(line)
            sys.stderr.flush()


def run_python(
    code: str, what: str, cwd: Path | str | None = None, env: dict[str, str] | None = None, fresh: bool = True
) -> dict:
    """`python -c code` as a child (`code` ends by calling `emit`, importable from `_measure`
    since bench/ is on the child's path); its result as `run_child` returns it. fresh=False (a dry
    run): the same code run in this process (`run_here`), in its directory and environment."""
    if not fresh:
        return run_here(lambda: exec(compile(code, what, "exec"), {"__name__": "__child__"}), what)
    bench = str(Path(__file__).resolve().parent)
    env = dict(env or os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [bench, env.get("PYTHONPATH")]))
    return run_child([sys.executable, "-c", code], what, cwd, env)


def run_train(
    args: list[str],
    run_dir: Path | str,
    what: str,
    launcher: list[str] | None = None,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    check: bool = True,
    command: str = "train",
) -> dict:
    """`trimtab COMMAND ARGS --out RUN_DIR` (train, or rl) as a child process (under `launcher`, e.g. torchrun's;
    this Python by default). Its results are what it writes, read through trimtab.rundir:
    "summary" (summary.json; None if none), "metrics" (metrics.jsonl's kept lines), with
    "returncode", "stderr" and "other_cpu" (other processes' CPU share meanwhile). A failed run
    stops the benchmark, showing its stderr, unless check=False."""
    from trimtab.rundir import read_metrics, read_summary

    cmd = [*(launcher or [sys.executable]), "-m", "trimtab", command, *args, "--out", str(run_dir)]
    with Contention() as busy:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env)
    if check and out.returncode:
        sys.exit(f"{what} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return {
        "summary": read_summary(run_dir),
        "metrics": read_metrics(run_dir),
        "returncode": out.returncode,
        "stderr": out.stderr,
        "other_cpu": busy.other,
    }


def _busy_seconds() -> float:
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def _our_cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def step_rate(marks: list[tuple[float, int]], warmup: int) -> dict[str, float]:
    """Speed from (time, tokens so far) marks, one before the first step and one after each:
    tokens/s is a timed step's mean tokens over the median step time, so one slow step (a
    collection, the other core waking) moves a repetition less than a total time would."""
    times, tokens = zip(*marks)
    steps = range(warmup, len(marks) - 1)
    step_s = statistics.median(times[i + 1] - times[i] for i in steps)
    step_tokens = statistics.mean(tokens[i + 1] - tokens[i] for i in steps)
    return {"tokens_per_s": step_tokens / step_s, "ms_per_step": 1000 * step_s, "warmup_s": times[warmup] - times[0]}


def median_ci(values: list[float], n: int = 2000) -> tuple[float, float]:
    """Percentile-bootstrap 95% interval of the median, seeded so a report is reproducible from
    its data. With few values it is wide (about min to max for 5): honest, not a defect."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


@dataclass(frozen=True)
class Ratio:
    """The median of paired ratios a_i / b_i (repetition i of a and of b run back to back, so
    drift of the machine cancels) with its 95% bootstrap interval."""

    value: float
    low: float
    high: float
    n: int

    def verdict(self, target: float) -> str:
        """Against `target` (a ratio to reach or beat): met, not met, or not resolved."""
        if self.low >= target:
            return "met"
        if self.high < target:
            return "not met"
        return f"not resolved: the interval holds {target:g}x"

    def at_most(self, target: float) -> str:
        """Against `target` as an upper bound (a ratio to stay at or under): met, not met, or not resolved."""
        if self.high <= target:
            return "met"
        if self.low > target:
            return "not met"
        return f"not resolved: the interval holds {target:g}x"

    def within(self, tolerance: float) -> str:
        """As a claim of parity: the same within +-tolerance (the interval inside 1 +- tolerance),
        different (the interval outside it), or not resolved to that tolerance."""
        if 1 - tolerance <= self.low and self.high <= 1 + tolerance:
            return f"the same within {tolerance:.0%}"
        if self.high < 1 - tolerance or self.low > 1 + tolerance:
            return f"different by more than {tolerance:.0%}"
        return f"not resolved to {tolerance:.0%}"

    def __str__(self) -> str:
        if self.n < 2:
            return f"{self.value:.3f}x (one pair: no interval)"
        return f"{self.value:.3f}x (95% interval {self.low:.3f}-{self.high:.3f}, {self.n} pairs)"


def paired_ratio(a: list[float], b: list[float]) -> Ratio:
    """a_i / b_i for repetitions i of a and b run back to back: their median and its interval."""
    return median_ratio([x / y for x, y in zip(a, b, strict=True)])


def median_ratio(ratios: list[float]) -> Ratio:
    """Ratios already paired (e.g. by a child, block by block): their median and its interval.
    One pair has none (0 to infinity: every claim on it is not resolved), not a zero-width one."""
    low, high = median_ci(ratios) if len(ratios) > 1 else (0.0, math.inf)
    return Ratio(statistics.median(ratios), low, high, len(ratios))
