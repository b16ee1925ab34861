"""Rule rl_signal (orchestrator/rl_health.py) when dynamic sampling finds nothing: a reward no
response earns (or every one does) leaves every group flat however many are drawn. Dynamic
sampling then drew 4x the groups a step for the rest of the run (32 instead of 8 at the default
prompts_per_step, the built-in arithmetic task with reward `regex:(zzzz)` or `format:.*`); now it
goes off, and the rule stays quiet until the groups have a signal again."""

from types import SimpleNamespace

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.rl_health import NoLearningSignal
from trimtab.orchestrator.rl_remedies import remedy


def cfg() -> OrchestratorConfig:
    c = OrchestratorConfig()
    c.rl_signal.window, c.rl_signal.threshold = 2, 0.75
    return c


def steps(mon: NoLearningSignal, first: int, n: int, sampling: bool, flat: float = 1.0, solved: float = 0.0):
    """n steps' findings (None: none), each step drawn with dynamic sampling `sampling`, as RolloutBatch.health
    says it (4 prompts a step; 3 resampling rounds with it on)."""
    rl = {"flat_groups": flat, "solved_groups": solved, "groups_drawn": 16 if sampling else 4}
    return [mon.observe(StepMetrics(step=s, loss=0.0, grad_norm=0.0, rl={**rl, "dynamic_sampling": sampling}))
            for s in range(first, first + n)]  # fmt: skip


def test_dynamic_sampling_that_finds_no_signal_goes_off_and_the_rule_stays_quiet():
    c = cfg()
    mon, ceiling = NoLearningSignal(c), c.rl_signal.max_temperature
    off = SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=False)
    first = steps(mon, 1, 2, sampling=False)[-1]
    assert remedy(first, off, c).params == {"value": "on"}
    # a window drawn with dynamic sampling, every group flat, sampled at the ceiling already: off
    found = steps(mon, 3, 2, sampling=True)[-1]
    assert found.evidence["dynamic_sampling"] == 1.0 and found.evidence["groups_drawn"] == 16
    hard = remedy(found, SimpleNamespace(rl_temperature=ceiling, rl_dynamic_sampling=True), c)
    # the remedies spent: a stop (exit 3) whose reason names the cause and the fixes, not training on with no gradient
    assert (hard.action, hard.params["exit_code"]) == ("stop", 3)
    reason = hard.params["reason"]
    assert "no learning signal" in reason and "16 groups" in reason and "advantage" in reason
    assert all(fix in reason for fix in ("train.init_from", "rl.prompts", "rl.group_size")), reason
    # below the ceiling the temperature rises first, as before
    warmer = remedy(found, SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=True), c)
    assert warmer.action == "set_rl_temperature"
    # off (by a person, or as too easy): flat still, but quiet (it turned the sampling on again, every other window)
    assert steps(mon, 5, 8, sampling=False) == [None] * 8
    # the groups have a signal again: the rule is back, and finds the next flat stretch
    assert steps(mon, 13, 2, sampling=False, flat=0.5) == [None, None]
    again = [f for f in steps(mon, 15, 2, sampling=False) if f is not None]
    assert len(again) == 1 and remedy(again[0], off, c).params == {"value": "on"}


def test_solved_groups_turn_dynamic_sampling_off_as_too_easy():
    c = cfg()
    mon = NoLearningSignal(c)
    steps(mon, 1, 2, sampling=False, solved=1.0)
    found = steps(mon, 3, 2, sampling=True, solved=1.0)[-1]
    easy = remedy(found, SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=True), c)
    assert (easy.action, easy.params) == ("set_dynamic_sampling", {"value": "off"}) and "too easy" in easy.reasoning
    # a window half drawn without it (the decision came a step late) is not evidence against it
    late = NoLearningSignal(c)
    steps(late, 1, 1, sampling=False, solved=1.0)
    mixed = steps(late, 2, 1, sampling=True, solved=1.0)[-1]
    kept = remedy(mixed, SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=True), c)
    assert mixed.evidence["dynamic_sampling"] == 0.5 and kept.action == "none"


def test_a_persons_dynamic_sampling_switch_after_it_found_nothing_is_respected():
    c = cfg()
    mon = NoLearningSignal(c)
    steps(mon, 1, 2, sampling=False)
    steps(mon, 3, 1, sampling=True)  # the rule turned it on; a person turns it off a step later (`trimtab ctl`)
    assert steps(mon, 4, 6, sampling=False) == [None] * 6  # not turned on again
    # ...and on again, by a person: the rule does not turn it off behind their back
    assert steps(mon, 10, 6, sampling=True) == [None] * 6
    state = mon.state_dict()  # checkpointed: a resume stays quiet
    resumed = NoLearningSignal(c)
    resumed.load_state_dict(state)
    assert resumed.gave_up and steps(resumed, 16, 4, sampling=True) == [None] * 4


def test_the_mostly_solved_note_is_said_once_not_again_every_window(tmp_path):
    """With dynamic sampling on and the flat groups mostly solved the rule notes that sampling already
    looks for the others; its words held each window's shares, so every window (5 steps) was a new
    decision in the journal: 39 of one note in 200 steps. Said again, it is counted on the first."""
    c = cfg()
    orchestrator, mon = Orchestrator(c, tmp_path), NoLearningSignal(c)
    run = SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=True, step=0, say=lambda line: None)
    windows = steps(mon, 1, 2, True, flat=0.95, solved=0.9) + steps(mon, 3, 2, True, flat=0.9, solved=0.8)
    found = [f for f in windows if f is not None]  # groups flat, not all: not barren, sampling stays on
    decided = [orchestrator.decide(run, f) for f in found]
    assert len(found) == 2 and decided[0] is decided[1] and decided[0].action == "none"
    assert len(orchestrator.journal.decisions) == 1 and decided[0].evidence["seen_again"] == 1


def first_rollouts(mon: NoLearningSignal, score: float, flat: float = 1.0, step: int = 1):
    """A step of 4 prompts x 4 responses with 0/1 rewards, `score` the groups' mean scores' sum."""
    rl = {"flat_groups": flat, "solved_groups": 0.0, "groups_drawn": 4, "dynamic_sampling": False}
    rl |= {"score_n": 4, "score": score, "score_sq": score, "reward": score / 4, "verifications": (16, 0, 0)}
    return mon.observe(StepMetrics(step=step, loss=0.0, grad_norm=0.0, rl=rl))


def test_a_starting_policy_that_earns_no_reward_is_said_at_its_first_rollouts():
    """From a 10-step text model on the arithmetic task, held-out pass@1 read 0/64 at step 0 and every group was flat
    at 0; the rule turned dynamic sampling on at step 5 and sampled warmer at 10 and 15, and nothing said the starting
    model had no signal. Now its first rollouts say it, with what it means and the fixes, once."""
    c = cfg()
    mon = NoLearningSignal(c)
    assert mon.observe_eval(0, 0, 0.0, solved=0, n=64) is None
    found = first_rollouts(mon, 0.0)
    assert found is not None and found.evidence["kind"] == "no_reward" and found.step == 1
    expected = {"groups": 4, "group_size": 4, "held_out_solved": 0, "held_out_n": 64}
    assert found.evidence.items() >= expected.items()
    assert "no reward at all" in found.summary and "pass@4 0" in found.summary and "0/64" in found.summary
    assert all(fix in found.summary for fix in ("advantage", "train.init_from", "rl.prompts", "rl.group_size"))
    said = remedy(found, SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=False), c)
    assert said.action == "none" and "exit 3" in said.reasoning
    # said once: the window's finding follows as before (dynamic sampling on), and a resume does not say it again
    window = first_rollouts(mon, 0.0, step=2)
    off = SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=False)
    assert "kind" not in window.evidence and remedy(window, off, c).params == {"value": "on"}
    resumed = NoLearningSignal(c)
    resumed.load_state_dict(NoLearningSignal(c).state_dict() | {"warned": True})  # a checkpoint after step 1
    assert first_rollouts(resumed, 0.0, step=2) is None


def test_first_rollouts_with_a_signal_or_greedy_answers_right_are_not_warned():
    c = cfg()
    assert first_rollouts(NoLearningSignal(c), 1.0, flat=0.75) is None  # a right response: a group with a signal
    greedy = NoLearningSignal(c)
    greedy.observe_eval(0, 0, 0.1, solved=3, n=64)  # greedy answers earn: warmer sampling may find them
    assert first_rollouts(greedy, 0.0) is None
    failing = NoLearningSignal(c)  # every verification failed: rule rl_verifier's to say
    rl = {"flat_groups": 1.0, "solved_groups": 0.0, "groups_drawn": 4, "score_n": 4, "score": 0.0, "score_sq": 0.0}
    rl |= {"reward": 0.0, "verifications": (16, 16, 0)}
    assert failing.observe(StepMetrics(step=1, loss=0.0, grad_norm=0.0, rl=rl)) is None
