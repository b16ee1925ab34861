"""`trimtab bench`, `trimtab ctl` and `trimtab merge` as a user runs them."""

import logging
import os
import subprocess
from pathlib import Path

from helpers import FAST, trimtab_cli
from trimtab import benchmarks
from trimtab.cli import main
from trimtab.rundir import read_decisions
from trimtab.runlock import run_lock


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """`trimtab ARGS` in a process of its own (forked with trimtab imported: tests/forkserver.py):
    the exit code is the process's."""
    return trimtab_cli(list(args), cwd or Path.cwd())


def test_bench_lists_the_scripts_and_runs_nothing(tmp_path):
    listed = cli("bench", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "healing      Fault healing: every injected fault" in listed.stdout
    assert "_benchfile" not in listed.stdout  # a helper the scripts share, not a benchmark
    assert list(tmp_path.iterdir()) == []  # nothing ran (the healing harness writes runs/ here)
    shown = cli("bench", "--help")
    assert shown.returncode == 0 and "usage: trimtab bench" in shown.stdout


def test_bench_runs_the_named_script_with_its_arguments():
    shown = cli("bench", "healing", "--help")
    assert shown.returncode == 0 and "usage: trimtab bench healing" in shown.stdout and "--scenarios" in shown.stdout
    refused = cli("bench", "healing", "--no-such-flag")  # the script's own exit code comes through
    assert refused.returncode == 2 and "unrecognized arguments: --no-such-flag" in refused.stderr
    unknown = cli("bench", "nope")
    assert unknown.returncode == 2 and "unknown benchmark 'nope'; one of " in unknown.stderr
    assert "healing, " in unknown.stderr.splitlines()[-1]


def test_every_bench_script_imports(monkeypatch):
    """The scripts share bench/_measure.py and bench/_benchfile.py (and some import each other):
    each one imported with bench/ first on the path, as `python bench/X.py` would, so a moved helper
    is caught here rather than on the day someone runs the benchmark. In this process, whose torch
    is imported already (a fresh interpreter spent 3.5 s of CPU on it); each module must be the
    script, not a module of that name imported before."""
    import importlib

    bench = benchmarks.SRC.parent / "bench"
    monkeypatch.syspath_prepend(str(bench))  # the scripts' own sys.path inserts undone with it
    for path in sorted(bench.glob("*.py")):
        module = importlib.import_module(path.stem)
        assert Path(module.__file__).resolve() == path.resolve(), (path.stem, module.__file__)


def test_bench_without_the_source_checkout_says_where_benchmarks_live(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(benchmarks, "SRC", tmp_path / "site-packages")
    assert main(["bench"]) == 2
    assert "benchmarks live in the bench/ folder of trimtab's source checkout" in capsys.readouterr().err


def test_ctl_refuses_a_run_that_is_not_running_and_queues_on_request(tmp_path, capsys):
    run = tmp_path / "r"
    train = ["train", "--preset", "debug", "--out", str(run), *FAST]
    assert main([*train, "--max-steps", "2"]) == 0
    refused = cli("ctl", str(run), "scale-lr", "0.5")
    assert refused.returncode == 2, refused.stderr
    assert f"'{run}' is not running (ended " in refused.stderr and "nothing was sent. Pass --queue" in refused.stderr
    assert not list((run / "control").glob("*.json"))  # (control/.ended: the run's last step is done)
    queued = cli("ctl", str(run), "scale-lr", "0.5", "--queue")
    assert queued.returncode == 0, queued.stderr
    assert queued.stdout.startswith(f"queued in {run} ") and "when it resumes" in queued.stdout
    assert len(list((run / "control").glob("*.json"))) == 1
    capsys.readouterr()
    assert main([*train, "--max-steps", "4"]) == 0  # the lock was released: it resumes, and takes the command
    assert "completed: step 4/4 (2 this session," in capsys.readouterr().out
    assert [(d["rule"], d["action"], d["mode"], d["step"]) for d in read_decisions(run)] == [
        ("config", "set_total_steps", "manual", 2),  # the longer --max-steps, journaled as a person's change
        ("manual", "scale_lr", "manual", 3),
    ]


def test_a_run_being_trained_takes_commands_and_refuses_a_second_train(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("{}")
    with run_lock(run):  # as `trimtab train` holds it, from this process
        sent = cli("ctl", str(run), "checkpoint")
        assert sent.returncode == 0, sent.stderr
        assert sent.stdout.startswith(f"sent to the job in {run} ")
        assert main(["train", "--preset", "debug", "--out", str(run), "--max-steps", "2", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"trimtab: error: '{run}' is being trained by pid {os.getpid()} on ")
    assert sorted(p.name for p in run.iterdir()) == [
        ".lock",
        "config.yaml",
        "control",
    ]  # the refused train wrote nothing


def test_the_hints_after_a_merge_quote_every_path(tmp_path, capsys, monkeypatch):
    """A merged model in a folder with a space and a non-ASCII letter: both printed commands
    survive a copy-paste into a shell (the export one was unquoted)."""
    import shlex

    from trimtab import merge

    out = tmp_path / "spa ce ü" / "mrg"
    (out / "checkpoints" / "step_000000").mkdir(parents=True)
    (out / "checkpoints" / "step_000000" / "state.json").write_text('{"merge": {"steps": [10, 20]}}')
    monkeypatch.setattr(merge, "average", lambda source, last, dest: Path(dest))
    assert main(["merge", str(tmp_path / "run"), "--method", "average", "--out", str(out)]) == 0
    said, line = capsys.readouterr().out.strip().splitlines()[-2:]
    assert said.startswith("averaged checkpoints 10, 20 of ")  # which went in: step 0 and unhealthy ones do not
    train, export = line.removeprefix("train on: ").split("; export: ")
    assert shlex.split(export) == ["trimtab", "export", str(out), "--out", "DIR"]
    assert shlex.split(train)[:2] == ["trimtab", "train"] and str(out / "config.yaml") in shlex.split(train)


def test_the_kept_mode_hint_names_a_ctl_command_that_works_once_the_run_has_stopped(tmp_path, capsys, caplog):
    """`ctl mode off` persists across a relaunch, which says how to give the config's mode back:
    the command it names for a stopped run is taken (the bare `ctl RUN mode auto` is refused)."""
    import re
    import shlex

    out, fast = str(tmp_path / "r"), [*FAST, "--set", "log.report=false"]
    assert main(["train", "--preset", "debug", "--out", out, "--max-steps", "2", *fast]) == 0
    assert main(["ctl", "--queue", out, "mode", "off"]) == 0
    assert main(["train", "--preset", "debug", "--out", out, "--max-steps", "3", *fast]) == 0
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="trimtab"):
        assert main(["train", "--preset", "debug", "--out", out, "--max-steps", "4", *fast]) == 0
    said = caplog.text + "".join(capsys.readouterr())
    assert "mode off, as `trimtab ctl mode` set it (the config says auto)" in said
    stopped = re.search(r"once it has stopped, `(trimtab ctl [^`]*)`", said)
    assert stopped is not None, said
    argv = [out if a == "RUN" else a for a in shlex.split(stopped.group(1))[1:]]
    assert main(argv) == 0
    assert "the run is not running: it applies it when it resumes" in capsys.readouterr().out
