"""A refusal of train.init_from names the model.* keys the person changed, not every width that
ModelConfig.resolved derived from them: --set model.d_model=128 once also listed model.head_dim
and model.ffn_hidden as if set."""

from trimtab.config import dump_config, load_config
from trimtab.errors import CheckpointError
from trimtab.training.init_from import _unfit


def test_a_refusal_names_the_changed_keys_and_marks_the_derived_widths(tmp_path):
    dump_config(load_config(preset="debug"), tmp_path / "config.yaml")
    ours = load_config(preset="debug", sets=["model.d_model=128"])
    said = _unfit(ours, tmp_path, CheckpointError("shapes differ"))
    assert "(model.d_model 96 there, 128 here; and the widths derived from them: model.head_dim, model.ffn_hidden)" in (
        said
    ), said
    assert "head_dim 24 there" not in said and "ffn_hidden 256 there" not in said, said


def test_a_width_set_by_hand_is_named_as_set(tmp_path):
    """model.ffn_hidden set apart from d_model's 8/3 is the person's own: named with its values."""
    dump_config(load_config(preset="debug"), tmp_path / "config.yaml")
    said = _unfit(load_config(preset="debug", sets=["model.ffn_hidden=320"]), tmp_path, CheckpointError("x"))
    assert "(model.ffn_hidden 256 there, 320 here)" in said, said
