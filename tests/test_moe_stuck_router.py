"""A near-collapsed layer is answered early, and strongly enough to take. Soak: debug-moe, 4 experts
top-1, balance and z-loss off, router temperature 0.1: layer 3 held 80-88% of assignments (3.3x
fair share) with ~50% dropped from step 10, under the collapse bar, and waited out grace_steps=100;
its answer, balance_coef 0 -> 0.001, then 0.002 after it did not hold, left it at 3.3x."""

from types import SimpleNamespace

import pytest

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator import remedies
from trimtab.orchestrator.moe_health import MoEHealth
from trimtab.orchestrator.monitors import StepMetrics


def _first_imbalance(ratio_at) -> int | None:
    """The step of the first finding on layer 3 (4 experts, top-1) whose busiest expert runs at
    ratio_at(step) x fair share with half the assignments dropped."""
    monitor = MoEHealth(OrchestratorConfig())
    for step in range(100):
        busiest = ratio_at(step) / 4
        shares = [busiest] + [(1 - busiest) / 3] * 3
        f = monitor.observe(StepMetrics(step=step, loss=4.0, grad_norm=1.0, progress=0.5, moe=[(3, shares, 0.5, 1)]))
        if f is not None:
            assert f.evidence["kind"] == "imbalance", f.evidence
            return step
    return None


def test_a_stuck_router_is_answered_within_grace():
    step = _first_imbalance(lambda step: 3.3)
    assert step is not None and step < 50  # a window to fill, a window to compare with


def test_a_router_still_spreading_its_tokens_is_left_alone_in_grace():
    assert _first_imbalance(lambda step: 3.4 - step / 125) is None  # 3.4x -> 2.6x: spreading, slowly


def _raise(coef: float, max_load: float, strikes: int = 0) -> float:
    evidence = {"kind": "imbalance", "layer": 3, "busiest": 0, "max_load": max_load, "strikes": strikes}
    knobs = {"n_experts": 4, "top_k": 1, "balance_coef": coef, "capacity_factor": 1.25}
    view = SimpleNamespace(moe_knobs=lambda layer: knobs)
    remedy = remedies.moe(SimpleNamespace(evidence=evidence, commit=None), view, OrchestratorConfig())
    assert remedy.action == "set_balance_coef"
    return remedy.params["value"]


def test_a_balance_loss_that_was_off_starts_at_the_default_strength():
    assert _raise(0.0, 3.3) == pytest.approx(0.01)  # was 0.001: the soak's layer did not move


def test_the_raise_is_sized_by_the_evidence_and_escalates_when_it_did_not_hold():
    assert _raise(0.01, 2.5) == pytest.approx(0.02)  # just at the bar: x2 as before
    assert _raise(0.001, 2.5) == pytest.approx(0.002)  # set small on purpose: raised from its own scale
    assert _raise(0.01, 3.75) == pytest.approx(0.03)  # 1.5x over the bar: x3
    assert _raise(0.01, 2.5, strikes=1) == pytest.approx(0.04)  # the last raise did not hold: x2 more
