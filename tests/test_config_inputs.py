"""A new user's bad inputs to the config and the planner: each is refused (or said) naming the
file's line or the config key and the fix, never a Python traceback or a silently dropped value."""

import logging
import math

import pytest

from trimtab.cli import build_parser
from trimtab.cli_train import _train_config
from trimtab.config import load_config
from trimtab.errors import ConfigError
from trimtab.plan import Hardware, make_plan
from trimtab.plan.report import format_plan

HW = Hardware(name="test", kind="cuda", precision="bf16", peak_flops=1e12, peak_source="test", memory_bytes=10**9)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # a second section of the same name: PyYAML kept the last, d_model 64 was dropped without a word
        (
            "model:\n  d_model: 64\nmodel:\n  n_layers: 2\n",
            ":3: key 'model' is written twice in one section (first on line 1)",
        ),
        ("train:\n  batch_tokens: 2048\n  batch_tokens: 4096\n", ":3: key 'batch_tokens' is written twice"),
    ],
)
def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="merge the two into one") as err:
        load_config(path, preset="debug")
    assert f"{path}{message}" in str(err.value)


def test_a_key_merged_from_an_anchor_may_be_overridden(tmp_path):
    path = tmp_path / "run.yaml"  # `<<:` is YAML's own merge: the explicit key wins, no duplicate
    path.write_text("optim:\n  <<: {lr: 0.1, warmup_steps: 3}\n  lr: 0.2\n")
    optim = load_config(path, preset="debug").optim
    assert (optim.lr, optim.warmup_steps) == (0.2, 3)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        # each reached torch as a tensor shape or the planner's arithmetic: a traceback
        ("model.ffn_hidden=-5", "config key 'model.ffn_hidden' must be >= 0 (0: 8/3 d_model), got -5"),
        ("model.vocab_size=-5", "config key 'model.vocab_size' must be >= 0 (0: the tokenizer's), got -5"),
        ("plan.tokens_per_param=inf", "config key 'plan.tokens_per_param' must be a finite number > 0"),
    ],
)
def test_sizes_the_model_or_planner_cannot_take_are_refused_naming_the_key(item, message):
    with pytest.raises(ConfigError) as err:
        load_config(preset="debug", sets=[item])
    assert message in str(err.value)


def test_a_tiny_tokens_per_param_plans_at_least_one_token():
    cfg = load_config(preset="debug", sets=["plan.tokens_per_param=1e-9"])  # 557,088 x 1e-9 rounded to 0
    plan = make_plan(cfg, hardware=HW)  # ZeroDivisionError in its notes
    assert (plan.optimal_tokens, plan.steps) == (1, 1)
    auto = make_plan(
        load_config(preset="debug", sets=["plan.tokens_per_param=1e-9", "train.max_steps=auto"]), hardware=HW
    )
    assert auto.run_steps == 1  # as training's resolve_max_steps: never 0 steps


def test_the_configured_run_follows_train_epochs_which_wins_over_max_steps():
    cfg = load_config(preset="debug", sets=["train.epochs=5"])  # max_steps 100 is overridden
    plan = make_plan(cfg, dataset_tokens=100_000, hardware=HW)
    assert plan.run_steps == math.ceil(5 * 100_000 / 2048) == 245  # was train.max_steps' 100
    assert plan.data.run_epochs == pytest.approx(245 * 2048 / 100_000)
    assert "configured run  train.epochs 5 (245 steps)" in format_plan(plan)
    follow = [n for n in plan.notes if "to follow the plan" in n]
    assert len(follow) == 1 and "set train.epochs=16 " in follow[0]  # not train.max_steps, which changes nothing
    unknown = make_plan(cfg, hardware=HW)  # no data: the length is not known, and the plan says so
    assert any("train.epochs=5 sets the run's length from its data" in n for n in unknown.notes)
    assert not any("set train.max_steps" in n for n in unknown.notes)


def test_the_budget_line_shows_the_configured_tokens_per_param(monkeypatch):
    monkeypatch.setattr("trimtab.plan.report.nearest_preset", lambda *_: "small")  # sizes every preset: seconds
    plan = make_plan(load_config(preset="debug", sets=["plan.tokens_per_param=10"]), budget_flops=1e15, hardware=HW)
    assert plan.budget.optimal_params == pytest.approx(math.sqrt(1e15 / 60))
    assert "N = sqrt(C / (6 x 10))" in format_plan(plan)  # it said 6 x 20 whatever the setting


def test_an_injected_fault_after_the_last_step_is_said(caplog):
    args = build_parser().parse_args(["train", "--preset", "debug", "--max-steps", "2", "--inject", "nan_loss@100"])
    with caplog.at_level(logging.WARNING, logger="trimtab"):
        cfg = _train_config(args)
    assert cfg.faults == ["nan_loss@100"]  # kept: the run may be lengthened
    assert "--inject nan_loss@100 is after the run's last step 2" in caplog.text and "raise --max-steps" in caplog.text
    caplog.clear()
    args = build_parser().parse_args(["train", "--preset", "debug", "--max-steps", "2", "--inject", "nan_loss@2"])
    with caplog.at_level(logging.WARNING, logger="trimtab"):
        _train_config(args)
    assert "after the run's last step" not in caplog.text
    args = build_parser().parse_args(["train", "--preset", "debug", "--max-steps", "2", "--set", "faults=[oom@9]"])
    with caplog.at_level(logging.WARNING, logger="trimtab"):
        _train_config(args)  # a config file's faults: as --inject's
    assert "faults oom@9 is after the run's last step 2" in caplog.text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # `n_experts:` one level too shallow: the closest name, model.norm_eps, was suggested
        (
            "model:\n  moe:\n  n_experts: 4\n",
            "'model.n_experts'; did you mean 'model.moe.n_experts'? (in YAML: indented",
        ),
        ("d_model: 64\n", "'d_model'; did you mean 'model.d_model'? (in YAML: indented under 'model:')"),
        # another section's key: train.log_every, the closest name in train, was suggested
        ("train:\n  checkpoint_every: 5\n", "'train.checkpoint_every'; did you mean 'checkpoint.every'?"),
        ("train:\n  lr: 0.001\n", "'train.lr'; did you mean 'optim.lr'?"),  # not orchestrator.lr, a rule
        ("model:\n  seq_len: 32\n", "'model.seq_len'; did you mean 'data.seq_len' (or 'model.max_seq_len')?"),
    ],
)
def test_a_key_written_outside_its_section_names_the_section(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="unknown config key") as err:
        load_config(path, preset="debug")
    assert message in str(err.value)


def test_a_tune_space_file_with_a_key_written_twice_is_refused(tmp_path):
    """tune's space file went through yaml.safe_load: a second `space:` dropped the first's parameters."""
    from trimtab.tune import load_space

    path = tmp_path / "s.yaml"
    path.write_text(
        "base: {preset: debug}\nspace:\n  optim.lr: {log_uniform: [1e-4, 1e-2]}\n"
        "space:\n  optim.weight_decay: {choice: [0.0, 0.1]}\n"
    )
    with pytest.raises(ConfigError, match=r"s\.yaml.*4: key 'space' is written twice .*first on line 2"):
        load_space(path)


@pytest.mark.parametrize(
    ("text", "sets", "named"),
    [
        ("model: {d_modle: 64}\n", [], True),  # misspelt in the file
        ("optim: {lr: [1]}\n", [], True),  # a list where a number goes
        ("optim: {lr: [1]}\n", ["optim.lr=abc"], False),  # the bad value is the --set's: the file is not to blame
    ],
)
def test_a_bad_key_in_the_config_file_names_the_file(tmp_path, text, sets, named):
    """`trimtab train my.yaml` with a key misspelt or of the wrong type in my.yaml said only "unknown config
    key 'model.d_modle'": not which file (a preset's and a --set's keys are refused in the same words)."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path, preset="debug", sets=sets)
    assert str(err.value).startswith(f"{path}: ") == named and "config key '" in str(err.value)


def test_the_follow_note_names_the_budget_s_run_when_the_plan_outruns_it(monkeypatch):
    """`trimtab plan --preset small --data DIR --budget-hours 0.05` said only "set train.max_steps=1526 to
    follow the plan" (5.1 h), where the budget's own section counted 16 steps."""
    monkeypatch.setattr("trimtab.plan.report.nearest_preset", lambda *_: "small")  # sizes every preset: seconds
    plan = make_plan(load_config(preset="debug"), budget_flops=1e12, hardware=HW)
    follow = [n for n in plan.notes if "to follow the plan" in n]
    steps = plan.budget.preset_steps
    assert steps < plan.steps and len(follow) == 1
    assert follow[0].endswith(f"or train.max_steps={steps:,} to stay within the budget")
    roomy = make_plan(load_config(preset="debug"), budget_flops=1e18, hardware=HW)
    assert not any("within the budget" in n for n in roomy.notes)
