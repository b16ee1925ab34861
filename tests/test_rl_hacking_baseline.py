"""Rule rl_hacking's training reward at the best evaluation (orchestrator/rl_held_out.py): the best at step 0 (the
starting policy, evaluated before the first step) has no training reward before it; read as 0, a collapse whose
training reward stayed at 0.05 or more read as a rise, hacking (a rollback at x0.5, not an LR's x0.1). And the
stops of the RL and DPO rules that roll back with the LR cut share one shape (rl_reward.gave_up)."""

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.dpo_health import preference_remedy
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.rl_held_out import RewardHacking
from trimtab.orchestrator.rl_remedies import remedy
from trimtab.orchestrator.rl_reward import reward_remedy


def readings(mon: RewardHacking, solved: list[int], train: Callable[[int], float], n: int = 100) -> list[Any]:
    """An evaluation every 10 steps, the first at step 0 (before any step), the training reward train(step)."""
    found = []
    for i, k in enumerate(solved):
        for s in range(10 * i - 9, 10 * i + 1) if i else ():
            mon.observe(StepMetrics(step=s, loss=0.0, grad_norm=0.0, rl={"reward": train(s)}))
        found.append(mon.observe_eval(10 * i, 0, k / n, k, n))
    return found


def test_a_collapse_with_a_flat_training_reward_after_a_best_at_step_0_is_a_fall_not_hacking() -> None:
    cfg = OrchestratorConfig()
    f = readings(RewardHacking(cfg), [50, 25, 25], lambda step: 0.1)[-1]  # flat at 0.1 from the first step
    assert f is not None and f.evidence["kind"] == "held_out_fall", f
    assert (
        remedy(f, SimpleNamespace(lr_scale=1.0, has_checkpoint=lambda step: True), cfg).params["lr_factor"]
        == cfg.rl_reward.lr_factor
    )


def test_a_training_reward_rising_after_a_best_at_step_0_is_measured_from_its_first_window() -> None:
    f = readings(RewardHacking(OrchestratorConfig()), [50, 25, 25], lambda step: 0.1 + 0.02 * step)[-1]
    assert f is not None and "kind" not in f.evidence, f  # hacking, the finer diagnosis of the two
    assert f.evidence["train_reward_at_best"] == pytest.approx(0.16)  # steps 1-5, the window after step 0
    assert f.evidence["train_reward"] == pytest.approx(0.46)


def test_the_rl_and_dpo_rules_stop_alike_when_no_rollback_is_left() -> None:
    cfg = OrchestratorConfig()
    view = SimpleNamespace(lr_scale=cfg.min_lr_scale, has_checkpoint=lambda step: True)
    fell = SimpleNamespace(evidence={"good_step": 4, "good_score": 0.07, "score": 0.02, "start_score": 0.07})
    dpo = SimpleNamespace(evidence={"best_step": 4, "held_out_chosen_reward": -1.0})
    ev = {"kind": "held_out_fall", "best_step": 4, "fall_solved": 1, "fall_n": 200}
    hacking = Finding(rule="rl_hacking", family="rl", step=9, evidence=ev | {"baseline_solved": 50, "baseline_n": 200},
                      summary="", strength=1.0)  # fmt: skip
    stops = [
        reward_remedy(fell, view, cfg, 1),
        preference_remedy(dpo, view, cfg, 1),
        remedy(hacking, view, cfg, rollbacks=1),
    ]
    floor = "the LR is at its floor (orchestrator.min_lr_scale=0.01)"
    for stop in stops:
        assert stop.action == "stop" and stop.params["exit_code"] == 3, stop
        assert f"and {floor}" in stop.params["reason"]
        assert stop.params["reason"].endswith(
            ": lower optim.lr; the better policy is the checkpoint at or before step 4"
        )
        assert floor in stop.reasoning
        assert stop.reasoning.endswith(
            "same LR: stopping keeps the better policy in the checkpoints, training on would not"
        )


@pytest.mark.parametrize("rollbacks, lr_scale", [(1, 0.5), (0, 0.01)])
def test_rl_hackings_stop_gives_up_with_its_reason(rollbacks: int, lr_scale: float) -> None:
    """Hacking again after its rollback (or at the LR's floor) stops as rl_reward does: exit 3 and a reason for
    summary.json (the stop had no params: exit 0, "stopped (stop requested)")."""
    cfg = OrchestratorConfig()
    f = Finding(rule="rl_hacking", family="rl", step=12, evidence={"best_step": 2}, summary="", strength=1.0)
    stop = remedy(f, SimpleNamespace(lr_scale=lr_scale, has_checkpoint=lambda step: True), cfg, rollbacks=rollbacks)
    assert stop.action == "stop" and stop.params["exit_code"] == 3, stop
    why = "a rollback at a lower LR in this incident did not stop it" if rollbacks else "the LR is at its floor"
    assert stop.params["reason"].startswith(
        f"the held-out reward keeps falling while the training reward rises and {why}"
    )
    assert stop.params["reason"].endswith(
        "rl.held_out_reward measuring the task; the better policy is the checkpoint at or before step 2"
    )


def test_a_replay_from_before_the_best_evaluation_is_judged_against_that_best() -> None:
    """The rollback's target, step 0's checkpoint, holds no step-0 evaluation (it is not taken again): the hacking
    test's best is kept over it (KEPT_ON_ROLLBACK), as the fall's `top` is. Restored without it, the replay's first
    reading, 0/16, became the best and a replay hacking on from it was never found (measured: training reward to
    1.0 by step 30, held-out 0/16 through step 48, exit 0)."""
    cfg = OrchestratorConfig()
    cfg.rl_hacking.window, cfg.rl_hacking.sigmas = 2, 100.0  # the count's own fall out of reach: hacking alone
    mon = RewardHacking(cfg)
    target = mon.state_dict()  # step 0's checkpoint, saved before step 0's evaluation

    def replay(evals: list[int]) -> list[Any]:
        found = []
        for i, solved in enumerate(evals):
            for s in (2 * i - 1, 2 * i) if i else ():
                mon.observe(StepMetrics(step=s, loss=0.0, grad_norm=0.0, rl={"reward": 0.1 + 0.05 * s}))
            found.append(mon.observe_eval(2 * i, 0, solved / 16, solved, 16) if solved >= 0 else None)
        return found

    assert [f is not None for f in replay([10, 0, 0, 0])] == [False, False, False, True]
    kept = {key: getattr(mon, key) for key in mon.KEPT_ON_ROLLBACK}  # as Orchestrator._load_monitors
    mon.load_state_dict(target)
    for key, value in kept.items():
        setattr(mon, key, value)
    again = replay([-1, 0, 0, 0])  # no step-0 evaluation in the replay
    assert [f is not None for f in again] == [False, False, False, True]
    assert (again[3].evidence["best_step"], again[3].evidence["best_held_out_reward"]) == (0, 10 / 16)


def test_every_rl_and_dpo_rollback_whose_checkpoint_is_gone_stops_naming_it() -> None:
    """A rollback target with no checkpoint at or before it (never saved, or pruned): rl_hacking rolled back there
    ("failed: no checkpoint") and trained on, and the others' stops named the missing checkpoint as the better
    policy. Each stops (exit 3), saying the checkpoint is gone and how to keep one."""
    cfg = OrchestratorConfig()
    view = SimpleNamespace(
        lr_scale=1.0, has_checkpoint=lambda step: False, rl_overlong=(False, 8), rl_max_new_tokens=16
    )
    fell = SimpleNamespace(evidence={"good_step": 4, "good_score": 0.07, "score": 0.02, "start_score": 0.07})
    dpo = SimpleNamespace(evidence={"best_step": 4, "held_out_chosen_reward": -1.0})
    ev = {"kind": "held_out_fall", "best_step": 4, "fall_solved": 1, "fall_n": 200, "baseline_solved": 50}
    fall = Finding(rule="rl_hacking", family="rl", step=9, evidence=ev | {"baseline_n": 200}, summary="", strength=1.0)
    hacked = replace(fall, evidence={"best_step": 4})
    length = replace(fall, rule="rl_length", evidence={"short_step": 4, "times": cfg.rl_length.patience})
    stops = [
        reward_remedy(fell, view, cfg, 0),
        preference_remedy(dpo, view, cfg, 0),
        remedy(fall, view, cfg),
        remedy(fall, view, cfg, rollbacks=1),
        remedy(hacked, view, cfg),
        remedy(length, view, cfg),
    ]
    for stop in stops:
        assert stop.action == "stop" and stop.params["exit_code"] == 3, stop
        assert "no checkpoint at or before step 4 is left (a larger checkpoint.keep" in stop.params["reason"], stop
        assert stop.params["reason"].endswith("; no checkpoint holds the policy of step 4"), stop
