"""A relaunch that asks for fewer steps than the run has already trained is a usage error (exit 2,
naming train.max_steps, the step and the fix), not a success a scheduler would read as done; a
finished run relaunched at its length still exits 0, and trimtab.train() still returns the summary."""

import logging

import trimtab
from helpers import FAST
from test_trainer import debug_cfg, files_of
from trimtab.cli import main


def test_a_relaunch_shorter_than_the_run_exits_2_and_one_at_its_length_exits_0(tmp_path, capsys, caplog):
    out = tmp_path / "r"
    train = ["train", "--preset", "debug", "--out", str(out), *FAST, "--set", "checkpoint.every=2"]
    assert main([*train, "--max-steps", "6", "--inject", "sigterm@4"]) == 143  # stopped at 4, saved there: not done
    before = files_of(out)
    for steps in ("4", "3"):  # at 4 but on the way to 6; past 3
        capsys.readouterr()
        assert main([*train, "--max-steps", steps]) == 2, steps
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"trimtab: error: {out} ") and f"(train.max_steps {steps})" in err, err
        assert "step 4" in err and "--max-steps (train.max_steps)" in err, err
        assert "trains on (6: the run as it was), or a new --out trains a new run of" in err, err
        assert files_of(out) == before  # nothing trained, nothing written
    with caplog.at_level(logging.WARNING):  # the Python API: the summary back, with the reason warned
        summary = trimtab.train(debug_cfg(out, steps=3, sets=["checkpoint.every=2"]))
    assert summary["step"] == 4 and summary["status"].startswith("stopped (")
    assert "past the 3 steps asked for" in caplog.text and files_of(out) == before
    assert main([*train, "--max-steps", "6"]) == 0  # trained on to its length
    capsys.readouterr()
    assert main([*train, "--max-steps", "6"]) == 0  # complete at exactly the length asked for
    assert f"trimtab: {out} has finished: it is at step 6 of 6" in capsys.readouterr().err
