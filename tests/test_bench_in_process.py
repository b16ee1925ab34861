"""The bench dry runs' children run where a dry run puts them: in the benchmark's own process, or
forked from an agent that imported torch once (bench/_measure.py `run_here`, bench/comm.py
`TORCHRUN`). A dry run checks that a child runs, not what it measures; a fresh interpreter spent
~3 s of CPU on imports a child. tests/test_bench.py runs the dry runs themselves."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


def test_interop_dry_run_takes_each_operations_peak_rss_in_its_own_process(monkeypatch, tmp_path):
    """A dry run checks that each operation's child runs, not what it measures: four fresh interpreters
    spent ~20 s of CPU importing torch and transformers. The child's code runs here, as written."""
    import _measure
    import interop

    seen = []
    monkeypatch.setattr(_measure, "run_child", lambda *a, **k: pytest.fail("a dry run started a child process"))
    monkeypatch.setattr(interop, "one_operation", lambda *args: seen.append(args))
    run, out, saved = (str(tmp_path / name) for name in ("run", "hf", "saved"))
    assert interop.peak_rss("trimtab import", run, out, saved, fresh=False) > 0
    assert seen == [("trimtab import", run, out, saved)]


def test_checkpoint_dry_run_saves_in_its_own_process(monkeypatch, capsys):
    """As interop's: a dry run's saves are timed in the benchmark's process, the child's result read
    from what it emits (its printing kept out of the section)."""
    import _measure
    import checkpoint

    seen = []

    def child(preset, reps, out):
        seen.append((preset, reps, Path(out).name))
        print("a line of the child's own")
        times = {"sync": [0.2, 0.2], "stall": [0.1, 0.1], "write": [0.3, 0.3]}
        _measure.emit({"params": 1e6, "bytes": 2**20, "first": 0.1, **times})

    monkeypatch.setattr(checkpoint, "run_child", lambda *a, **k: pytest.fail("a dry run started a child process"))
    monkeypatch.setattr(checkpoint, "child", child)
    monkeypatch.setattr(sys, "argv", ["checkpoint.py", "--dry-run"])
    checkpoint.main()
    out = capsys.readouterr().out
    assert seen == [("debug", 2, "debug")] and "a line of the child's own" not in out
    assert "\n| `debug` | 1.0M | 1 | 200.0 (200.0-200.0) | 100.0 (100.0-100.0) | 100.0 | " in out


def test_comm_forks_its_ranks_from_an_agent_that_imported_torch_once(monkeypatch):
    """A rank started as a fresh interpreter spent ~3.4 s of CPU on imports (2-4 a mesh); forked, it finds
    them done. Forked ranks run the script by runpy, which leaves its folder off the path: bench/ is put on it."""
    import comm

    seen = []

    def fake_run(cmd, env, **kwargs):
        seen.append((cmd, env))
        Path(cmd[-3]).write_text('{"dp": 6.0}')
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(comm.subprocess, "run", fake_run)
    assert comm.measure("debug", 2, {"strategy": "ddp"}, [], 1, 2) == {"dp": 3.0}
    ((cmd, env),) = seen
    assert cmd[:5] == comm.TORCHRUN and "--start-method=fork" in cmd and env["OMP_NUM_THREADS"] == "1"
    assert str(BENCH) in env["PYTHONPATH"].split(os.pathsep) and cmd[cmd.index("--worker") - 1] == comm.__file__
