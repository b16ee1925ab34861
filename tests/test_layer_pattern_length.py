"""model.layer_pattern longer than model.n_layers: its tail would never be built, so it is refused
(once [dense, dense, dense, dense, moe] on 4 layers trained an all-dense model, no error)."""

import pytest

from trimtab.config import load_config
from trimtab.errors import ConfigError


def test_a_pattern_longer_than_the_layers_is_refused_naming_the_key():
    sets = ["model.n_layers=4", "model.layer_pattern=[dense,dense,dense,dense,moe]"]
    with pytest.raises(ConfigError, match=r"model\.layer_pattern.*5 entries.*model\.n_layers 4"):
        load_config(preset="debug", sets=sets)


def test_a_pattern_as_long_as_the_layers_or_shorter_repeats():
    cfg = load_config(preset="debug", sets=["model.n_layers=4", "model.layer_pattern=[dense,moe,dense,mod]"])
    assert cfg.model.layers == ["dense", "moe", "dense", "mod"]
    cfg = load_config(preset="debug", sets=["model.n_layers=5", "model.layer_pattern=[moe,dense]"])
    assert cfg.model.layers == ["moe", "dense", "moe", "dense", "moe"]
