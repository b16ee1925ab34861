"""The `mod` rule gives each Mixture-of-Depths layer back the capacity it had, not one value for
all: with per-layer capacities (model.mod.layer_capacity, a person's `mod-capacity V L`) the mean
would lower the layers that were never cut."""

import pytest

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator import remedies
from trimtab.orchestrator.mod_health import MoDQuality
from trimtab.orchestrator.monitors import StepMetrics


class View:
    def __init__(self, targets):
        self.targets = targets

    def mod_capacities(self):
        return {layer: (target, target) for layer, target in self.targets.items()}


def feed(monitor, rows):
    """rows: (capacities {layer: c}, loss) per step -> the findings, in order."""
    found = []
    for step, (caps, loss) in enumerate(rows):
        m = StepMetrics(
            step=step,
            loss=loss,
            grad_norm=1.0,
            progress=0.5,
            mod_capacity=sum(caps.values()) / len(caps),
            mod_layers=list(caps.items()),
        )
        found += [f] if (f := monitor.observe(m)) else []
    return found


def test_a_layer_cut_alone_gets_its_own_capacity_back_and_the_others_keep_theirs():
    cfg = OrchestratorConfig()
    rows = [({1: 0.5, 3: 0.9}, 4.0)] * 10 + [({1: 0.02, 3: 0.9}, 4.4)] * 3 + [({1: 0.02, 3: 0.9}, 4.4)]
    (found,) = feed(MoDQuality(cfg), rows)
    remedy = remedies.mod(found, View({1: 0.02, 3: 0.9}), cfg)
    assert remedy.params == {"value": 0.5, "layer": 1}  # not 0.7 (the mean's high) for both


def test_layers_cut_from_different_capacities_each_get_theirs_one_step_apart():
    cfg = OrchestratorConfig()
    rows = [({1: 0.5, 3: 0.9}, 4.0)] * 10 + [({1: 0.05, 3: 0.05}, 4.4)] * 3 + [({1: 0.05, 3: 0.05}, 4.4)]
    found = feed(MoDQuality(cfg), rows)
    view = View({1: 0.05, 3: 0.05})
    assert [remedies.mod(f, view, cfg).params for f in found] == [
        {"value": 0.5, "layer": 1},
        {"value": pytest.approx(0.9), "layer": 3},
    ]
    assert [f.step for f in found] == [12, 13] and [f.family for f in found] == ["mod/1", "mod/3"]


def test_layers_cut_from_one_capacity_are_one_finding_for_all():
    cfg = OrchestratorConfig()
    rows = [({1: 0.5, 3: 0.5}, 4.0)] * 10 + [({1: 0.05, 3: 0.05}, 4.4)] * 4
    (found,) = feed(MoDQuality(cfg), rows)
    assert remedies.mod(found, View({1: 0.05, 3: 0.05}), cfg).params == {"value": 0.5}


def test_a_step_with_an_infinite_loss_is_the_nonfinite_rules_not_a_capacity_cost():
    """An Inf loss (as a NaN one) at a capacity that fell is read by the nonfinite rule; here it
    would be a loss rise the capacity's fall paid for, and the capacity given back."""
    rows = [({1: 0.5}, 4.0)] * 10 + [({1: 0.25}, float("inf"))] * 4
    assert feed(MoDQuality(OrchestratorConfig()), rows) == []
