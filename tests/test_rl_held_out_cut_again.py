"""Rule rl_hacking's held-out fall found again after a rollback (rl_remedies._fall_again): an LR x30 the
documented one in the config (arithmetic, 200 held-out problems) read 53/200 at step 0 and 1/200 at step 10;
rule rl_reward rolled back to step 0 with the LR x0.1, and the replay read 17/200 and 19/200 (the healthy
twin: 59-60/200). That second finding stopped the run; the LR is now cut again, as pretraining's rule
above_start cuts again while the loss does not fall, and the run stops at the LR's floor or with the incident's
rollbacks spent."""

from types import SimpleNamespace

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.policy import Policy
from trimtab.orchestrator.rl_held_out import RewardHacking


class Run:
    """What the Policy reads of an RL run."""

    lr_scale, last_good, rollbacks, step = 1.0, 0, 0, 0

    def has_checkpoint(self, step: int) -> bool:
        return step >= 0


def evaluate(mon: RewardHacking, step: int, solved: int, n: int = 200) -> Finding | None:
    """Five steps of training reward 0.02 (flat: no hacking), then an evaluation at `step`."""
    for s in range(step - 4, step + 1):
        mon.observe(StepMetrics(step=s, loss=0.0, grad_norm=0.0, rl={"reward": 0.02}))
    return mon.observe_eval(step, 0, solved / n, solved, n)


def rolled_back(mon: RewardHacking, state: dict) -> None:
    """What Orchestrator._load_monitors does on a rollback: the checkpoint's state, KEPT_ON_ROLLBACK kept."""
    kept = {key: getattr(mon, key) for key in mon.KEPT_ON_ROLLBACK}
    mon.load_state_dict(state)
    for key, value in kept.items():
        setattr(mon, key, value)


def reward_fall(step: int) -> Finding:
    evidence = {"good_step": 0, "good_score": 0.05, "score": 0.0, "start_score": 0.05}
    return Finding(rule="rl_reward", family="rl", step=step, evidence=evidence, summary="", strength=1.0)


def test_a_held_out_fall_after_a_cut_that_helped_is_cut_again_down_to_the_floor() -> None:
    cfg = OrchestratorConfig()
    mon, policy, run = RewardHacking(cfg), Policy(cfg), Run()
    target = mon.state_dict()  # the step-0 checkpoint, saved before the step-0 evaluation
    assert evaluate(mon, 0, 53) is None and evaluate(mon, 10, 1) is None  # the collapse, under patience
    first = policy.plan(reward_fall(11), run)  # rule rl_reward's rollback, x0.1
    assert (first.action, first.params["lr_factor"]) == ("rollback", 0.1)
    first.applied()
    run.lr_scale = 0.1
    rolled_back(mon, target)
    policy.shift(11)
    assert evaluate(mon, 10, 17) is None
    again = evaluate(mon, 20, 19)
    assert again is not None and again.evidence["kind"] == "held_out_fall"
    cut = policy.plan(again, run)  # 36/400 against 1/200: the cut helped, and the LR is still too high
    assert (cut.action, cut.params) == ("rollback", {"to": 0, "lr_factor": 0.1}), cut
    assert (again.evidence["undone_solved"], again.evidence["undone_n"]) == (1, 200)  # the weights thrown away
    assert "the last cut took it from 1/200 to 36/400" in cut.reasoning
    cut.applied()
    run.lr_scale = 0.01  # orchestrator.min_lr_scale: no cut is left
    rolled_back(mon, target)
    policy.shift(20)
    assert evaluate(mon, 10, 20) is None
    third = evaluate(mon, 20, 18)
    assert third is not None and (third.evidence["undone_solved"], third.evidence["undone_n"]) == (36, 400)
    stop = policy.plan(third, run)
    assert stop.action == "stop" and stop.params["exit_code"] == 3, stop
    assert "the LR is at its floor (orchestrator.min_lr_scale=0.01)" in stop.params["reason"]


def test_a_cut_that_did_not_lift_the_count_or_was_never_measured_is_cut_again_until_the_rollbacks_are_spent() -> None:
    """x100 (lr 1e-2): the replay at 1e-3 collapsed as far (0/400 -> 1/400), and the next cut, to 1e-4, read 19/200
    ten steps on: a cut short of the floor is no reason to stop."""
    from trimtab.orchestrator.rl_remedies import remedy

    cfg = OrchestratorConfig()
    ev = {"kind": "held_out_fall", "best_step": 0, "fall_solved": 1, "fall_n": 400, "baseline_solved": 15}
    ev |= {"baseline_n": 200, "undone_solved": 0, "undone_n": 400}
    found = Finding(rule="rl_hacking", family="rl", step=20, evidence=ev, summary="", strength=1.0)
    view = SimpleNamespace(lr_scale=0.1, has_checkpoint=lambda step: True)
    cut = remedy(found, view, cfg, rollbacks=1)
    assert (cut.action, cut.params) == ("rollback", {"to": 0, "lr_factor": 0.1})
    assert "the last cut took it from 0/400 to 1/400" in cut.reasoning
    del ev["undone_solved"], ev["undone_n"]  # the rollback came before any evaluation of the weights it threw away
    unmeasured = remedy(found, view, cfg, rollbacks=1)
    assert (unmeasured.action, unmeasured.params) == ("rollback", {"to": 0, "lr_factor": 0.1})
    assert "never evaluated" in unmeasured.reasoning
    spent = remedy(found, view, cfg, rollbacks=cfg.max_rollbacks)
    assert spent.action == "stop" and spent.params["exit_code"] == 3
    assert "3 rollbacks used on this incident" in spent.params["reason"]
    # the best's checkpoint and every older one gone: a stop naming it, not a rollback that fails and trains on
    gone = remedy(found, SimpleNamespace(lr_scale=0.1, has_checkpoint=lambda step: False), cfg, rollbacks=1)
    assert gone.action == "stop" and "no checkpoint at or before step 0 is left" in gone.params["reason"]
