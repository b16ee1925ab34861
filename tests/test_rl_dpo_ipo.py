"""`trimtab dpo --set dpo.loss=ipo` trains: IPO's loss weighs the log-ratio's gradient by
2 (h - 1 / (2 beta)), -1 / beta at the reference, so its pre-clip norm stands ~1 / beta times
another loss's from the first step. The grad rule's absolute ceiling (100, a likelihood's) had
withheld every update, rolled back three times and stopped the run with exit code 3."""

import argparse

from helpers import trimtab_cli
from trimtab.cli_train import _train_config
from trimtab.config import load_config, resolve
from trimtab.rundir import read_decisions

FAST = ["--set", "log.progress=false", "--set", "log.report=false", "--set", "train.log_every=1"]


def _cfg(*sets: str):
    args = argparse.Namespace(config=None, preset="debug", out=None, max_steps=None, orchestrator=None, inject=[])
    args.set = list(sets)
    return _train_config(args, "dpo")


def test_ipo_raises_the_grad_ceiling_by_one_over_beta_unless_the_user_set_it():
    assert _cfg("dpo.loss=ipo").orchestrator.grad.max_norm == 1000.0  # beta 0.1
    assert _cfg("dpo.loss=ipo", "dpo.beta=0.5").orchestrator.grad.max_norm == 200.0
    assert _cfg("dpo.loss=sigmoid").orchestrator.grad.max_norm == 100.0
    assert _cfg("dpo.loss=ipo", "orchestrator.grad.max_norm=50").orchestrator.grad.max_norm == 50.0
    # the library's path too (resolve), and once: a resolved config resolved again keeps it
    cfg = load_config(preset="debug", overrides={"dpo": {"enabled": True, "loss": "ipo"}})
    assert cfg.orchestrator.grad.max_norm == 1000.0 and resolve(cfg.to_dict()).orchestrator.grad.max_norm == 1000.0


def test_an_ipo_run_from_a_warm_start_trains_every_step(tmp_path, debug_run):
    base = debug_run
    out = tmp_path / "ipo"
    args = ["--preset", "debug", "--out", str(out), "--max-steps", "4", *FAST, "--set", f"train.init_from={base}"]
    args += ["--set", "dpo.loss=ipo", "--set", "dpo.pairs_per_step=8", "--set", "dpo.held_out=8"]
    args += ["--set", "optim.lr=1e-4", "--set", "optim.warmup_steps=0", "--set", "train.eval_every=0"]
    done = trimtab_cli(["dpo", *args], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [d for d in read_decisions(out) if d["rule"] == "grad"] == []  # no update withheld
