"""The CLI's surface as a user meets it: its subcommands and options, frozen; bad input and
out-of-range flags as one clear line and exit 2; help texts. The commands themselves:
test_cli_train.py (train, generate, signals), test_cli_start.py (a start refused),
test_cli_tools.py (bench, ctl, merge)."""

import argparse
import subprocess
import sys

import pytest

from trimtab.cli import build_parser, main


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
            # the results' folder: a Hugging Face directory stays as exported (evaluation/harness.py results_folder)
            "--out",
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
