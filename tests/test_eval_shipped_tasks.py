"""The tasks trimtab ships for `trimtab eval --tasks` (src/trimtab/evaluation/tasks/): read as YAML
only, no lm-eval import (it takes ~10 s)."""

from pathlib import Path

import pytest
import yaml

from trimtab.evaluation.harness import TASKS_DIR


class _TaskLoader(yaml.SafeLoader):
    """lm-eval's task files tag `custom_dataset: !function utils.load`; read as the plain string."""


_TaskLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


@pytest.mark.parametrize("path", sorted(Path(TASKS_DIR).rglob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_metric_names_its_aggregation_and_direction(path):
    """A metric without them makes lm-eval log two warnings for it on every `trimtab eval --tasks`
    (six for trimtab_tiny_ppl, printed between a README example's results)."""
    metrics = yaml.load(path.read_text(), Loader=_TaskLoader).get("metric_list", [])
    incomplete = [m["metric"] for m in metrics if not {"aggregation", "higher_is_better"} <= set(m)]
    assert metrics and incomplete == [], f"{path.name}: give each metric aggregation and higher_is_better"
