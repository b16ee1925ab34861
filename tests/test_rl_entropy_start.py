"""Rule rl_entropy's start is the starting policy's steps (rl_stats.start_splits, as rule rl_signal's): it was the
phase's first `window` steps, so a collapse inside them was its own baseline and never found."""

from __future__ import annotations

import pytest

from test_orchestrator_units import metrics
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.rl_health import EntropyCollapse


def _first_finding(entropies: list[float], staleness: float = 0.0):
    rule = EntropyCollapse(OrchestratorConfig())  # window 5, threshold 0.25
    for step, entropy in enumerate(entropies, 1):
        rl = {"entropy": entropy, "reward": 0.05, "staleness": staleness}
        if found := rule.observe(metrics(step, rl=rl)):
            return step, found
    return None, None


def test_a_collapse_inside_the_first_window_is_found_against_the_starting_policy():
    """2.0 nats at step 1, 0.2 from step 2 (simulated: old rule never fired, its start read 0.56 nats)."""
    step, found = _first_finding([2.0] + [0.2] * 20)
    assert step == 6  # the first full window after the starting policy's step
    assert found.evidence["start_entropy"] == pytest.approx(2.0) and found.evidence["entropy"] == pytest.approx(0.2)


def test_a_steady_policy_and_an_asynchronous_start_read_no_collapse():
    """A steady policy is never a collapse; asynchronously (staleness 2) the first 3 steps are the start."""
    assert _first_finding([2.0, 1.8, 2.1, 1.9, 2.0] * 6)[0] is None
    step, found = _first_finding([2.0, 2.2, 1.8] + [0.2] * 20, staleness=2.0)
    assert step == 8 and found.evidence["start_entropy"] == pytest.approx(2.0)


def test_a_curriculum_step_starts_the_entropy_again_from_the_policy_it_raised():
    """A learned task's policy is sharper than the starting one: after a raise (rl/curriculum.py) its reward
    falls on the harder task, and against the first task's starting entropy it read as a collapse (the soak's
    raise to 6 digits); the new task's start is the policy that meets it, as rules rl_signal and rl_reward's."""
    rule = EntropyCollapse(OrchestratorConfig())  # window 5, threshold 0.25, solved 0.9
    steps = [(2.0, 0.05, 1)] + [(0.4, 0.95, 1)] * 10 + [(0.4, 0.3, 2)] * 12  # learned at 1 digit, raised to 2
    found = [
        rule.observe(metrics(s, rl={"entropy": e, "reward": r, "difficulty": d}))
        for s, (e, r, d) in enumerate(steps, 1)
    ]
    assert found == [None] * len(steps)
    later = [rule.observe(metrics(30 + s, rl={"entropy": 0.05, "reward": 0.3, "difficulty": 2})) for s in range(6)]
    assert any(f is not None and f.evidence["start_entropy"] == pytest.approx(0.4) for f in later)  # still watched
