"""Rule rl_signal (orchestrator/rl_health.py) on a collapsing policy: at optim.lr=1e-2 on the arithmetic task every
response failed, the groups went flat, and the rule warmed the sampling 1 -> 1.25 -> 1.5 while held-out pass@1 fell
14/100 -> 0/100 (warmer sampling does not mend a broken policy). Flat groups at a collapsed policy (held-out pass@1 or
the training score fallen from where it was, the entropy blown up, or an RL rollback's incident open) now leave the
knobs alone for rules rl_reward and rl_hacking; uniform groups at a sound policy get the remedy as before."""

import math
from statistics import NormalDist
from types import SimpleNamespace

import pytest

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.policy import Policy
from trimtab.orchestrator.rl_health import NoLearningSignal
from trimtab.orchestrator.rl_remedies import remedy
from trimtab.orchestrator.rl_stats import exact_fall

SAMPLING = SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=True)  # dynamic sampling on: warmer next


def cfg() -> OrchestratorConfig:
    c = OrchestratorConfig()
    c.rl_signal.window = 2
    return c


def step(mon: NoLearningSignal, s: int, groups: list[float], entropy: float = 1.0):
    """One step's finding: 8-response groups with these mean rewards (0/1 rewards), as RolloutBatch.health says."""
    flat = sum(g in (0.0, 1.0) for g in groups) / len(groups)
    rl = {
        "flat_groups": flat,
        "solved_groups": sum(g == 1.0 for g in groups) / len(groups),
        "groups_drawn": len(groups),
        "verifications": (8 * len(groups), 0, 0),
        "score_n": len(groups),
        "score": sum(groups),
        "score_sq": sum(g * g for g in groups),
        "reward": sum(groups) / len(groups),
        "entropy": entropy,
    }
    return mon.observe(StepMetrics(step=s, loss=0.0, grad_norm=0.0, rl=rl))


SOUND = [0.25, 0.125, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # 75% flat at 0: uniform groups, the policy as it started
EARNING = [0.25, 0.25, 0.125, 0.0, 0.0, 0.0, 0.0, 0.0]  # a start that earned more (5 of 64 right a step)
BROKEN = [0.0] * 8


def run(steps: list[tuple[list[float], float]]) -> list:
    mon = NoLearningSignal(cfg())
    return [f for s, (groups, entropy) in enumerate(steps, 1) if (f := step(mon, s, groups, entropy)) is not None]


def test_a_training_score_fallen_or_an_entropy_blown_up_stands_the_rule_down():
    c = cfg()
    sound = run([(SOUND, 1.0)] * 4)  # flat at a sound policy: warmer sampling, as before
    assert len(sound) == 2 and "collapsed" not in sound[-1].evidence
    assert remedy(sound[-1], SAMPLING, c).action == "set_rl_temperature"
    # 5/64 -> 0/64 right, twice: 6 of 16 groups with a right answer -> 0 of 16 (Fisher's exact z 2.4)
    fallen = run([(EARNING, 1.0)] * 2 + [(BROKEN, 1.0)] * 3)[-1]
    assert list(fallen.evidence["collapsed"]) == ["training reward"] and "collapsed" in fallen.summary
    stood = remedy(fallen, SAMPLING, c)
    assert stood.action == "none" and "rl_reward" in stood.reasoning and "training reward" in stood.reasoning
    hot = run([(SOUND, 1.0)] * 2 + [(SOUND, 1.8)] * 2)[-1]  # the entropy risen 1.8x (at lr 1e-2: 1.4 -> 2.1)
    assert list(hot.evidence["collapsed"]) == ["entropy"] and remedy(hot, SAMPLING, c).action == "none"
    warm = run([(SOUND, 1.0)] * 2 + [(SOUND, 1.2)] * 2)[-1]  # within orchestrator.rl_signal.entropy_rise
    assert "collapsed" not in warm.evidence
    # 3/64 -> 0/64 twice: 4 of 16 groups with a right answer -> 0 of 16, Fisher's exact z 1.6, within the noise
    noise = run([(SOUND, 1.0)] * 2 + [(BROKEN, 1.0)] * 2)[-1]
    assert "collapsed" not in noise.evidence


def test_a_collapse_inside_the_first_window_is_recognised():
    """The phase's first `window` steps were the start, read once the next `window` had come: 5 of 64 right at step 1,
    none from step 2 (the default window of 5) was the policy's own start, and the rule warmed the broken policy's
    sampling at steps 5 and 10 (a collapse at step 3 was recognised at step 10 at z 2.1). The starting policy's step
    is now a start of its own: 3 of its 8 groups had a right answer, 0 of the 32 after (Fisher's exact z 2.5)."""
    c = OrchestratorConfig()
    mon = NoLearningSignal(c)
    found = [f for s in range(1, 11) if (f := step(mon, s, EARNING if s == 1 else BROKEN)) is not None]
    assert [f.step for f in found] == [5, 10]
    for f in found:
        start, now, z = f.evidence["collapsed"]["training reward"]
        assert (start, now) == (sum(EARNING) / len(EARNING), 0.0) and z > c.rl_signal.collapse_sigmas
        assert remedy(f, SAMPLING, c).action == "none"
    assert exact_fall(3, 8, 0, 32) == pytest.approx(z_of(math.comb(8, 3) / math.comb(40, 3)))  # hypergeometric
    assert exact_fall(2, 8, 0, 16) < c.rl_signal.collapse_sigmas  # 2 of 8 groups against 0 of 16: p 0.10


def z_of(tail: float) -> float:
    return -NormalDist().inv_cdf(tail)


def test_a_held_out_fall_stands_the_rule_down_and_the_orchestrator_passes_the_counts(tmp_path):
    c = cfg()
    orch = Orchestrator(c, tmp_path)
    mon, view = orch.monitors["rl_signal"], SimpleNamespace(phase=0, weights_finite=lambda: True)
    evaluation = {"step": 0, "rl/held_out_reward": 0.14, "rl/held_out_pass@1": 0.14, "rl/held_out_n": 100.0}
    orch.on_eval(view, evaluation)
    first = [f for s in (1, 2) if (f := step(mon, s, BROKEN)) is not None][-1]
    assert "collapsed" not in first.evidence  # 14/100 held out: flat groups at a sound policy
    orch.on_eval(view, evaluation | {"step": 2, "rl/held_out_reward": 0.02, "rl/held_out_pass@1": 0.02})
    assert mon.top == [14, 100, 0] and mon.held_out == [2, 100, 2]
    found = [f for s in (3, 4) if (f := step(mon, s, BROKEN)) is not None][-1]
    assert found.evidence["collapsed"]["held-out pass@1"][:2] == [0.14, 0.02]  # 14/100 -> 2/100: 3.2 errors
    assert remedy(found, SAMPLING, c).action == "none"
    # 14/100 -> 11/100 is within a 100-problem set's noise (0.6 errors): the rule acts as before
    orch.on_eval(view, evaluation | {"step": 4, "rl/held_out_reward": 0.11, "rl/held_out_pass@1": 0.11})
    noise = [f for s in (5, 6) if (f := step(mon, s, BROKEN)) is not None][-1]
    assert "held-out pass@1" not in noise.evidence.get("collapsed", {})


def test_an_open_rollback_incident_stands_the_rule_down():
    """rule rl_reward's or rl_hacking's rollback to a better policy at a lower LR: its replay's flat groups are the
    fall's (at lr 1e-2 the temperature the rule set on the collapse, kept, weakened the replay's start)."""
    c = cfg()
    found = run([(SOUND, 1.0)] * 4)[-1]
    assert remedy(found, SAMPLING, c, rollbacks=0).action == "set_rl_temperature"
    stood = remedy(found, SAMPLING, c, rollbacks=1)
    assert stood.action == "none" and "incident is open" in stood.reasoning


def test_an_open_rl_length_incident_is_named_with_why_warmer_sampling_would_not_help():
    """rl_length's rollback (responses ran to the token budget, the overlong penalty already over most of it): the
    replay's flat groups are cut responses graded unfinished. The stand-down said the policy "fails every prompt"
    and sent the fall to rules rl_reward and rl_hacking, neither of which had rolled back."""
    policy = Policy(cfg())
    view = SimpleNamespace(
        rl_temperature=1.0,
        rl_dynamic_sampling=True,
        rl_overlong=(True, 100),  # over 100 of 128 tokens: both penalty widths spent, rollback next
        rl_max_new_tokens=128,
        has_checkpoint=lambda step: True,
    )
    runaway = Finding(rule="rl_length", family="rl", step=20, evidence={"short_step": 10}, summary="", strength=1.0)
    rollback = policy.plan(runaway, view)
    assert rollback.action == "rollback"
    rollback.applied()
    stood = policy.plan(run([(SOUND, 1.0)] * 4)[-1], view)
    assert stood.action == "none" and "rule rl_length's incident is open" in stood.reasoning
    assert "token budget" in stood.reasoning and "warmer sampling" in stood.reasoning
    assert "fails every prompt" not in stood.reasoning and "rl_reward" not in stood.reasoning


def test_a_start_too_thin_to_tell_a_collapse_says_the_prompts_a_step_that_would():
    """8 prompts x 8 responses at a pass rate ~0.05: the starting policy's step held 2 groups with a right response,
    and 2 of 8 against 0 of 32 after reads z 1.8 (Fisher's exact), under the bar, so a collapse at step 2 read as thin
    signal and the sampling was warmed with nothing said. The finding now names the prompts a step that would tell."""
    c = OrchestratorConfig()
    mon = NoLearningSignal(c)
    found = [f for s in range(1, 6) if (f := step(mon, s, SOUND if s == 1 else BROKEN)) is not None]
    assert len(found) == 1 and "collapsed" not in found[0].evidence
    needed = found[0].evidence["prompts_to_decide"]
    assert f"rl.prompts_per_step={needed} would" in found[0].summary
    scale = needed // 8
    assert exact_fall(2 * scale, 8 * scale, 0, 32 * scale) >= c.rl_signal.collapse_sigmas  # that many would tell
    assert exact_fall(2 * (scale - 1), 8 * (scale - 1), 0, 32 * (scale - 1)) < c.rl_signal.collapse_sigmas
    mon = NoLearningSignal(c)  # a start that tells a collapse already: nothing to add
    found = [f for s in range(1, 6) if (f := step(mon, s, EARNING if s == 1 else BROKEN)) is not None]
    assert "prompts_to_decide" not in found[0].evidence


def test_a_collapse_after_a_thin_start_is_read_against_every_step_since():
    """A start of 2 of 8 groups with a right response (8 prompts at a pass rate ~0.05), none from step 2: against the
    last 5 steps' 0 of 40 groups it read z 2.0, under the bar (2.24: Bonferroni over the two starts), at every window
    through step 20, and the broken policy's sampling was warmed. Against every step since pooled (0 of 72 at step 10:
    z 2.4) it reads collapsed at step 10; a sound policy's steps since hold right answers, and it does not."""
    c = OrchestratorConfig()
    mon = NoLearningSignal(c)
    found = [f for s in range(1, 21) if (f := step(mon, s, SOUND if s == 1 else BROKEN)) is not None]
    assert [f.step for f in found] == [5, 10, 15, 20]
    assert "collapsed" not in found[0].evidence  # 0 of 32 since: the window itself, z 1.8
    start, now, z = found[1].evidence["collapsed"]["training reward"]
    assert (start, now) == (sum(SOUND) / 8, 0.0) and z == pytest.approx(exact_fall(2, 8, 0, 72))
    mon = NoLearningSignal(c)  # the same start, a sound policy after it: 1 group of 8 answered a step
    found = [f for s in range(1, 21) if (f := step(mon, s, SOUND if s == 1 else [0.125] + [0.0] * 7)) is not None]
    assert found and not any("collapsed" in f.evidence for f in found)
