"""The CLI as a user runs it: exit codes, one-line errors, the README's commands."""

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import FAST, trimtab_cli
from trimtab import benchmarks
from trimtab.checkpoint import list_checkpoints
from trimtab.cli import build_parser, main
from trimtab.rundir import read_decisions
from trimtab.runlock import run_lock


def test_train_resume_and_generate_like_the_readme(tmp_path, capsys):
    out = str(tmp_path / "r1")
    assert main(["train", "--preset", "debug", "--out", out, "--max-steps", "6", *FAST]) == 0
    assert "completed: step 6/6" in capsys.readouterr().out
    assert main(["train", "--preset", "debug", "--out", out, "--max-steps", "10", *FAST]) == 0
    captured = capsys.readouterr()
    assert "completed: step 10/10 (4 this session," in captured.out
    assert [p.name for p in list_checkpoints(tmp_path / "r1")][-1] == "step_000010"
    assert main(["generate", out, "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_generate_cuts_a_long_prompt_to_leave_room_for_the_new_tokens(debug_run, caplog):
    """A prompt past the model's context (128 positions in debug) is cut to its end so that the
    100 new tokens asked for fit, said (it was cut to 127 tokens: a one-token answer)."""
    out = str(debug_run)  # generate only reads the run
    with caplog.at_level(logging.WARNING, logger="trimtab"):
        assert main(["generate", out, "--prompt", "x " * 400, "--max-new-tokens", "100"]) == 0
    assert "new ones asked for pass the model's 128 positions: the prompt is cut to its last 28 tokens" in caplog.text


@pytest.mark.parametrize("preset", ["debug-moe", "debug-mod", "debug-hybrid"])
def test_sparse_presets_train_and_generate_from_the_cli(tmp_path, capsys, preset):
    out = str(tmp_path / preset)
    assert main(["train", "--preset", preset, "--out", out, "--max-steps", "4", *FAST]) == 0
    assert "active per token" in capsys.readouterr().out or preset == "debug-mod"
    assert main(["generate", out, "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_yaml_file_and_set_override(tmp_path, capsys):
    cfg = tmp_path / "my.yaml"
    cfg.write_text(f"preset: debug\nout: {tmp_path / 'y'}\ntrain:\n  max_steps: 3\n")
    assert main(["train", str(cfg), "--set", "optim.lr=3e-4", *FAST]) == 0
    saved = (tmp_path / "y" / "config.yaml").read_text()
    assert "lr: 0.0003" in saved and "max_steps: 3" in saved


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--preset", "nope"], "unknown preset 'nope'"),
        (["train", "--set", "optim.lrr=1"], "did you mean 'optim.lr'"),
        (["train", "missing.yaml"], "config file 'missing.yaml' does not exist"),
        (["train", "--preset", "debug", "--set", "data.seq_len=999"], "larger than the model's"),
        (["train", "--preset", "debug", "--set", "data.source=/no/such/dir"], "does not exist"),
        (["train", "--preset", "debug", "--set", "train.init_from=/no/such/run"], "'/no/such/run' does not exist"),
        (["generate", "/no/such/run"], "is neither a run directory"),
        (["export", "/no/such/run", "--out", "/tmp/x"], "is not a run directory"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(argv, message, capsys, tmp_path):
    assert main([*argv, *(["--out", str(tmp_path / "x")] if argv[0] == "train" else [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("trimtab: error: ") and message in err[-1]
    assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "x").exists()  # bad input never leaves a run directory behind


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "RUN", "--max-new-tokens", "-3"], "argument --max-new-tokens: must be at least 1, got -3"),
        (
            ["generate", "RUN", "--temperature", "nan"],
            "argument --temperature: must be a finite number at least 0, got nan",
        ),
        (["generate", "RUN", "--top-p", "0"], "argument --top-p: must be above 0 and at most 1, got 0"),
        (["generate", "RUN", "--top-k", "-1"], "argument --top-k: must be at least 0, got -1"),
        (["eval", "RUN", "--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
        (["eval", "RUN", "--limit", "-1"], "argument --limit: must be above 0, got -1"),
        (["tune", "SPACE", "--trials", "0"], "argument --trials: must be at least 1, got 0"),
        (["plan", "--dataset-tokens", "nan"], "argument --dataset-tokens: must be a finite number above 0, got nan"),
        (["plan", "--budget-flops", "inf"], "argument --budget-flops: must be a finite number above 0, got inf"),
        (["plan", "--budget-hours", "0"], "argument --budget-hours: must be above 0, got 0"),
        (["plan", "--gpus", "0"], "argument --gpus/--devices: must be at least 1, got 0"),
        (["data", "prepare", "x", "--out", "y", "--vocab-size", "1"], "--vocab-size: must be at least 262, got 1"),
        (["merge", "R", "--out", "y", "--last", "0"], "argument --last: must be at least 1, got 0"),
    ],
)
def test_numeric_flags_out_of_range_are_refused_naming_the_flag(argv, message, capsys):
    """Each of these was a traceback from deep inside (range() step 0, islice) or a silent
    fallback (a negative temperature sampled greedily)."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    ok = build_parser().parse_args(["generate", "RUN", "--temperature", "0", "--top-p", "1", "--max-new-tokens", "1"])
    assert (ok.temperature, ok.top_p, ok.max_new_tokens) == (0.0, 1.0, 1)


def test_empty_corpus_and_malformed_jsonl(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["train", "--preset", "debug", "--out", str(tmp_path / "a"), "--set", f"data.source={empty}"]) == 2
    assert "empty" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    assert main(["train", "--preset", "debug", "--out", str(tmp_path / "b"), "--set", f"data.source={bad}"]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path):
    """A real SIGTERM to `python -m trimtab train`: checkpoint, exit 143 (128 + SIGTERM: a scheduler, or a
    wrapper relaunching until exit 0, reads a preempted run as not done; it exited 0, read as finished), the
    summary's exit_code the same, and the same command resumes."""
    out = tmp_path / "r"
    cmd = [
        sys.executable,
        "-m",
        "trimtab",
        "train",
        "--preset",
        "debug",
        "--out",
        str(out),
        "--max-steps",
        "100000",
        *FAST,
        "--set",
        "checkpoint.every=0",
        "--set",
        "train.log_every=1",
        # eager, no report: 100000 steps would be long enough for auto to compile (~8 s of imports)
        "--set",
        "train.compile=false",
        "--set",
        "log.report=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "metrics.jsonl").is_file():
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert "stopped (SIGTERM)" in stdout and json.loads((out / "summary.json").read_text())["exit_code"] == 143
    initial, ckpt = list_checkpoints(out)  # step 0 (the initial weights) and the one the signal wrote
    step = int(ckpt.name.split("_")[1])
    assert initial.name == "step_000000"
    assert step > 0
    # the same command again, forked by the fork server (trimtab.cli.main in a fresh process)
    resumed = trimtab_cli([*cmd[3:9], str(step + 2), *cmd[10:]], tmp_path, env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"completed: step {step + 2}/{step + 2}" in resumed.stdout
    assert f"resuming from {ckpt}" in resumed.stderr


def test_sigterm_during_start_up_exits_143_and_the_rerun_trains(tmp_path):
    """A real SIGTERM while `python -m trimtab train` trains its tokenizer: exit 143 with one line,
    nothing written, and the same command then trains."""
    out = tmp_path / "r"
    slow = ["--set", "data.max_bytes=1000000"]  # on a fresh cache: a second or more of tokenizer training
    cmd = [sys.executable, "-m", "trimtab", "train", "--preset", "debug", "--out", str(out), "--max-steps", "2"]
    cmd += [*FAST[2:], *slow]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRIMTAB_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and not (out / ".lock").exists():
        time.sleep(0.02)  # the run lock: torch is imported and setup() is reading the data
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert stdout == "" and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        "trimtab: stopped by SIGTERM during start-up at step 0; nothing new was trained; "
        "re-run the same command to resume"
    )
    assert not out.exists()  # stopped before it wrote anything: not even an empty run directory
    assert not [p for p in (tmp_path / "cache").rglob("*") if ".tmp" in p.name]
    rerun = trimtab_cli(cmd[3:], tmp_path, env)  # the fork server's fresh process: torch imported once
    assert rerun.returncode == 0, rerun.stderr
    assert "completed: step 2/2 (2 this session," in rerun.stdout


def test_a_resume_over_a_corpus_edited_to_as_many_rows_is_refused(tmp_path, capsys):
    """The corpus reordered between two sessions cuts into as many rows as before: resumed, the
    run would draw other rows at its checkpoint's positions (and a rollback would leave other rows
    out) without a word. The resume is refused naming the source; the data restored resumes."""
    data = tmp_path / "code.jsonl"
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n"}) for i in range(400)]
    data.write_text("\n".join(lines) + "\n")
    train = ["train", "--preset", "debug", "--out", str(tmp_path / "r"), *FAST, "--set", f"data.source={data}"]
    train += ["--set", "data.eval_fraction=0", "--set", "checkpoint.every=2", "--set", "log.report=false"]
    assert main([*train, "--max-steps", "2"]) == 0
    data.write_text("\n".join(reversed(lines)) + "\n")  # the same documents, the same tokens in all
    capsys.readouterr()
    assert main([*train, "--max-steps", "4"]) == 2
    err = capsys.readouterr().err
    assert "read other data in code than the data now gives: as many rows (" in err and "train.init_from" in err
    data.write_text("\n".join(lines) + "\n")
    assert main([*train, "--max-steps", "4"]) == 0
    assert "completed: step 4/4 (2 this session" in capsys.readouterr().out


def test_a_finished_run_says_so_in_one_line_and_exits_zero(tmp_path, capsys):
    out = tmp_path / "r"
    train = ["train", "--preset", "debug", "--out", str(out), *FAST]
    assert main([*train, "--max-steps", "2"]) == 0
    capsys.readouterr()
    summary = (out / "summary.json").read_text()
    assert main([*train, "--max-steps", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and (out / "summary.json").read_text() == summary
    assert captured.err.strip().splitlines()[-1] == (
        f"trimtab: {out} has finished: it is at step 2 of 2 (train.max_steps 2); nothing was trained and "
        "nothing in it changed. A larger --max-steps (train.max_steps) trains on"
    )


def test_a_lost_peer_ends_a_survivor_in_one_line_with_a_failing_status(tmp_path, capsys, monkeypatch):
    """A survivor's collective failing for a lost peer (gloo's words) ends with one line naming the newest
    checkpoint and exit 1, torchrun's cue to restart; any other RuntimeError keeps its traceback."""
    from trimtab import api

    out = tmp_path / "r"
    (out / "checkpoints" / "step_000009").mkdir(parents=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    gloo = "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9886"
    errors = iter([RuntimeError(gloo), RuntimeError("an unrecognised failure")])

    def fail(config, hooks=()):
        raise next(errors)

    monkeypatch.setattr(api, "train_or_raise", fail)
    train = ["train", "--preset", "debug", "--out", str(out)]
    assert main(train) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "trimtab: rank 0: ended, a peer was lost (RuntimeError: Connection closed by peer, the peer at "
        "127.0.0.1:9886); the newest checkpoint is "
        "step 9: torchrun restarts the job from it (--max-restarts), or the same command resumes it"
    ]
    with pytest.raises(RuntimeError, match="unrecognised"):
        main(train)


def test_init_from_weights_of_another_model_names_the_settings_and_the_command_that_fits(tmp_path, capsys):
    """train.init_from a run of another model (the default preset's is not a merge's or a debug
    run's): the differing model.* settings and a command with that run's config.yaml, which trains."""
    base, fast = tmp_path / "base", [*FAST, "--max-steps", "1"]
    assert main(["train", "--preset", "debug", "--out", str(base), *fast]) == 0
    capsys.readouterr()
    other = ["--set", f"train.init_from={base}", "--out", str(tmp_path / "other")]
    assert main(["train", "--preset", "debug-moe", *other, *fast]) == 2
    err = capsys.readouterr().err
    assert f"'train.init_from' = '{base}' holds another model than this run's (model.n_layers 5 there" in err
    assert "model.layer_pattern [] there, ['dense', 'moe'] here" in err
    assert f"trimtab train {base / 'config.yaml'} --set train.init_from={base} --out DIR" in err
    assert main(["train", str(base / "config.yaml"), *other, *fast]) == 0


def test_output_into_a_closed_pipe_ends_quietly_and_runs_help_names_every_column(tmp_path):
    """`trimtab presets | head -1`: the reader left; no traceback, exit 0. `runs --help` lists
    every column --sort takes."""
    script = (
        "import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
        "from trimtab.cli import main; sys.exit(main(['presets']))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    from trimtab.report.runs import COLUMNS

    runs = build_parser()._subparsers._group_actions[0].choices["runs"]
    sort = next(a for a in runs._actions if a.dest == "sort")
    assert all(column in sort.help for column in COLUMNS), sort.help


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


# subcommand -> (its option strings, its positional names in order)
CLI_SURFACE = {
    "train": ({"-h", "--help", "--preset", "--out", "--max-steps", "--set", "--inject", "--orchestrator"}, ["config"]),
    # issue 33: `rl` trains with the rl section on, train's flags (docs/rl.md)
    "rl": ({"-h", "--help", "--preset", "--out", "--max-steps", "--set", "--inject", "--orchestrator"}, ["config"]),
    # issue 33: `dpo` trains with the dpo section on, train's flags (docs/rl.md, DPO)
    "dpo": ({"-h", "--help", "--preset", "--out", "--max-steps", "--set", "--inject", "--orchestrator"}, ["config"]),
    "ctl": ({"-h", "--help", "--queue"}, ["run_dir", "action", "args"]),
    "bench": ({"-h", "--help"}, ["name", "args"]),
    "generate": (
        {"-h", "--help", "--prompt", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed"},
        ["run_dir"],
    ),
    "plan": (
        {
            "-h",
            "--help",
            "--preset",
            "--out",
            "--set",
            "--dataset-tokens",
            "--data",
            "--budget-flops",
            "--budget-hours",
            "--gpu",
            "--gpus",
            "--devices",
            "--gpus-per-node",
            "--emit",  # issue 34: a Slurm script or a PyTorchJob from the plan
        },
        ["config"],
    ),
    # --set (eval and doctor, as train's): a run's own settings over the run's config or the preset
    "eval": (
        {
            "-h",
            "--help",
            "--tasks",
            "--include-path",
            "--limit",
            "--num-fewshot",
            "--batch-size",
            "--data",
            "--stride",
            "--set",
            # a run's held-out rows again, per source; a prepared directory's split (data/held_out.py)
            "--held-out",
            "--split",
        },
        ["path"],
    ),
    # --snapshot (issue 34): a lean bf16 snapshot exported instead of a checkpoint
    "export": ({"-h", "--help", "--out", "--step", "--snapshot", "--dtype"}, ["run_dir"]),
    "merge": ({"-h", "--help", "--out", "--method", "--last"}, ["source"]),
    "presets": ({"-h", "--help"}, []),
    "data": ({"-h", "--help"}, ["data_command"]),
    "doctor": ({"-h", "--help", "--preset", "--device", "--nproc", "--strategy", "--set", "--json"}, []),
    # issue 15, the experiment loop: `report` and `tune` (docs/architecture.md section 4, CLI);
    # `runs` lists run directories
    "tune": ({"-h", "--help", "--trials", "--workers", "--storage", "--out"}, ["space"]),
    "report": ({"-h", "--help", "--out"}, ["runs"]),
    "runs": ({"-h", "--help", "--sort", "--reverse", "--json"}, ["root"]),
}


def test_the_cli_surface_is_frozen():
    """The CLI surface (docs/architecture.md section 4) is small and stable; people's scripts call it."""
    [subcommands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    surface = {
        name: ({o for a in p._actions for o in a.option_strings}, [a.dest for a in p._actions if not a.option_strings])
        for name, p in subcommands.choices.items()
    }
    assert surface == CLI_SURFACE, (
        "the CLI surface changed (a subcommand, option or positional was added, renamed or removed). Changing it "
        "is a deliberate act: if you mean it, update CLI_SURFACE in this test in the same commit and say why there."
    )


def test_trimtab_help_lists_the_subcommands_in_their_order():
    """cli.py declares each subcommand above its handler: the handlers' order is `trimtab --help`'s."""
    [subcommands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(subcommands.choices) == [
        *("train", "rl", "dpo", "ctl", "bench", "generate", "export", "eval", "merge"),
        *("data", "plan", "tune", "report", "runs", "presets", "doctor"),
    ]


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


def test_a_second_ctrl_c_ends_train_with_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    """The first Ctrl-C asks for a stop after the step; a second raises KeyboardInterrupt at once
    (Python's handler is back): one line naming where the run resumes, no traceback, exit 130."""
    from trimtab import api

    out = tmp_path / "r"
    (out / "checkpoints" / "step_000004").mkdir(parents=True)

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "train_or_raise", interrupted)
    assert main(["train", "--preset", "debug", "--out", str(out), "--max-steps", "9"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "trimtab: stopped at once by a second Ctrl-C; the same command resumes from the last checkpoint (step 4)"
    ]


def test_generate_says_the_checkpoint_step_it_samples_from_and_that_the_run_is_still_training(
    tmp_path, caplog, monkeypatch, tokenizer
):
    """`trimtab generate` on a run still training sampled its newest checkpoint without saying which.
    The run's loading is stood in for (a tiny model, its checkpoint at step 7): a real run costs ~10 s."""
    from trimtab import api
    from trimtab.config import ModelConfig
    from trimtab.model import build_model

    model = build_model(ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_layers=1, n_heads=2, max_seq_len=16))
    monkeypatch.setattr(api, "load_run_at", lambda run_dir: (None, model.eval(), tokenizer, 7))
    with run_lock(tmp_path), caplog.at_level(logging.INFO, logger="trimtab"):  # as a `trimtab train` holds it
        assert main(["generate", str(tmp_path), "--max-new-tokens", "2"]) == 0
    assert f"sampling from the checkpoint at step 7 of {tmp_path} (the run is still training" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trimtab"):  # the run has ended: its step, nothing more
        api.generate(tmp_path, "", 2)
    assert f"sampling from the checkpoint at step 7 of {tmp_path}\n" in caplog.text + "\n"
    assert "still training" not in caplog.text


class _RefusedAtStart:
    """The Trainer as far as a refused start goes: the goodput ledger (Resilience) opens this session,
    then a later hook refuses the config in its on_train_start, as orchestrator/faults.py does
    `--inject expert_collapse@3` on a dense model."""

    def __init__(self, built, hooks):
        from types import SimpleNamespace

        self.hooks, self.state = hooks, SimpleNamespace(step=0)

    def fit(self):
        from types import SimpleNamespace

        from trimtab.errors import ConfigError
        from trimtab.orchestrator.restarts import Resilience

        run = SimpleNamespace(is_main=True, step=0, world=1, say=print, propose=lambda f: None, data_position=None)
        next(h for h in self.hooks if isinstance(h, Resilience)).on_train_start(run)
        raise ConfigError("faults: expert_collapse needs a Mixture-of-Experts model (e.g. --preset debug-moe)")


def test_a_start_refused_by_a_hook_leaves_no_session_the_next_launch_reads_as_lost(tmp_path, monkeypatch):
    """A start refused (exit 2) after the goodput ledger opened its session left it open: the next launch
    into the folder journaled 'step 0 restart: the process ended without a word (SIGKILL...) ... 4.1 s
    down'. The session is closed as refused instead. (The real refusal costs ~5 s of set-up: stood in for.)"""
    from trimtab import api
    from trimtab.config import load_config
    from trimtab.resilience.goodput import Ledger

    monkeypatch.setattr(api, "setup", lambda config: None)
    monkeypatch.setattr(api, "Trainer", _RefusedAtStart)
    cfg = load_config(preset="debug", sets=[f"out={tmp_path / 'r'}"])
    cfg.run_dir.mkdir()
    (cfg.run_dir / "config.yaml").write_text("{}")  # a run there already (a new one refused is removed whole)
    with pytest.raises(api.TrimtabError, match="expert_collapse needs a Mixture-of-Experts model"):
        api.train_or_raise(cfg)
    assert Ledger(cfg.run_dir).sessions[-1]["end"] == "refused at start-up"
    assert Ledger(cfg.run_dir).open(time.time(), 0, 1, 0, 0.0) is None  # the next session: no restart incident


class _TrainerWritesConfig:
    """The Trainer as far as a resume goes: it writes config.yaml (Checkpointing.resume) on construction."""

    def __init__(self, built, hooks):
        (built.cfg.run_dir / "config.yaml").write_text("rewritten")


def test_a_resume_refused_for_a_fault_its_model_cannot_take_leaves_config_yaml_as_it_was(tmp_path, monkeypatch):
    """`--inject expert_collapse@7` added to a dense run's resume was refused in the injector's
    on_train_start, after the Trainer had rewritten config.yaml with the refused fault in it (and
    faults.json with its spec): the run's record named a fault it never had. Refused now before the Trainer."""
    from types import SimpleNamespace

    from trimtab import api
    from trimtab.config import load_config

    cfg = load_config(preset="debug", sets=[f"out={tmp_path / 'r'}"], overrides={"faults": ["expert_collapse@7"]})
    cfg.run_dir.mkdir()
    (cfg.run_dir / "config.yaml").write_text("as trained")
    dense = SimpleNamespace(moe_layers=lambda: [])
    built = SimpleNamespace(
        cfg=cfg,
        model=dense,
        dist=SimpleNamespace(world=1),
        resume=(cfg.run_dir / "checkpoints" / "step_5", {"train": {"step": 5}}),
        phases=[SimpleNamespace(train_rows=[])],
    )
    monkeypatch.setattr(api, "setup", lambda config: built)
    monkeypatch.setattr(api, "Trainer", _TrainerWritesConfig)
    with pytest.raises(api.TrimtabError, match="expert_collapse needs a Mixture-of-Experts model"):
        api.train_or_raise(cfg)
    assert (cfg.run_dir / "config.yaml").read_text() == "as trained"
    assert not (cfg.run_dir / "faults.json").exists()


def _writes_run_files(config) -> None:
    """setup()'s writes on a new run (prepare_run_dir), stood in for."""
    (config.run_dir / "config.yaml").write_text("{}")
    (config.run_dir / "checkpoints").mkdir()


@pytest.mark.parametrize("own_file", [False, True])
def test_a_new_run_refused_at_start_leaves_no_run_behind(tmp_path, monkeypatch, own_file, caplog):
    """`--inject expert_collapse@3` on a dense model is refused as the run starts, after setup wrote
    config.yaml and the hooks their files: the folder read as a failed run in `trimtab runs` and a re-run
    resumed it as its own. What the refused session wrote is removed (the folder too, if it made it);
    a file that was there before stays."""
    from trimtab import api
    from trimtab.config import load_config

    monkeypatch.setattr(api, "setup", _writes_run_files)
    monkeypatch.setattr(api, "Trainer", _RefusedAtStart)
    cfg = load_config(preset="debug", sets=[f"out={tmp_path / 'r'}"])
    if own_file:
        cfg.run_dir.mkdir()
        (cfg.run_dir / "notes.txt").write_text("mine")
    with pytest.raises(api.TrimtabError, match="expert_collapse needs a Mixture-of-Experts model"):
        with caplog.at_level(logging.INFO, logger="trimtab.api"):
            api.train_or_raise(cfg)
    left = sorted(p.name for p in cfg.run_dir.iterdir()) if cfg.run_dir.exists() else None
    assert left == (["notes.txt"] if own_file else None)
    # said as it is ("refused at start-up: r holds nothing of this session" read as a run lost)
    removed = f"what it had written into {cfg.run_dir} is removed" if own_file else "the directory it made is removed"
    assert f"the run was refused before it started: {removed}" in caplog.text


def test_a_new_run_refused_in_an_empty_folder_the_user_made_leaves_the_folder(tmp_path, monkeypatch):
    """`mkdir -m 700 runs/x` then a start refused there (`--inject expert_collapse@10` on debug): the
    user's empty folder was removed with what the session wrote, as if the session had made it."""
    from trimtab import api
    from trimtab.config import load_config

    monkeypatch.setattr(api, "setup", _writes_run_files)
    monkeypatch.setattr(api, "Trainer", _RefusedAtStart)
    cfg = load_config(preset="debug", sets=[f"out={tmp_path / 'r'}"])
    cfg.run_dir.mkdir(mode=0o700)
    with pytest.raises(api.TrimtabError, match="expert_collapse needs a Mixture-of-Experts model"):
        api.train_or_raise(cfg)
    assert cfg.run_dir.is_dir() and not any(cfg.run_dir.iterdir())
    assert cfg.run_dir.stat().st_mode & 0o777 == 0o700
