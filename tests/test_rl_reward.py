"""Rule rl_reward (orchestrator/rl_reward.py): the verifier's mean group score below the phase's
start, told from sampling noise over groups, and its remedy: back to the last policy above the
line with a smaller LR, then a stop."""

import copy
from types import SimpleNamespace

import pytest

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.policy import Policy
from trimtab.orchestrator.rl_reward import RewardFall, reward_remedy


def step_of(i: int, groups: list[float], reward: float | None = None, buffer: int = 0) -> StepMetrics:
    """An RL step whose drawn groups scored these means; the reward trained on is their mean
    unless an overlong penalty (`buffer` tokens) makes it `reward`."""
    rl = {"score_n": len(groups), "score": sum(groups), "score_sq": sum(g * g for g in groups)}
    rl |= {"reward": sum(groups) / len(groups) if reward is None else reward, "overlong_buffer": buffer}
    return StepMetrics(step=i, loss=0.0, grad_norm=1.0, rl=rl | {"temperature": 1.0})


def feed(monitor: RewardFall, steps: list[list[float]], start: int = 1) -> list:
    return [monitor.observe(step_of(start + i, groups)) for i, groups in enumerate(steps)]


@pytest.fixture
def cfg() -> OrchestratorConfig:
    made = OrchestratorConfig()
    made.rl_reward.start_steps = made.rl_reward.window = 3
    made.rl_reward.sigmas = 3.0
    return made


def test_a_fall_past_the_noise_of_the_groups_is_found_with_the_step_before_it_began(cfg):
    mon = RewardFall(cfg)
    assert mon.observe(StepMetrics(step=1, loss=2.0, grad_norm=1.0)) is None  # not an RL step
    healthy = [[0.5, 0.25, 0.5, 0.25] * 2] * 3  # mean 0.375 over 8 groups a step
    falling = [[0.25] * 8, [0.0] * 8, [0.0] * 8, [0.0] * 8]
    found = feed(mon, healthy + falling)
    assert [f is not None for f in found] == [False] * 5 + [True, False]  # a fresh window after it fired
    f = found[5]
    assert f.rule == "rl_reward" and f.family == "rl"
    assert f.evidence["start_score"] == pytest.approx(0.375) and f.evidence["score"] == pytest.approx(0.25 / 3)
    # the last step whose window stood within the noise of the start: step 4's 0.25 is 4.9
    # standard errors below 0.375 (though above the line, 0.1875): the fall began there
    assert f.evidence["good_step"] == 3 and f.evidence["good_score"] == pytest.approx(0.375)
    assert f.evidence["z"] >= cfg.rl_reward.sigmas and f.evidence["times"] == 1
    # a restored state (a rollback) keeps the count of findings
    count = mon.fired
    mon.load_state_dict({**mon.state_dict(), "fired": 0})
    assert mon.fired == count


def course(cfg: OrchestratorConfig, fall: float, steps: int = 80) -> list[tuple[int, int]]:
    """A policy earning 0.4 for 5 steps whose reward then falls by `fall` a step, rolled back at
    each finding to its target (a checkpoint at every step: the monitor's state as saved there)
    and replayed from that step's reward at a tenth of the fall (the LR x0.1); (the step of each
    finding, its target), while no more than max_rollbacks + 1 findings are made."""
    mon, level, slope, saved, levels, found, step = RewardFall(cfg), 0.4, 0.0, {}, {}, [], 0
    while step < steps and len(found) <= cfg.max_rollbacks:
        step += 1
        slope = -fall if step == 6 and not found else slope
        level = levels[step] = max(level + slope, 0.0)
        f = mon.observe(step_of(step, [level * k for k in (0.5, 0.75, 1.25, 1.5)] * 2))
        saved[step] = copy.deepcopy(mon.state_dict())
        if f is not None:
            step = f.evidence["good_step"]
            found.append((f.step, step))
            mon.load_state_dict(copy.deepcopy(saved[step]))
            level, slope = levels[step], slope * 0.1
    return found


def test_a_gradual_fall_rolls_back_to_where_it_began_and_the_replay_holds():
    """Default settings (a window of 10 steps, 3 at the start): the reward falls 0.02 a step from
    0.4. The last window above the line (0.2) was step 19's, its policy already at 0.12 (a
    window lags a gradual fall): each replay from it found the same window at step 20 again,
    three rollbacks and a stop. Back to where the fall began (the last window within the noise
    of the start: step 13, at 0.24), the replay at a tenth of the LR runs 25 steps before its own
    slower fall is found, once; at a hundredth the policy holds."""
    cfg = OrchestratorConfig()
    found = course(cfg, 0.02)
    assert found[0] == (20, 13), found
    assert len(found) < cfg.max_rollbacks, found  # never out of rollbacks: no stop
    replays = [(to, at) for (_, to), (at, _) in zip(found, found[1:])]  # from each rollback to the next finding
    assert all(at - to > cfg.rl_reward.window for to, at in replays), found  # not the same window again
    assert 0.4 - 0.02 * (found[0][1] - 5) > 0.2  # the target's policy earned above the line


def test_a_fall_within_the_noise_of_few_groups_is_not_found(cfg):
    """Half the reward, but over two groups a step whose scores spread from 0 to 1: the start's
    own standard error is as large as the fall (per response it would count as 16 draws)."""
    noisy = [[1.0, 0.0]] * 3
    found = feed(RewardFall(cfg), noisy + [[0.5, 0.0]] * 3)
    assert found == [None] * 6


def test_a_reward_that_holds_or_rises_is_never_found(cfg):
    mon = RewardFall(cfg)
    start = [[0.2, 0.1, 0.3, 0.2]] * 3
    assert feed(mon, start + [[0.15, 0.1, 0.2, 0.15]] * 10 + [[0.6, 0.7, 0.5, 0.6]] * 10) == [None] * 23


def test_a_fall_the_overlong_penalty_pays_for_is_no_fault_but_a_fall_under_it_is(cfg):
    """A verifier that pays for length pays less as the overlong penalty brings the responses
    back under the budget: the reward trained on (the penalty included) rises, the rule keeps
    quiet. A new penalty starts the line again; under it, a fall of both is found."""
    mon = RewardFall(cfg)
    healthy = [[0.5, 0.25, 0.5, 0.25] * 2] * 3
    assert feed(mon, healthy) == [None] * 3
    shorter = [step_of(4 + i, [0.3 * 0.7**i] * 8, reward=-0.8 + 0.1 * i, buffer=4) for i in range(8)]
    assert [mon.observe(m) for m in shorter] == [None] * 8
    assert mon.overlong_buffer == 4 and len(mon.start) == 3  # the line starts again under the penalty
    mon = RewardFall(cfg)
    under = [step_of(1 + i, [0.4] * 8, reward=-0.1, buffer=4) for i in range(3)]
    worse = [step_of(4 + i, [0.0] * 8, reward=-0.5, buffer=4) for i in range(3)]
    found = [mon.observe(m) for m in under + worse]
    assert [f is not None for f in found] == [False] * 5 + [True]
    evidence = found[5].evidence
    assert evidence["reward"] == pytest.approx(-0.5) and evidence["start_reward"] == pytest.approx(-0.1)


def test_the_remedy_rolls_back_with_a_smaller_lr_then_stops():
    cfg = OrchestratorConfig()
    f = SimpleNamespace(evidence={"good_step": 12, "good_score": 0.19, "score": 0.01, "start_score": 0.2})

    def view(lr_scale=1.0, checkpoint=True):
        return SimpleNamespace(lr_scale=lr_scale, has_checkpoint=lambda step: checkpoint)

    first = reward_remedy(f, view(), cfg, 0)
    assert first.action == "rollback" and first.params == {"to": 12, "skip_rows": [], "lr_factor": 0.1}
    assert "step 12 or before (the last whose window (0.190) stood within the noise of the start" in first.reasoning
    floor = reward_remedy(f, view(lr_scale=0.05), cfg, 0)  # x0.1 would go under min_lr_scale 0.01: to the floor
    assert floor.action == "rollback" and floor.params["lr_factor"] == pytest.approx(0.2)
    spent = [(view(), cfg.max_rollbacks), (view(lr_scale=cfg.min_lr_scale), 0), (view(checkpoint=False), 0)]
    for run, rollbacks in spent:
        last = reward_remedy(f, run, cfg, rollbacks)
        assert last.action == "stop" and "lower optim.lr" in last.params["reason"]
    spent_all = reward_remedy(f, view(), cfg, cfg.max_rollbacks).params["reason"]
    assert "3 rollbacks used on this incident (orchestrator.max_rollbacks=3 per incident)" in spent_all


class Run:
    """What the Policy reads of an RL run; `rollbacks` counts the run's, as RunView.rollbacks does."""

    lr_scale, last_good, rollbacks = 1.0, 0, 0

    def has_checkpoint(self, step: int) -> bool:
        return step >= 0


def fall(step: int) -> Finding:
    evidence = {"good_step": step - 10, "good_score": 0.2, "score": 0.01, "start_score": 0.2}
    return Finding(rule="rl_reward", family="rl", step=step, evidence=evidence, summary="", strength=1.0)


def test_max_rollbacks_is_per_incident_and_a_healed_fall_leaves_a_later_one_its_rollback():
    """orchestrator.max_rollbacks=1: a fall at step 30, rolled back and healed (the replay trains
    past step 30, then escalation_window steps without a fall), leaves the fall at step 120 its own
    rollback (counted over the run, it stopped the run); a fall again within that incident stops it."""
    cfg = OrchestratorConfig(max_rollbacks=1)
    policy, run = Policy(cfg), Run()

    def decide(f: Finding) -> str:
        remedy = policy.plan(f, run)
        remedy.applied()
        if remedy.action == "rollback":
            run.rollbacks += 1
            policy.shift(f.step - f.evidence["good_step"])  # the orchestrator's on_rollback
        return remedy.action

    assert decide(fall(30)) == "rollback"
    for step in range(21, 120):  # the replay, past step 30 and a quiet window on: the incident is over
        policy.quiet(step, run)
    assert decide(fall(120)) == "rollback"
    for step in range(111, 125):  # the replay: past step 120, but not quiet for long
        policy.quiet(step, run)
    stop = policy.plan(fall(125), run)
    assert stop.action == "stop" and "1 rollbacks used on this incident" in stop.params["reason"]


def test_a_fall_before_the_replay_got_past_the_rollback_is_the_same_incident():
    cfg = OrchestratorConfig(max_rollbacks=1)
    policy, run = Policy(cfg), Run()
    policy.plan(fall(30), run).applied()
    policy.shift(10)
    for step in range(21, 30):  # quiet, but the replay has not trained past step 30
        policy.quiet(step, run)
    assert policy.rl.rollbacks == 1 and policy.plan(fall(30), run).action == "stop"
    advice = Policy(cfg)
    assert advice.plan(fall(30), run).action == "rollback" and advice.rl.rollbacks == 0  # advice spends none


def test_the_open_incident_is_kept_in_the_policy_state():
    policy = Policy(OrchestratorConfig())
    policy.plan(fall(30), Run()).applied()
    restored = Policy(OrchestratorConfig())
    restored.load_state_dict(policy.state_dict())
    assert (restored.rl.rollbacks, restored.rl.rollback_at) == (1, 30)
    restored.load_state_dict({k: v for k, v in policy.state_dict().items() if k != "rl_incident"})  # older
    assert restored.rl.rollbacks == 0
