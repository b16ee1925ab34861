"""A fork server for the tests' process groups: torch and trimtab imported once, each job's ranks
forked from here (tests/helpers.py `run`).

A torchrun job of 2 ranks spends ~5 s of CPU before its first step (an agent process and one
interpreter per rank, each importing torch and trimtab); the suite starts ~50 of them on two
cores. Forked ranks start in milliseconds, with the environment torchrun gives (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT) and fresh process state: each rank still joins its own process group
(trimtab's `Parallel.start`), so the arithmetic under test is the one torchrun runs. torchrun itself,
its restarts and a rank killed under it are tested through it (tests/test_resilience.py,
tests/test_cli_train.py). Safe to fork: this process runs no torch op and holds one thread.

The same for `trimtab` commands (tests/helpers.py `trimtab_cli`): `trimtab.cli.main` in a forked
child with the command's working directory and environment, which is what the console script runs
(tests/test_cli_train.py still starts real interpreters where the process itself is tested: signals,
torchrun, the console script).

Protocol, one JSON line each way per job:
    in:  {"nproc": N, "argv": [...dist_worker.py arguments], "timeout": seconds, "log": path}
         or {"cli": [...trimtab arguments], "cwd": dir, "env": {...}, "timeout": seconds, "log": path,
             "report": false: no end-of-run report (tests/helpers.py REPORTED)}
    out: {"rc": exit code of the first rank to fail (0: all passed; -9: past the timeout)}
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
import traceback

os.environ["OMP_NUM_THREADS"] = "1"

import dist_worker  # noqa: E402  (after OMP_NUM_THREADS: imports torch)
import trimtab.cli  # noqa: E402
from helpers import PRELOADED, free_port  # noqa: E402
from trimtab.training.hooks import ReportWriter  # noqa: E402

for _name in PRELOADED:  # what each child would otherwise import again (tests/helpers.py)
    importlib.import_module(_name)
# frozen before the forks (the gc module's advice): a child's collection neither walks nor writes
# into the objects it inherits, so their pages stay shared instead of being copied into each child
gc.collect()
gc.freeze()


def _child(body) -> None:
    """Run `body` in a forked child and leave with its exit code, without the server's exit
    handlers (a traceback on stderr for an exception)."""
    code = 1
    try:
        code = body() or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _rank(job: dict, rank: int, port: int) -> None:
    """The child of a rank: torchrun's environment, output to the job's log, dist_worker's main."""
    log = os.open(f"{job['log']}.rank{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    if job["nproc"] > 1:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(job["nproc"]),
            LOCAL_WORLD_SIZE=str(job["nproc"]),
            GROUP_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
        )
    sys.argv = ["dist_worker.py", *job["argv"]]
    dist_worker.main()


def _cli(job: dict) -> int:
    """The child of a `trimtab` command: its directory, environment and output files."""
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(f"{job['log']}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    os.dup2(os.open(f"{job['log']}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.argv = ["trimtab", *job["cli"]]
    if not job.get("report", True):  # as tests/conftest.py `_no_report` in the test's own process
        ReportWriter.on_train_end = lambda self, run, summary: None
    return trimtab.cli.main(job["cli"])


def _run(job: dict) -> int:
    """Fork the job's ranks (or its command) and wait; the first to fail ends the others (as
    torchrun does)."""
    port = free_port()
    pids = []
    for rank in range(job.get("nproc", 1)):
        pid = os.fork()
        if pid == 0:
            _child((lambda: _cli(job)) if "cli" in job else (lambda r=rank: _rank(job, r, port)))
        pids.append(pid)
    deadline, rc, alive = time.monotonic() + job["timeout"], 0, set(pids)
    while alive:
        for pid in list(alive):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                alive.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                if code and not rc:
                    rc = code
        if alive and (rc or time.monotonic() > deadline):
            rc = rc or -9
            for pid in alive:
                os.kill(pid, 9)
            for pid in alive:
                os.waitpid(pid, 0)
            alive.clear()
        time.sleep(0.02)
    return rc


def main() -> None:
    for line in iter(sys.stdin.readline, ""):
        print(json.dumps({"rc": _run(json.loads(line))}), flush=True)


if __name__ == "__main__":
    main()
