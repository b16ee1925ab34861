"""`trimtab train` and `trimtab generate` as a user runs them: the README's commands, resumes,
exit codes, one-line errors, signals (real processes)."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import FAST, trimtab_cli
from trimtab.checkpoint import list_checkpoints
from trimtab.cli import main
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
