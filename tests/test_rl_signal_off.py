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
    # off (by a person): mostly flat, but quiet (it turned the sampling on again, every other window)
    assert steps(mon, 5, 8, sampling=False, flat=0.9) == [None] * 8
    # the groups have a signal again: the rule is back, and finds the next flat stretch
    assert steps(mon, 13, 2, sampling=False, flat=0.5) == [None, None]
    again = [f for f in steps(mon, 15, 2, sampling=False) if f is not None]
    assert len(again) == 1 and remedy(again[0], off, c).params == {"value": "on"}


def test_solved_groups_drawn_by_dynamic_sampling_stop_the_run_as_learned():
    """Every group of a window drawn by dynamic sampling solved: the policy has learnt the prompts and no step has a
    gradient. The rule turned dynamic sampling off and the run trained on at loss 0 to max_steps; now it stops, exit 0
    (the run has done its work), naming harder prompts."""
    c = cfg()
    mon = NoLearningSignal(c)
    steps(mon, 1, 2, sampling=False, solved=1.0)
    found = steps(mon, 3, 2, sampling=True, solved=1.0)[-1]
    easy = remedy(found, SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=True), c)
    assert (easy.action, easy.params["exit_code"]) == ("stop", 0)
    assert "task is learned" in easy.params["reason"] and "rl.prompts" in easy.params["reason"]
    # a window half drawn without it (the decision came a step late) is not evidence against it
    late = NoLearningSignal(c)
    steps(late, 1, 1, sampling=False, solved=1.0)
    mixed = steps(late, 2, 1, sampling=True, solved=1.0)[-1]
    kept = remedy(mixed, SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=True), c)
    assert mixed.evidence["dynamic_sampling"] == 0.5 and kept.action == "none"


def test_a_persons_dynamic_sampling_switch_after_it_found_nothing_is_respected():
    c = cfg()
    mon = NoLearningSignal(c)
    steps(mon, 1, 2, sampling=False, flat=0.9)
    steps(mon, 3, 1, sampling=True, flat=0.9)  # the rule turned it on; a person turns it off a step later (`ctl`)
    assert steps(mon, 4, 6, sampling=False, flat=0.9) == [None] * 6  # not turned on again
    # ...and on again, by a person: the rule does not turn it off behind their back
    assert steps(mon, 10, 6, sampling=True, flat=0.9) == [None] * 6
    state = mon.state_dict()  # checkpointed: a resume stays quiet
    resumed = NoLearningSignal(c)
    resumed.load_state_dict(state)
    assert resumed.gave_up and steps(resumed, 16, 4, sampling=True, flat=0.9) == [None] * 4


def test_a_barren_run_with_dynamic_sampling_turned_off_by_a_person_still_walks_to_the_stop():
    """`trimtab ctl RUN dynamic-sampling off` a step after the rule turned it on, on a run whose every group is flat
    at reward 0 (a 10-step text model, rl.held_out=0): the rule went quiet and the run trained at loss 0 to step 40,
    exit 0. Now a window with no group with a signal still acts, sampling left off: warmer, then the stop (exit 3)."""
    c = cfg()
    mon, ceiling = NoLearningSignal(c), c.rl_signal.max_temperature
    steps(mon, 1, 2, sampling=False)
    steps(mon, 3, 1, sampling=True)  # the rule turned it on; a person turns it off a step later
    found = [f for f in steps(mon, 4, 2, sampling=False) if f is not None]
    assert len(found) == 1 and found[0].evidence["sampling_off"]
    off = SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=False)
    assert (remedy(found[0], off, c).action, remedy(found[0], off, c).params) == ("set_rl_temperature", {"value": 1.25})
    last = [f for f in steps(mon, 6, 2, sampling=False) if f is not None][-1]
    stop = remedy(last, SimpleNamespace(rl_temperature=ceiling, rl_dynamic_sampling=False), c)
    assert (stop.action, stop.params["exit_code"]) == ("stop", 3) and "dynamic sampling off" in stop.params["reason"]
    # solved instead (every response right), sampling off after it drew them: learned, a stop with exit 0
    solved = NoLearningSignal(c)
    steps(solved, 1, 1, sampling=True, solved=1.0)
    done = [f for f in steps(solved, 2, 2, sampling=False, solved=1.0) if f is not None][0]
    assert done.evidence["sampling_off"] and remedy(done, off, c).params["exit_code"] == 0


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


def first_rollouts(mon: NoLearningSignal, score: float, flat: float = 1.0, step: int = 1, squares: float = -1.0):
    """A step of 4 prompts x 4 responses, `score` the groups' mean scores' sum (`squares` their squares': 0/1 rewards
    where not given)."""
    rl = {"flat_groups": flat, "solved_groups": 0.0, "groups_drawn": 4, "dynamic_sampling": False}
    rl |= {"score_n": 4, "score": score, "score_sq": score if squares < 0 else squares, "reward": score / 4}
    rl |= {"verifications": (16, 0, 0)}
    return mon.observe(StepMetrics(step=step, loss=0.0, grad_norm=0.0, rl=rl))


def test_a_starting_policy_that_earns_no_reward_is_said_at_its_first_rollouts():
    """From a 10-step text model on the arithmetic task, held-out pass@1 read 0/64 at step 0 and every group was flat
    at 0; the rule turned dynamic sampling on at step 5 and sampled warmer at 10 and 15, and nothing said the starting
    model had no signal. Now its first rollouts say it, with what it means and the fixes, once."""
    c = cfg()
    mon = NoLearningSignal(c)
    found = first_rollouts(mon, 0.0)  # 16 responses alone: too few to prove it (under 1 in 4 groups with a signal)
    assert found is not None and found.evidence["kind"] == "no_reward" and found.step == 1
    assert found.evidence.items() >= {"groups": 4, "group_size": 4}.items() and "proven" not in found.evidence
    assert "no reward at all" in found.summary and "pass@4 0" in found.summary
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


def test_first_rollouts_that_prove_no_signal_stop_the_run_at_step_1():
    """The same model stopped at step 20, after three windows of remedies (dynamic sampling on, 1.25, 1.5), every
    group flat at 0 throughout. With step 0's held-out pass@1 0/64 besides the first rollouts' 16 responses, under
    1 in 4 groups could have a signal (95%, the rule of three): the stop comes at step 1 (exit 3)."""
    c = cfg()
    mon = NoLearningSignal(c)
    mon.observe_eval(0, 0, 0.0, solved=0, n=64)
    found = first_rollouts(mon, 0.0)
    expected = {"kind": "no_reward", "held_out_solved": 0, "held_out_n": 64, "proven": True}
    assert found.evidence.items() >= expected.items() and found.evidence["signal_bound"] < 0.25
    assert "0/64" in found.summary
    stop = remedy(found, SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=False), c)
    assert (stop.action, stop.params["exit_code"]) == ("stop", 3)
    assert all(word in stop.params["reason"] for word in ("no learning signal", "16 responses", "0/64", "rl.prompts"))


def test_first_rollouts_flat_at_a_partial_credit_are_said_too():
    """Every group flat at a partial credit (a verifier paying for the form, none for the answer) had no first-rollouts
    note: the no-reward one read the score 0 alone. One credit for every response is proven as no reward is."""
    c = cfg()
    groups = NoLearningSignal(c)  # each group one credit, the groups apart: 0.5, 0.5, 0.25, 0.25
    found = first_rollouts(groups, 1.5, squares=0.625)
    assert found.evidence["kind"] == "partial_credit" and "proven" not in found.evidence
    assert "partial credit" in found.summary and "a mean 0.375" in found.summary
    said = remedy(found, SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=False), c)
    assert said.action == "none"
    c.rl_signal.threshold = 0.5  # 16 responses alike bound the share of groups with a signal at 0.56: over 0.5
    assert "proven" not in first_rollouts(NoLearningSignal(c), 2.0, squares=1.0).evidence
    c.rl_signal.threshold = 0.4  # under 0.6: proven, one credit (0.5) for every response
    alike = first_rollouts(NoLearningSignal(c), 2.0, squares=1.0)
    assert alike.evidence["proven"] and "all 0.5" in alike.summary
    stop = remedy(alike, SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=False), c)
    assert stop.action == "stop" and "one partial credit" in stop.params["reason"]


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
