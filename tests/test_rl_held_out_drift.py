"""Rule rl_hacking's held-out fall (orchestrator/rl_health.py, RewardHacking._falling) against a baseline that
moves: a policy that improved and then fell back part of the way, and a slow decline. The baseline had pooled
every reading in control, and a reading had to stand 2 standard errors below it to start a fall: a fall 0.6 ->
0.45 after a gain 0.3 -> 0.6 read against the two levels pooled and never fired, and a decline of 0.01 a reading
dragged the baseline down with it (found 0.18 below where it began)."""

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.rl_held_out import RewardHacking


def first_fall(solved: list[int], n: int = 100) -> tuple[int, dict] | None:
    """The reading that first fired, and its finding's evidence (None: none fired)."""
    mon = RewardHacking(OrchestratorConfig())
    for i, k in enumerate(solved):
        if (found := mon.observe_eval(10 * i, 0, k / n, k, n)) is not None:
            return i, found.evidence
    return None


def test_a_fall_back_from_a_gain_is_judged_against_the_level_gained() -> None:
    gained = [60, 61, 59, 60, 62] * 2  # 10 readings at 0.6 after 4 at 0.3
    found = first_fall([30, 31, 29, 30, *gained, 45, 44, 46, 45])
    assert found is not None, "0.6 -> 0.45 is 3 standard errors a reading from 0.6: two readings pooled fire"
    at, evidence = found
    assert at == 15 and evidence["evaluations"] == 2
    # the baseline is the last readings in control, the gained level's, not 0.3's and 0.6's pooled
    assert (evidence["baseline_solved"], evidence["baseline_n"]) == (sum(gained), 1000)
    assert (evidence["fall_solved"], evidence["fall_n"]) == (89, 200)


def test_a_slow_decline_is_found_against_the_level_it_fell_from() -> None:
    declining = [50] * 5 + [50 - j for j in range(1, 21)]  # 0.5 -> 0.3, 0.01 a reading
    found = first_fall(declining)
    assert found is not None
    at, evidence = found
    assert declining[5] - declining[at] <= 14  # the old rule fired at 32 of 100, 18 below where the decline began
    # the fall's readings stay out of the baseline: it stands where the decline began, not dragged down with it
    assert evidence["baseline_solved"] / evidence["baseline_n"] >= 0.49
    assert evidence["evaluations"] >= 10
