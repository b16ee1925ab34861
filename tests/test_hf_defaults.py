"""hf/architectures.py copies each class's config defaults (import runs without transformers): a
config.json that omits a field must read as transformers reads it. Checked against transformers."""

import pytest

from trimtab.hf.architectures import DEFAULTS, MODEL_TYPES

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", sorted(DEFAULTS))
def test_the_copied_defaults_are_the_config_classs_own(arch):
    config = transformers.AutoConfig.for_model(MODEL_TYPES[arch]).to_dict()
    rope = config.get("rope_parameters") or {}  # transformers 5 keeps rope_theta there
    for key, value in DEFAULTS[arch].items():
        theirs = config[key] if key in config else rope.get(key)
        assert theirs == value, f"{arch}.{key}: transformers {theirs!r}, trimtab {value!r}"
