"""A resumed RL run whose config a person edited (training/changes.py, training/checkpointing.py
resume): an edit the run cannot take is refused before config.yaml is written or anything is
journaled, naming the key to set back; an edit of a section the run never reads is said to have no
effect."""

import json
import shutil

import pytest

from helpers import trimtab_cli
from trimtab.config import load_config
from trimtab.rundir import read_decisions
from trimtab.training.changes import config_changes

# one worker for the module (--dist loadgroup): its module-scoped stopped RL run is made once, not on each worker
pytestmark = pytest.mark.xdist_group("test_rl_resume")

RL = [
    "--preset", "debug",
    "--set", "log.progress=false", "--set", "log.report=false", "--set", "train.log_every=1",
    "--set", "rl.prompts_per_step=4", "--set", "rl.group_size=4", "--set", "rl.max_new_tokens=2",
    "--set", "rl.held_out=0", "--set", "rl.reward=python:rl_verifiers:starts_with_space",
    "--set", "optim.warmup_steps=0", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=1",
    # rl_reward keeps the start's policy (step 0, its rollback target) from pruning until a window
    # passes: off, so the run keeps no step-0 checkpoint, as one without it and without a KL term
    "--set", "orchestrator.rl_reward.enabled=false",
]  # fmt: skip


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, debug_run):
    """An RL run (on the built-in arithmetic prompts) of 4 steps, without a KL term (nor rl_reward's
    start kept): its step-0 checkpoint is pruned (checkpoint.keep 1). Each test resumes a copy of it to step 6."""
    root = tmp_path_factory.mktemp("rl")
    base = debug_run
    out = root / "run"
    args = [*RL, "--out", str(out), "--max-steps", "4", "--set", f"train.init_from={base}"]
    done = trimtab_cli(["rl", *args], root)
    assert done.returncode == 0 and not (out / "checkpoints/step_000000").exists(), done.stderr[-3000:]
    return out


def resume(stopped, tmp_path, *sets: str):
    """The run, copied, resumed to step 6 with these --set items; the run's directory too."""
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    edits = [item for key in sets for item in ("--set", key)]
    return trimtab_cli(["rl", *RL, "--out", str(out), "--max-steps", "6", *edits], tmp_path), out


def test_a_kl_term_turned_on_without_its_reference_is_refused_before_anything_changes(stopped, tmp_path):
    """rl.kl_coef 0 -> 0.1: the KL term's reference is the run's step-0 checkpoint, which a run
    without the term does not keep. The reference loads at the first step, after the resume had
    rewritten config.yaml (kl_coef 0.1 there: the next plain resume said 0.1 -> 0) and journaled
    the change as in effect; now the resume is refused first, naming the key and the ways on."""
    config = (stopped / "config.yaml").read_text()
    done, out = resume(stopped, tmp_path, "rl.kl_coef=0.1")
    assert done.returncode == 2, done.stderr[-2000:]
    assert (out / "config.yaml").read_text() == config
    assert not [d for d in read_decisions(out) if d["evidence"].get("key") == "rl.kl_coef"]
    assert "rl.kl_coef" in done.stderr and "resume with rl.kl_coef=0" in done.stderr, done.stderr[-2000:]
    assert f"train.init_from={out}" in done.stderr


def test_a_new_seed_for_the_built_in_prompts_is_refused_naming_train_seed(stopped, tmp_path):
    """The built-in task's problems are drawn from train.seed: another seed is other prompts, and
    the refusal named rl.prompts (which the person never touched); it names the seed to resume with."""
    done, _ = resume(stopped, tmp_path, "train.seed=7")
    assert done.returncode == 2, done.stderr[-2000:]
    seed = load_config(preset="debug").train.seed
    assert f"train.seed={seed}" in done.stderr and "rl.prompts holds now" not in done.stderr, done.stderr[-2000:]


def test_a_dpo_edit_on_an_rl_run_is_journaled_without_effect(stopped, tmp_path):
    """dpo.* is read by `trimtab dpo` only: an RL run resumed with dpo.beta changed trains as
    before, and the change is said and journaled as having no effect (it read "in effect from
    this step"); an rl.* edit is in effect."""
    done, out = resume(stopped, tmp_path, "dpo.beta=0.5", "rl.entropy_coef=0.01")
    assert done.returncode == 0, done.stderr[-2000:]
    effects = {d["evidence"]["key"]: d["evidence"]["effect"] for d in read_decisions(out) if d["rule"] == "config"}
    assert effects["dpo.beta"].startswith("no effect: this is not a DPO run"), effects
    assert effects["rl.entropy_coef"] == "in effect from this step"
    assert "dpo.beta 0.1 -> 0.5 (no effect" in done.stdout + done.stderr


def test_rl_settings_on_a_pretraining_run_have_no_effect():
    saved = load_config(preset="debug")
    edited = load_config(preset="debug", sets=["rl.group_size=4", "dpo.beta=0.5", "optim.lr=1e-3"])
    effects = {c["key"]: c["effect"] for c in config_changes(saved, edited)}
    assert effects["rl.group_size"] == "no effect: this is not an RL run (only trimtab rl reads rl.*)"
    assert effects["dpo.beta"] == "no effect: this is not a DPO run (only trimtab dpo reads dpo.*)"
    assert effects["optim.lr"].startswith("LR x")
    assert json.dumps(effects)  # journaled as JSON
