"""Config changes between sessions of one run (training/changes.py): which keys, their old and
new values, their effect, and the one console line that says them."""

from __future__ import annotations

import pytest

from trimtab.config import derive, dump_config, load_config
from trimtab.training.changes import (
    SHOWN,
    changes_line,
    changes_on_resume,
    config_changes,
    effect,
    journal_text,
    show,
)


def debug(out: str = "run", sets: tuple[str, ...] = (), **overrides) -> object:
    """The debug preset's resolved config with `--set` items, as `trimtab train` builds it."""
    return load_config(preset="debug", overrides={"out": out, **overrides}, sets=list(sets))


def keys(changes: list[dict]) -> list[str]:
    return [c["key"] for c in changes]


def test_an_unchanged_config_has_no_changes_and_no_line():
    assert config_changes(debug(), debug()) == []
    assert changes_line([], 12) == ""


def test_the_resume_that_drops_its_sets_lists_the_lr_and_the_batch_with_old_and_new_values():
    """The README's resume form without the first session's --set items: the LR and the batch
    change mid-run; each is listed by its dotted key, old value first, in the config's order."""
    saved = debug(sets=("optim.lr=5e-4", "train.batch_tokens=1024", "faults=[sigterm@20]"))
    new = debug()
    changes = config_changes(saved, new)
    assert keys(changes) == ["optim.lr", "train.batch_tokens"]  # faults: the injector's own business
    lr, batch = changes
    assert (lr["old"], lr["new"]) == (5e-4, new.optim.lr)
    assert lr["effect"] == f"LR x{new.optim.lr / 5e-4:.3g} at once, no warm-up"
    assert (batch["old"], batch["new"]) == (1024, new.train.batch_tokens)
    assert batch["effect"] == f"x{new.train.batch_tokens / 1024:.3g} tokens a step; the LR is not rescaled"
    assert set(lr) == {"key", "old", "new", "effect"}  # the shape of schedule.reconcile's changes


def test_nested_and_list_keys_are_dotted_leaves():
    saved = debug()
    new = debug(
        sets=("model.moe.top_k=1", "orchestrator.mode=advise", "optim.beta2=0.99"),
        data={"mix": [{"source": "builtin", "weight": 1.0}]},
    )
    changes = {c["key"]: c for c in config_changes(saved, new)}
    assert list(changes) == ["model.moe.top_k", "data.mix", "optim.beta2", "orchestrator.mode"]
    assert changes["data.mix"]["old"] == [] and changes["data.mix"]["new"][0]["source"] == "builtin"
    assert (changes["orchestrator.mode"]["old"], changes["orchestrator.mode"]["new"]) == ("auto", "advise")
    assert changes["optim.beta2"]["effect"] == "the optimizer uses it from this step"


@pytest.mark.parametrize(
    "sets",
    [
        ("train.max_steps=99",),  # phase lengths: schedule.reconcile journals them
        ("train.epochs=2",),
        ("finetune.steps=5",),
        ("train.init_from=elsewhere",),  # a resumed run's weights come from its checkpoint
        ("faults=[nan_loss@3]",),  # the fault injector says what it does with them
        ("log.progress=false", "log.tensorboard=false", "log.mlflow.enabled=true"),  # nothing it trains on
        # the orchestrator journals these itself, with the action that applies them (people.py)
        ("train.micro_batch_tokens=512", "train.activation_checkpointing=full"),
    ],
)
def test_keys_that_do_not_change_the_training_or_are_judged_elsewhere_are_left_out(sets):
    finetune_data = ("finetune.data.source=builtin", "finetune.data.seq_len=64")  # a valid finetune phase
    assert config_changes(debug(sets=finetune_data), debug(sets=finetune_data + sets)) == []


def test_another_out_or_preset_name_is_not_a_change_its_values_are():
    assert config_changes(debug(out="a"), debug(out="./runs/../a")) == []
    renamed = derive(debug(), {"preset": "small"})  # the debug preset's values under another name
    assert renamed.preset == "small" and config_changes(debug(), renamed) == []


def test_a_run_directorys_config_yaml_compares_equal_to_the_config_that_wrote_it(tmp_path):
    """YAML's round trip (floats such as 1e-8, empty strings, lists) makes no change appear."""
    cfg = debug(str(tmp_path), sets=("optim.lr=5e-4", "optim.eps=1e-8", "data.mix=[]"))
    dump_config(cfg, tmp_path / "config.yaml")
    assert changes_on_resume(cfg) == []
    new = debug(str(tmp_path), sets=("optim.lr=5e-4", "optim.eps=1e-8", "optim.weight_decay=0.05"))
    assert keys(changes_on_resume(new)) == ["optim.weight_decay"]


def test_a_missing_or_damaged_config_yaml_gives_no_changes(tmp_path):
    assert changes_on_resume(debug(str(tmp_path))) == []  # none there: setup checks the checkpoint instead
    (tmp_path / "config.yaml").write_text("optim: {lr: [1, 2]}\n")
    assert changes_on_resume(debug(str(tmp_path))) == []


def test_the_console_line_names_each_change_with_its_effect():
    changes = config_changes(debug(sets=("optim.lr=5e-4", "train.batch_tokens=1024")), debug())
    line = changes_line(changes, 20)
    assert line.startswith("config changed on resume at step 20: optim.lr 0.0005 -> 0.003 (LR x6 at once")
    assert "; train.batch_tokens 1024 -> 2048 (x2 tokens a step; the LR is not rescaled)" in line
    assert "\n" not in line


def test_the_console_line_counts_what_it_does_not_name():
    changes = [{"key": f"k{i}", "old": i, "new": i + 1, "effect": "e"} for i in range(SHOWN + 3)]
    line = changes_line(changes, 5)
    assert f"k{SHOWN - 1} " in line and f"k{SHOWN} " not in line
    assert line.endswith("; and 3 more (decisions.jsonl)")


def test_values_are_shown_short():
    assert show(0.0005) == "0.0005" and show(1e-08) == "1e-08" and show(3.0) == "3"
    assert show("") == "''" and show("cosine") == "cosine" and show(False) == "False"
    assert show(list(range(100))).endswith("...") and len(show(list(range(100)))) == 60


def test_effects_of_keys_whose_effect_is_not_plain():
    assert effect("train.seed", 1, 2) == "the data order and random state stay the checkpoint's"
    assert effect("model.moe.router_jitter", 0.0, 0.01) == "a live router knob: applied over the checkpoint's value"
    assert effect("optim.weight_decay", 0.1, 0.05) == "the optimizer uses it from this step"
    assert effect("optim.lr", 0, 1e-3) == "LR x? at once, no warm-up"  # no ratio from a zero
    assert effect("checkpoint.every", 10, 20) == "in effect from this step"


def test_journal_text_reads_as_a_changed_phase_length_does():
    change = config_changes(debug(sets=("optim.lr=5e-4",)), debug())[0]
    summary, reasoning = journal_text(change, 20)
    assert summary == "optim.lr 0.0005 -> 0.003 on resume at step 20"
    assert reasoning == "changed in the config by a person: LR x6 at once, no warm-up"


def test_a_finetune_phase_added_or_dropped_is_one_change_its_settings_part_of_it():
    """finetune.steps 0 -> N adds a phase (schedule.reconcile journals it): its data and optim
    settings come with it, not as changes of their own; between two configs with the phase they are."""
    phase = ("finetune.data.source=builtin", "finetune.data.seq_len=64", "finetune.optim.lr=1e-4")
    assert config_changes(debug(), debug(sets=("finetune.steps=5", *phase))) == []
    assert config_changes(debug(sets=("finetune.steps=5", *phase)), debug()) == []
    both = ("finetune.steps=5", *phase)
    changes = config_changes(
        debug(sets=both), debug(sets=(*both, "finetune.optim.lr=2e-4", "finetune.data.pack=false"))
    )
    assert keys(changes) == ["finetune.data.pack", "finetune.optim.lr"]
    assert changes[1]["effect"] == "the finetune phase's LR x2 (at once, without a warm-up, if it has begun)"


def test_a_changed_bpe_size_on_resume_is_said_to_have_no_effect(tmp_path):
    """`--set data.bpe_vocab_size=1024` on a resume was said to be "in effect from this step" while the run
    went on with its own 512-token tokenizer.json (tokenizer_source: a resume never trains a BPE)."""
    from trimtab.training.run_tokenizer import tokenizer_source

    saved, new = debug(out=str(tmp_path)), debug(out=str(tmp_path), sets=("data.bpe_vocab_size=1024",))
    (change,) = config_changes(saved, new)
    assert change["key"] == "data.bpe_vocab_size" and change["effect"].startswith("no effect: a resumed run keeps")
    (tmp_path / "tokenizer.json").write_text("{}")  # the run's own, as prepare_run_dir wrote it
    assert tokenizer_source(new) == tmp_path / "tokenizer.json"
