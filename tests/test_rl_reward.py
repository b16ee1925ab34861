"""Rule rl_reward (orchestrator/rl_reward.py): the verifier's mean group score below the phase's
start, told from sampling noise over groups, and its remedy: back to the last policy above the
line with a smaller LR, then a stop."""

from types import SimpleNamespace

import pytest

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import StepMetrics
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


def test_a_fall_past_the_noise_of_the_groups_is_found_with_the_last_step_above_the_line(cfg):
    mon = RewardFall(cfg)
    assert mon.observe(StepMetrics(step=1, loss=2.0, grad_norm=1.0)) is None  # not an RL step
    healthy = [[0.5, 0.25, 0.5, 0.25] * 2] * 3  # mean 0.375 over 8 groups a step
    falling = [[0.25] * 8, [0.0] * 8, [0.0] * 8, [0.0] * 8]
    found = feed(mon, healthy + falling)
    assert [f is not None for f in found] == [False] * 5 + [True, False]  # a fresh window after it fired
    f = found[5]
    assert f.rule == "rl_reward" and f.family == "rl"
    assert f.evidence["start_score"] == pytest.approx(0.375) and f.evidence["score"] == pytest.approx(0.25 / 3)
    assert f.evidence["good_step"] == 4  # the last step whose window stood above the line (0.1875)
    assert f.evidence["z"] >= cfg.rl_reward.sigmas and f.evidence["times"] == 1
    # a restored state (a rollback) keeps the count of findings
    count = mon.fired
    mon.load_state_dict({**mon.state_dict(), "fired": 0})
    assert mon.fired == count


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
    f = SimpleNamespace(evidence={"good_step": 12, "score": 0.01, "start_score": 0.2})

    def view(rollbacks=0, lr_scale=1.0, checkpoint=True):
        return SimpleNamespace(rollbacks=rollbacks, lr_scale=lr_scale, has_checkpoint=lambda step: checkpoint)

    first = reward_remedy(f, view(), cfg)
    assert first.action == "rollback" and first.params == {"to": 12, "skip_rows": [], "lr_factor": 0.1}
    assert "step 12" in first.reasoning
    floor = reward_remedy(f, view(lr_scale=0.05), cfg)  # x0.1 would go under min_lr_scale 0.01: to the floor
    assert floor.action == "rollback" and floor.params["lr_factor"] == pytest.approx(0.2)
    for spent in (view(rollbacks=cfg.max_rollbacks), view(lr_scale=cfg.min_lr_scale), view(checkpoint=False)):
        last = reward_remedy(f, spent, cfg)
        assert last.action == "stop" and "lower optim.lr" in last.params["reason"]
