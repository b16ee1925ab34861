"""A space file's whole numbers (a range's grid `steps`, `study.trials`, `seed`, `settle_steps`):
a value int() would truncate or refuse is an error naming the key, before any trial runs."""

from __future__ import annotations

import pytest

from trimtab.errors import ConfigError
from trimtab.tune.space import load_space

SPACE = """study: {{name: s, sampler: {sampler}, {study}}}
base: {{preset: debug}}
budget: {{max_steps: 3}}
space:
  optim.lr: {{uniform: [1.0e-3, 2.0e-3]{steps}}}
"""


def write(tmp_path, sampler="grid", study="seed: 0", steps=", steps: 3"):
    path = tmp_path / "space.yaml"
    path.write_text(SPACE.format(sampler=sampler, study=study, steps=steps))
    return path


@pytest.mark.parametrize(
    ("sampler", "study", "steps", "message"),
    [
        ("grid", "seed: 0", ", steps: 2.5", "space.optim.lr.steps: must be a whole number >= 1, got 2.5"),
        ("grid", "seed: 0", ", steps: abc", "space.optim.lr.steps: must be a whole number >= 1, got 'abc'"),
        ("grid", "seed: 0", ", steps: 0", "space.optim.lr.steps: must be a whole number >= 1, got 0"),
        ("tpe", "seed: 0", ", steps: -2", "space.optim.lr.steps: must be a whole number >= 1"),
        ("tpe", "trials: abc", "", "study.trials: must be a whole number >= 1, got 'abc'"),
        ("tpe", "trials: 0", "", "study.trials: must be a whole number >= 1, got 0"),
        ("tpe", "seed: x", "", "study.seed: must be a whole number, got 'x'"),
        ("tpe", "settle_steps: 1.5", "", "study.settle_steps: must be a whole number >= 0"),
    ],
)
def test_a_bad_whole_number_names_its_key(tmp_path, sampler, study, steps, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_space(write(tmp_path, sampler, study, steps))


def test_good_whole_numbers_are_read(tmp_path):
    space = load_space(write(tmp_path, study="trials: 2.0, seed: '7', settle_steps: 0", steps=", steps: 3"))
    assert (space.trials, space.seed, space.settle_steps) == (2, 7, 0)
    assert space.params[0].steps == 3 and len(space.params[0].grid()) == 3
