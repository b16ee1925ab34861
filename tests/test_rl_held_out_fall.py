"""Rule rl_hacking's test of the held-out reward's own fall (orchestrator/rl_health.py, RewardHacking._falling):
`trimtab rl --set optim.lr=1e-3` with the exact reward, from a 600-step arithmetic warm start, took held-out
pass@1 from 14/100 to 0/100 by step 30 while the training reward went 0.043 -> 0.01: rl_reward's start was too
few groups to tell, rl_hacking waited for a training reward that rose, and no rule acted."""

from types import SimpleNamespace

import pytest
import torch

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.rl_held_out import RewardHacking
from trimtab.orchestrator.rl_remedies import remedy


def readings(mon: RewardHacking, solved: list[int], train: float = 0.03, n: int = 100) -> list:
    """One evaluation every 10 steps, the training reward flat at `train` between them."""
    found = []
    for i, k in enumerate(solved):
        for s in range(10 * i - 4, 10 * i + 1):
            mon.observe(StepMetrics(step=s, loss=0.0, grad_norm=0.0, rl={"reward": train}))
        found.append(mon.observe_eval(10 * i, 0, k / n, k, n))
    return found


def test_a_held_out_count_collapsing_with_a_flat_training_reward_rolls_back_to_the_best_down_to_the_floor() -> None:
    cfg = OrchestratorConfig()
    mon = RewardHacking(cfg)
    target = mon.state_dict()  # the step-0 checkpoint, saved before the step-0 evaluation
    found = readings(mon, [14, 2, 0])  # the soak's: 0.14 -> 0.02 -> 0.00
    assert [f is not None for f in found] == [False, False, True]
    f = found[-1]
    assert f.rule == "rl_hacking" and f.evidence["kind"] == "held_out_fall"
    assert (f.evidence["best_solved"], f.evidence["best_n"], f.evidence["best_step"]) == (14, 100, 0)
    assert (f.evidence["held_out_solved"], f.evidence["held_out_n"]) == (0, 100)
    # the fall's two readings pooled (2 of 200) against the baseline's 14 of 100: 4.7 standard errors
    assert (f.evidence["fall_solved"], f.evidence["fall_n"], f.evidence["evaluations"]) == (2, 200, 2)
    pooled = 16 / 300
    assert f.evidence["z"] == pytest.approx(0.13 / (pooled * (1 - pooled) * (1 / 100 + 1 / 200)) ** 0.5)
    first = remedy(f, SimpleNamespace(lr_scale=1.0, has_checkpoint=lambda step: True), cfg)
    assert (first.action, first.params) == ("rollback", {"to": 0, "lr_factor": cfg.rl_reward.lr_factor})
    assert "worse at the task" in first.reasoning
    kept = {key: getattr(mon, key) for key in mon.KEPT_ON_ROLLBACK}  # as Orchestrator._load_monitors
    mon.load_state_dict(target)
    for key, value in kept.items():
        setattr(mon, key, value)
    again = readings(mon, [14, 1, 0])[-1]  # replayed from step 0 at the lower LR, and it falls again, as far
    assert again is not None and again.evidence["times"] == 2
    assert (again.evidence["undone_solved"], again.evidence["undone_n"]) == (2, 200)  # the fall thrown away
    # the LR still too high: cut again (1e-3 -> 1e-4 on that run), down to the floor, where it stops
    cut = remedy(again, SimpleNamespace(lr_scale=0.1, has_checkpoint=lambda step: True), cfg, rollbacks=1)
    assert (cut.action, cut.params) == ("rollback", {"to": 0, "lr_factor": 0.1})
    assert "the last cut took it from 2/200 to 1/200" in cut.reasoning
    stop = remedy(again, SimpleNamespace(lr_scale=0.01, has_checkpoint=lambda step: True), cfg, rollbacks=2)
    assert stop.action == "stop" and "the LR is at its floor" in stop.params["reason"]


@pytest.mark.parametrize(
    "solved",
    [
        [14, 19, 10, 12, 17, 9, 15, 11, 13, 16, 8, 14],  # fault-free: p 0.14 at n 100 (noise +-3.5)
        [0] * 12,  # flat at 0: nothing to fall from
        [14, 21, 6, 13, 5, 11],  # a lucky best (21), then two unlucky readings (3.1 and 3.4 errors), not in a row
    ],
)
def test_held_out_noise_and_a_held_out_reward_flat_at_zero_are_no_fall(solved: list[int]) -> None:
    assert not any(readings(RewardHacking(OrchestratorConfig()), solved))


def test_a_fall_inside_the_minimum_or_the_noise_is_not_counted() -> None:
    from trimtab.orchestrator.rl_stats import count_fall

    assert count_fall(0, 100, 0, 100) == 0.0 and count_fall(14, 100, 14, 100) == 0.0
    cfg = OrchestratorConfig()
    cfg.rl_hacking.min_fall = 0.5  # 14 -> 0 is 3.9 errors, but under the minimum fall
    assert not any(readings(RewardHacking(cfg), [14, 0, 0, 0]))
    # a small held-out set: 3/16 -> 0/16 is 1.8 errors, within its noise; 8/16 -> 0/16 is 3.3, 0/32 pooled 4.4
    small = [readings(RewardHacking(OrchestratorConfig()), [k, 0, 0], n=16)[-1] for k in (3, 8)]
    assert small[0] is None and small[1] is not None and small[1].evidence["z"] == pytest.approx(4.38, abs=0.01)


def test_the_orchestrator_gives_rl_hacking_the_evaluation_s_counts(tmp_path) -> None:
    """RL's evaluation says its count of problems (rl/held_out_n): without it the fall was never judged."""
    cfg = OrchestratorConfig()
    cfg.rl_hacking.patience = 5  # counted, not acted on: the count of falls is the evidence
    orch = Orchestrator(cfg, tmp_path)
    run = SimpleNamespace(phase=0, weights_finite=lambda: True)
    for step, k in ((0, 14), (10, 2), (20, 0)):
        orch.on_eval(
            run, {"step": step, "rl/held_out_reward": k / 100, "rl/held_out_pass@1": k / 100, "rl/held_out_n": 100.0}
        )
    mon = orch.monitors["rl_hacking"]
    assert mon.top == [14, 100, 0] and mon.base == [14, 100] and mon.run == [2, 200, 2]


def test_a_rollback_keeps_the_best_count_so_a_replay_that_falls_again_stops_the_run(tmp_path) -> None:
    """The step-0 evaluation is not taken again after a rollback to step 0: restored without its count, the
    replay at half the LR on the arithmetic run read 4/100 as its best and 1/100, 2/100 after it as noise. The
    baseline is kept too, and the fall's readings are not in it: the replay's 4 and 1 of 100 pooled fire."""
    orch = Orchestrator(OrchestratorConfig(), tmp_path)
    mon = orch.monitors["rl_hacking"]
    saved = {"monitors": {"rl_hacking": mon.state_dict()}, "recent_losses": []}  # the checkpoint before step 0's
    assert readings(mon, [14, 0, 0])[-1] is not None
    orch._load_monitors(saved, rollback=True)
    assert mon.top == [14, 100, 0] and mon.base == [14, 100] and mon.fired == 1
    assert [f is not None for f in readings(mon, [14, 4, 1, 2])[1:]] == [False, True, False]


def test_a_fall_whose_readings_straddle_the_bar_is_pooled_and_caught() -> None:
    """The replay at half the LR of the arithmetic run read 14 -> 4, 4, 2, 3, 1 of 100: 2.5, 2.5, 3.1, 2.8, 3.5
    standard errors from 14, never two in a row at 3, and the rule never fired. Pooled since the fall began,
    4, 4, 2 of 300 is 3.9 errors under 14 of 100."""
    found = readings(RewardHacking(OrchestratorConfig()), [14, 4, 4, 2, 3, 1])
    # and again, with no rollback between (a unit test): 3 and 1 of 100 begin a fall of their own
    assert [f is not None for f in found] == [False, False, False, True, False, True]
    assert (found[3].evidence["fall_solved"], found[3].evidence["fall_n"]) == (10, 300)
    assert (found[3].evidence["baseline_solved"], found[3].evidence["baseline_n"]) == (14, 100)


@pytest.mark.parametrize("p", [0.14, 0.5])
def test_a_flat_policy_over_many_evaluations_rarely_reads_as_a_fall(p: float) -> None:
    """Against the best reading, a flat policy's 200 evaluations of 100 problems read two in a row at 3 errors
    in a third of the runs (the best of 200 readings stands ~2.8 errors above the rate); against the pooled
    baseline, the pooled fall fired in 1-4% of 1000 simulated runs."""
    generator = torch.Generator().manual_seed(0)
    draws = torch.binomial(torch.full((200, 200), 100.0), torch.full((200, 200), p), generator=generator)
    fired = 0
    for run in draws.int().tolist():
        mon = RewardHacking(OrchestratorConfig())
        fired += any(mon.observe_eval(10 * i, 0, k / 100, k, 100) for i, k in enumerate(run))
    assert fired <= 16  # of 200 runs: 8%; two in a row at 3 errors from the best fired in ~66
