"""Test helpers shared by several test modules (pytest puts tests/ on sys.path)."""

import gc
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from trimtab.checkpoint import list_checkpoints
from trimtab.checkpoint_load import read_sharded_weights
from trimtab.config import RunConfig, load_config, merge
from trimtab.training.control import Control
from trimtab.training.hooks import Hook

# `trimtab train` flags for quick CLI runs: a small corpus slice, no progress bar, TensorBoard or evals
FAST = [
    "--set",
    "data.max_bytes=150000",
    "--set",
    "log.progress=false",
    "--set",
    "log.tensorboard=false",
    "--set",
    "train.eval_every=0",
]


class StopAt(Hook):
    """Stops the run after `step`, as a signal or a person would (the trainer saves first)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, out):
        if out.step == self.step:
            trainer.control.request("stop", reason="test")


class CrashAt(Hook):
    """Raises out of the loop after `step` (no checkpoint saved): a crash or a kill."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, run, out):
        if out.step == self.step:
            raise RuntimeError("crash (test)")


def freeze_heap() -> None:
    """What the worker holds now, collected once and frozen out of the collector's sight (as
    tests/conftest.py does after collection): a test that collects garbage again and again (model/
    recompute.py's measure_kept_bytes, 4 times a measurement) walks only its own objects. Each of
    those full collections walked the worker's whole heap: 0.33 s, 16.7 s of CPU in the 12 debug-moe
    cases of test_plan's activation estimate (cProfile), 1.9 s frozen; the same bytes measured."""
    gc.collect()
    gc.freeze()


# ------------------------------------------------ torchrun runs (test_distributed, test_tensor_parallel)

WORKER = Path(__file__).with_name("dist_worker.py")
SRC = str(WORKER.parent.parent / "src")
STEPS = 10
# debug-hybrid (dense, MoE, MoD and MoE+MoD layers; tied embedding) with qk_norm, as the pipeline
# and tensor-parallel tests train it: one config, so its one-process reference is run once
HYBRID = {"preset": "debug-hybrid", "model": {"qk_norm": True}, "train": {"eval_every": 5, "batch_tokens": 4096}}


def free_port() -> int:
    """A TCP port free on this host now (a rendezvous store's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(out: Path, **overrides) -> dict:
    """The tests' process-group run: debug, STEPS steps, fp32, checkpoints every 5; `overrides` on top."""
    return merge(
        {
            "out": str(out),
            # fp32: parity is about the arithmetic of sharding; bf16 autocast on CPU rounds
            # differently across machines (1e-4 drift by step 5 on an AMD EPYC, none on others)
            "train": {"max_steps": STEPS, "eval_every": 0, "log_every": 1, "precision": "fp32"},
            "data": {"max_bytes": 150_000},
            "checkpoint": {"every": 5},
            # the report (0.6 s a run) is tested on its own (tests/test_report.py)
            "log": {"progress": False, "tensorboard": False, "report": False},
        },
        overrides,
    )


def faulted(out: Path, faults: list[str], steps: int, **sections: dict) -> RunConfig:
    """A quiet debug run of `steps` steps with `faults` injected: no evaluation, report, TensorBoard or
    progress line; `sections` (config sections) on top."""
    base = {"out": str(out), "faults": faults, "train": {"max_steps": steps, "eval_every": 0}}
    base["log"] = {"progress": False, "report": False, "tensorboard": False}
    return load_config(preset="debug", overrides=merge(base, sections))


def run(out: Path, nproc: int, restarts: int = 0, **overrides) -> list[dict]:
    """Train in `nproc` processes (torchrun restarting the job up to `restarts` times when a rank
    fails); each rank's record of the last session, rank order."""
    argv, records = _job(out, nproc, overrides)
    if restarts:
        _torchrun(nproc, restarts, argv)
    else:
        _forked(nproc, argv, log=out.parent / f"{out.name}.log")
    return records()


def run_relaunched(out: Path, nproc: int, launches: int = 2, **overrides) -> tuple[list[dict], int]:
    """run(out, nproc, restarts=launches - 1) without torchrun's agent: the job is forked again
    while it fails, as the agent would restart it, at a fork's cost instead of torchrun's (for
    tests of what a restarted job resumes, not of torchrun). Returns the records and how many
    launches it took."""
    argv, records = _job(out, nproc, overrides)
    for launch in range(launches):
        log = out.parent / f"{out.name}.{launch}.log"
        if _fork_server({"nproc": nproc, "argv": argv, "timeout": 240, "log": str(log)}) == 0:
            return records(), launch + 1
    told = Path(f"{log}.rank0").read_text()[-4000:]
    raise AssertionError(f"{launches} launches failed; the last one's rank 0:\n{told}")


def _job(out: Path, nproc: int, overrides: dict) -> tuple[list[str], Callable[[], list[dict]]]:
    """A job's worker arguments (its config, where each rank writes its record) and the reader of
    those records, rank order."""
    record = out.parent / f"{out.name}-rank{{rank}}.json"
    argv = [json.dumps(config(out, **overrides)), str(record)]
    return argv, lambda: [json.loads(Path(str(record).format(rank=r)).read_text()) for r in range(nproc)]


# What the fork server (tests/forkserver.py) imports first, so that its children do not: an
# optimizer's first construction imports torch._dynamo (1.5 s of CPU), a run's TensorBoard writer
# torch.utils.tensorboard, its checkpoint torch.distributed.checkpoint (with its fsspec writer) and
# its end the report; `trimtab` commands their modules (not lm_eval's: it starts a thread).
# Measured over the suite (py-spy): its children had spent 21 s of CPU importing tensorboard and
# DCP, each its own. TORCHRUN's agent imports less: its ranks (tests/dist_worker.py) write no
# TensorBoard or report, and every agent started pays for what it imports (~25 in the suite).
PRELOADED = (
    "torch._dynamo",
    "torch.utils.tensorboard",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.checkpoint._fsspec_filesystem",
    "trimtab.api",
    "trimtab.cli",
    "trimtab.hf.export",
    "trimtab.report",
)

# torchrun (`python -m torch.distributed.run`: its argument parsing, elastic agent, rendezvous and
# restarts) with the ranks forked from its agent, which imported torch and trimtab once: torchrun's
# own `--run-path --start-method fork` (the script run by runpy in the forked worker). A rank
# started as a fresh `python` spends ~3.4 s of CPU importing them (torch._dynamo is what an
# optimizer's first construction imports), a restarted job as much again, ~25 rank starts in the
# suite. The environment must set OMP_NUM_THREADS=1: an OpenMP pool does not survive a fork.
# Followed by torchrun's other arguments, then a script's absolute path (TRIMTAB_MAIN: `trimtab`).
TORCHRUN = [
    sys.executable,
    "-c",
    "import torch._dynamo, trimtab.api, trimtab.cli, trimtab.hf.export; from torch.distributed.run import main; main()",
    "--run-path",
    "--start-method=fork",
]
TRIMTAB_MAIN = str(Path(SRC) / "trimtab" / "__main__.py")


def _torchrun(nproc: int, restarts: int, argv: list[str]) -> None:
    """The job under torchrun: its agent restarts the ranks when one fails."""
    launcher = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={restarts}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([*launcher, str(WORKER), *argv], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def _forked(nproc: int, argv: list[str], log: Path) -> None:
    """The job's ranks forked by this test process's fork server (tests/forkserver.py: torch
    imported once, torchrun's environment per rank)."""
    rc = _fork_server({"nproc": nproc, "argv": argv, "timeout": 240, "log": str(log)})
    logs = [Path(f"{log}.rank{r}") for r in range(nproc)]
    told = "".join(f"--- rank {r}\n{p.read_text()[-4000:]}" for r, p in enumerate(logs) if p.is_file())
    assert rc == 0, f"exit {rc}\n{told}"


def forked_ranks(target: Callable[..., None], tmp_path: Path, world: int = 2) -> list[dict]:
    """`target(rank, store, out)` in `world` forked processes (a gloo group over the file `store`; each writes
    its JSON to `out` formatted with its rank), joined within 60 s each; their records in rank order."""
    fork = multiprocessing.get_context("fork")
    out = str(tmp_path / "rank{rank}.json")
    children = [fork.Process(target=target, args=(r, str(tmp_path / "store"), out)) for r in range(world)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0, "a rank failed or hung"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def trimtab_cli(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`trimtab ARGS` run to its end in `cwd` (the environment: this process's, or `env`), forked
    by the fork server: trimtab.cli.main in a fresh process, as the console script runs it."""
    with tempfile.TemporaryDirectory(prefix="trimtab-cli-") as logs:
        log = Path(logs) / "log"
        rc = _fork_server(
            {"cli": list(args), "cwd": str(cwd), "env": dict(env or os.environ), "timeout": 600, "log": str(log)}
            | {"report": _reported()}
        )
        out, err = (Path(f"{log}.{name}").read_text() for name in ("out", "err"))
    return subprocess.CompletedProcess(["trimtab", *args], rc, out, err)


def base_run(out: Path) -> Path:
    """A debug run of two steps into `out`: a tokenizer and weights to start RL or DPO from."""
    done = trimtab_cli(["train", "--preset", "debug", "--out", str(out), "--max-steps", "2", *FAST], out.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# Modules whose runs' report.html is looked at; elsewhere the end-of-run report (0.3-0.7 s of plotly
# per run, ~160 runs in the suite) is not written (tests/conftest.py `_no_report`, and trimtab_cli).
# It never changes a run (ReportWriter warns and goes on whatever fails), and tests/test_report.py
# tests it end to end, written by default.
REPORTED = {"test_report.py", "test_tracking.py"}


def _reported() -> bool:
    """Whether the test running looks at its runs' reports (REPORTED)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "")
    return Path(test.split("::")[0]).name in REPORTED


_server: subprocess.Popen | None = None
_server_lock = threading.Lock()  # one job at a time: tests that run jobs from threads wait their turn


def _fork_server(job: dict) -> int:
    """Send a job to this test process's fork server (started on first use); its exit code."""
    global _server
    with _server_lock:
        if _server is None or _server.poll() is not None:
            path = os.pathsep.join([SRC, str(WORKER.parent), os.environ.get("PYTHONPATH", "")])
            env = {**os.environ, "PYTHONPATH": path}
            _server = subprocess.Popen(
                [sys.executable, str(WORKER.with_name("forkserver.py"))],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
        _server.stdin.write(json.dumps(job) + "\n")
        _server.stdin.flush()
        return json.loads(_server.stdout.readline() or '{"rc": "the fork server died"}')["rc"]


def losses(record: dict) -> list[float]:
    return [s["loss"] for s in record["steps"]]


def assert_close(a: list[float], b: list[float], rel: float = 1e-4) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * max(abs(x), abs(y), 1e-6), (a, b)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    path = list_checkpoints(run_dir)[-1]
    sharded = (path / "dcp").is_dir()
    return read_sharded_weights(path) if sharded else load_file(str(path / "model.safetensors"))


class FakeTrainer:
    """Enough of a Trainer for Control, and of a RunView for the orchestrator's command handling."""

    def __init__(self, run_dir):
        self.state = SimpleNamespace(step=3, lr_scale=1.0)
        self.step = 3
        self.world, self.device = 1, torch.device("cpu")  # the machine an out-of-memory error is recorded on
        self.cfg = SimpleNamespace(run_dir=run_dir)
        self.control = Control(self)
        self.said = []

    def say(self, line):
        self.said.append(line)
