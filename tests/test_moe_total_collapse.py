"""A total expert collapse is answered within a few steps: expert_collapse@30 on debug-moe (every
token's first choice on expert 0, through its selection bias) was found only once the 20-step
window's mean passed the bar (steps 45-48), and answered with balance_coef x4, which cannot move
expert_bias; the router reset that works came at steps 65-67."""

from types import SimpleNamespace

import torch

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator import remedies
from trimtab.orchestrator.moe_health import MoEHealth
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.training.view import RunView

FAIR = [1 / 8] * 8
COLLAPSED = [0.5] + [0.5 / 7] * 7  # top_k 2: expert 0 takes every token's first choice


def _first_collapse(shares_at) -> int | None:
    monitor = MoEHealth(OrchestratorConfig())
    for step in range(60):
        m = StepMetrics(step=step, loss=4.0, grad_norm=1.0, progress=0.5, moe=[(1, shares_at(step), 0.0, 2)])
        f = monitor.observe(m)
        if f is not None and f.evidence["kind"] == "collapse":
            return step
    return None


def test_a_total_collapse_is_found_on_its_third_step():
    assert _first_collapse(lambda step: COLLAPSED if step >= 30 else FAIR) == 32


def test_a_total_collapse_early_in_training_is_found_in_five_steps():
    """expert_collapse@6 on debug-moe (seeds 3, 20): found at step 20, when the window filled, 14 steps
    collapsed (final loss +0.23 over the clean twin, seed 3)."""
    assert _first_collapse(lambda step: COLLAPSED if step >= 6 else FAIR) == 10


# A forming router's busiest expert, x its fair share: clean debug-moe, seed 3, layer 3, steps 4-19 (at
# >= 0.9 of the most possible, 3.6x, for 12 of them, >= 99% on 3 in a row); it spread by itself by step ~40.
FORMING = [3.21, 3.81, 3.95, 3.13, 3.98, 3.85, 3.99, 3.99, 3.99, 3.61, 3.98, 3.67, 3.76, 3.45, 3.61, 3.32]


def _forming(step: int) -> list[float]:
    busiest = FORMING[step - 4] / 8 if 4 <= step < 20 else 1 / 8
    return [busiest] + [(1 - busiest) / 7] * 7


def test_a_forming_router_piling_its_first_steps_on_one_expert_is_no_collapse():
    assert _first_collapse(_forming) is None


def _remedy(bias_lead: float) -> str:
    evidence = {"kind": "collapse", "layer": 1, "busiest": 0, "strikes": 0}
    f = SimpleNamespace(evidence=evidence, commit=None)
    knobs = {"n_experts": 8, "top_k": 2, "balance_coef": 0.01, "bias_lead": bias_lead}
    view = SimpleNamespace(moe_knobs=lambda layer: knobs)
    return remedies.moe(f, view, OrchestratorConfig()).action


def test_a_collapse_held_by_the_selection_bias_resets_the_router_at_once():
    assert _remedy(bias_lead=1.0) == "reset_router"
    assert _remedy(bias_lead=0.05) == "set_balance_coef"  # a router's own collapse: the balance loss first


def test_the_run_view_reports_the_selection_bias_lead():
    moe = SimpleNamespace(n_experts=4, top_k=2, capacity_factor=1.25, router_temperature=1.0, balance_coef=0.01)
    moe.expert_bias = torch.tensor([1.5, 0.25, 0.0, -0.5])  # expert_collapse@30:1.25 on a bias of 0.25
    view = RunView(SimpleNamespace(model=SimpleNamespace(moe_layers=lambda: [(1, moe)])), SimpleNamespace(request=None))
    assert view.moe_knobs(1)["bias_lead"] == 1.25


def _collapses(applied: bool) -> list[int]:
    """The steps a layer collapsed from step 30 on is found at; `applied`: each finding's remedy applied."""
    monitor, found = MoEHealth(OrchestratorConfig()), []
    for step in range(30, 75):
        f = monitor.observe(StepMetrics(step=step, loss=4.0, grad_norm=1.0, progress=0.5, moe=[(1, COLLAPSED, 0.5, 2)]))
        if f is not None:
            found.append(step)
            if applied:
                f.commit()  # what the policy runs once a raise or a reset is applied (Remedy.commit)
    return found


def test_a_collapse_remedy_gets_a_window_before_the_collapse_is_found_again():
    """Seed 3: a raise judged at once, 3 steps after it, on the same collapse still there (the rule reset
    the router, and the raise was journaled "not recovered"): the balance loss moves the router by
    gradient, over tens of steps. Advice (nothing applied) is given again as the collapse stays."""
    assert _collapses(applied=True) == [32, 52, 72]
    assert _collapses(applied=False)[:3] == [32, 35, 38]


def test_a_step_with_a_non_finite_loss_says_nothing_of_the_router():
    """weights_nan@12 on debug-moe in advise mode: NaN weights route every token alike, and the MoE rule
    advised a balance raise and a router reset for a collapse of NaN's making. The nonfinite rule owns
    such a step: its shares are not read (nor kept in the window the full check judges later)."""
    for bad in (float("nan"), float("inf")):
        monitor = MoEHealth(OrchestratorConfig())
        for step in range(60):
            loss, shares = (bad, COLLAPSED) if step >= 30 else (4.0, FAIR)
            m = StepMetrics(step=step, loss=loss, grad_norm=bad, progress=0.5, moe=[(1, shares, 0.0, 2)])
            assert monitor.observe(m) is None, (bad, step)
