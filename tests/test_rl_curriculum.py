"""The built-in task's difficulty (rl.prompts builtin:arithmetic:DIGITS, rl/curriculum.py) and rule rl_signal's
curriculum: a learned built-in task stopped the run (exit 0, "harder prompts (rl.prompts)"), though its difficulty
was a digit away; now the rule raises it, the problems are drawn again at it, the rules' baselines start again, and a
checkpoint resumes at it. Also: a barren window half solved, half flat at 0 read as a learned task (exit 0), and
rule rl_ratio's "1 steps behind"."""

import json
from types import SimpleNamespace

import pytest

from helpers import trimtab_cli
from test_rl_batches import EOS, CharTokenizer
from test_rl_train import RL
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.config.rl import RLConfig
from trimtab.errors import ConfigError
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.rl_health import NoLearningSignal
from trimtab.orchestrator.rl_remedies import remedy
from trimtab.orchestrator.rl_reward import RewardFall
from trimtab.rl.batches import RolloutLoader
from trimtab.rl.curriculum import set_difficulty
from trimtab.rl.phase import problems_of
from trimtab.rl.rollout import Rollout
from trimtab.rundir import read_decisions


def cfg() -> OrchestratorConfig:
    c = OrchestratorConfig()
    c.rl_signal.window, c.rl_signal.threshold = 2, 0.75
    return c


def steps(mon: NoLearningSignal, first: int, n: int, solved: float, difficulty: int | None = 2, flat: float = 1.0):
    """n steps drawn by dynamic sampling (4 prompts, 3 rounds), every group flat, `solved` of them solved."""
    rl = {"flat_groups": flat, "solved_groups": solved, "groups_drawn": 16, "dynamic_sampling": True}
    rl |= {} if difficulty is None else {"difficulty": difficulty}
    return [mon.observe(StepMetrics(step=s, loss=0.0, grad_norm=0.0, rl=rl)) for s in range(first, first + n)]


SAMPLING = SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=True)


def test_a_learned_builtin_task_is_raised_a_digit_not_stopped_and_a_file_or_the_ceiling_still_stops():
    c = cfg()
    mon = NoLearningSignal(c)
    found = steps(mon, 1, 2, solved=1.0)[-1]
    assert found.evidence["difficulty"] == 2
    harder = remedy(found, SAMPLING, c)
    assert (harder.action, harder.params) == ("set_rl_difficulty", {"digits": 3})
    assert "at 2 digits" in harder.reasoning and "max_difficulty" in harder.reasoning
    # a prompt file (no difficulty in the step's figures) stops as learned, as before
    learned = remedy(steps(NoLearningSignal(c), 1, 2, solved=1.0, difficulty=None)[-1], SAMPLING, c)
    assert (learned.action, learned.params["exit_code"]) == ("stop", 0) and "rl.prompts" in learned.params["reason"]
    # at orchestrator.rl_signal.max_difficulty, too
    top = steps(NoLearningSignal(c), 1, 2, solved=1.0, difficulty=c.rl_signal.max_difficulty)[-1]
    assert remedy(top, SAMPLING, c).action == "stop"


def test_a_new_difficulty_starts_the_windows_again():
    """Steps drawn at the old difficulty are no evidence about the new one: the window fills again."""
    c = cfg()
    mon = NoLearningSignal(c)
    steps(mon, 1, 1, solved=1.0)
    assert steps(mon, 2, 1, solved=0.5, difficulty=3, flat=0.6) == [None]  # the window holds the new step alone
    assert len(mon.window) == 1 and mon.difficulty == 3
    state = mon.state_dict()  # checkpointed with the rest of the monitor
    resumed = NoLearningSignal(c)
    resumed.load_state_dict(state)
    assert resumed.difficulty == 3


def test_a_reward_lower_at_a_harder_difficulty_is_no_fall_but_a_fall_at_one_is():
    """Rule rl_reward's start is the task's: the harder task's lower score is not a fall from the learned one's."""
    made = OrchestratorConfig()
    made.rl_reward.start_steps = made.rl_reward.window = 3

    def step(i: int, score: float, digits: int) -> StepMetrics:
        rl = {"score_n": 8, "score": 8 * score, "score_sq": 8 * score * score, "reward": score, "difficulty": digits}
        rl |= {"verifications": (64, 0, 0), "temperature": 1.0, "staleness": 0.0, "overlong_buffer": 0}
        return StepMetrics(step=i, loss=0.0, grad_norm=1.0, rl=rl)

    harder = RewardFall(made)
    run = [step(1, 0.9, 2)] + [step(i, 0.9, 2) for i in range(2, 5)] + [step(i, 0.2, 3) for i in range(5, 12)]
    assert [harder.observe(m) for m in run] == [None] * len(run)
    same = RewardFall(made)
    run = [step(1, 0.9, 2)] + [step(i, 0.9, 2) for i in range(2, 5)] + [step(i, 0.2, 2) for i in range(5, 12)]
    assert any(same.observe(m) is not None for m in run)


def half_solved_window(c: OrchestratorConfig) -> Finding:
    return steps(NoLearningSignal(c), 1, 2, solved=0.5)[-1]


def test_a_barren_window_half_solved_half_at_zero_is_not_a_learned_task():
    """Half the groups at the full reward, half flat at 0, dynamic sampling drawing 4x: it stopped with exit 0, "the
    task is learned ... harder prompts", which the stuck half needs least. It walks the stuck groups' ladder now: warmer
    sampling, then at the ceiling the stop (exit 3) naming both halves and the no-signal fixes."""
    c = cfg()
    found = half_solved_window(c)
    warmer = remedy(found, SAMPLING, c)
    assert (warmer.action, warmer.params) == ("set_rl_temperature", {"value": 1.25})
    ceiling = SimpleNamespace(rl_temperature=c.rl_signal.max_temperature, rl_dynamic_sampling=True)
    stop = remedy(found, ceiling, c)
    assert (stop.action, stop.params["exit_code"]) == ("stop", 3)
    reason = stop.params["reason"]
    assert "50% of the groups solved" in reason and "partly learned" in reason and "train.init_from" in reason
    assert "task is learned" not in reason


def test_mostly_solved_with_a_few_stuck_is_still_learned():
    c = cfg()
    found = steps(NoLearningSignal(c), 1, 2, solved=0.8, difficulty=None)[-1]
    assert remedy(found, SAMPLING, c).params["exit_code"] == 0


def test_rl_ratio_says_one_step_not_one_steps():
    c = OrchestratorConfig()
    f = Finding(rule="rl_ratio", family="rl", step=9, summary="", evidence={}, strength=1.0)
    words = remedy(f, SimpleNamespace(rl_max_staleness=1), c).reasoning
    assert "up to 1 step behind" in words and "(1 -> 0 steps behind)" in words and "1 steps" not in words


def test_a_malformed_difficulty_is_told_at_the_config_naming_the_key():
    with pytest.raises(ConfigError, match=r"rl\.prompts.*builtin:arithmetic:3"):
        RLConfig(prompts="builtin:arithmetic:two").validate()
    RLConfig(prompts="builtin:arithmetic:3").validate()


def policy(prompts: list[list[int]], seed: int | None) -> list[Rollout]:
    return [Rollout(prompt, [ord("1"), EOS], [-0.5, -0.25], truncated=False) for prompt in prompts]


def loader(prompts: str = "builtin:arithmetic:1") -> RolloutLoader:
    rl = RLConfig(prompts=prompts, group_size=2, prompts_per_step=2, verifier_workers=1, held_out=4)
    run = SimpleNamespace(rl=rl, train=SimpleNamespace(seed=0))
    train, held = problems_of(run)
    made = RolloutLoader(train, CharTokenizer(), rl, 0, seed=0, max_prompt_tokens=4, held_out=held)
    made.policy = policy
    return made


def test_the_difficulty_draws_harder_problems_and_a_checkpoint_resumes_at_it():
    ours = loader()
    try:
        held = list(ours.held_out)
        assert ours.difficulty == 1 and ours.next_batch().difficulty == 1
        said = set_difficulty(ours, 2, max_seq_len=64)
        assert "1 -> 2 digits" in said and ours.difficulty == 2 and ours.held_out == held  # held-out unchanged
        assert any(len(p.prompt) > 4 for p in ours.problems)  # two-digit operands
        assert ours.micro_batch_tokens == ours.batch_tokens  # auto: the whole step, of the longer prompts
        batch = ours.next_batch()
        assert batch.difficulty == 2 and batch.health["difficulty"] == 2
        assert ours.metrics()["rl/difficulty"] == 2.0
        state = ours.state_dict()
        following = [ours.problems[ours.order.next()].prompt for _ in range(5)]
    finally:
        ours.close()
    resumed = loader()  # configured at 1 digit: the checkpoint's difficulty wins, its order exactly
    try:
        resumed.load_state_dict(state)
        assert resumed.difficulty == 2
        assert [resumed.problems[resumed.order.next()].prompt for _ in range(5)] == following
    finally:
        resumed.close()


def test_a_difficulty_whose_prompts_do_not_fit_or_a_file_task_is_refused(tmp_path):
    ours = loader()
    try:
        with pytest.raises(ConfigError, match=r"model\.max_seq_len=10"):
            set_difficulty(ours, 5, max_seq_len=10)  # "12345+67890=" is 12 tokens
        assert ours.difficulty == 1
    finally:
        ours.close()
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}", "answer": "1"}}\n' for i in range(20)))
    filed = loader(str(path))
    try:
        assert filed.difficulty == 0
        with pytest.raises(ConfigError, match="is a file"):
            set_difficulty(filed, 3)
    finally:
        filed.close()


@pytest.mark.slow  # a CLI run of 12 steps, 4x the prompts drawn (~40 s on loaded cores)
def test_trimtab_rl_raises_a_learned_builtin_task_then_stops_at_the_ceiling(tmp_path, debug_run):
    """Through the CLI, every response right (format:.*): learned at 2 digits, raised to 3 (in the metrics and the
    checkpoint), learned again at the ceiling, stopped with exit 0. It stopped at the first window before."""
    out = tmp_path / "rl"
    args = ["rl", *RL, "--out", str(out), "--max-steps", "12", "--set", f"train.init_from={debug_run}"]
    args += ["--set", "rl.reward=format:.*", "--set", "orchestrator.rl_signal.window=2"]
    args += ["--set", "orchestrator.rl_signal.max_difficulty=3", "--set", "rl.held_out=0"]
    done = trimtab_cli(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    signal = [d for d in read_decisions(out) if d["rule"] == "rl_signal"]
    assert [d["action"] for d in signal] == ["set_dynamic_sampling", "set_rl_difficulty", "stop"]
    assert signal[1]["params"] == {"digits": 3} and signal[1]["evidence"]["difficulty"] == 2
    assert "3 digits, orchestrator.rl_signal.max_difficulty" in signal[2]["params"]["reason"]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "rl/reward" in line]
    assert logged[0]["rl/difficulty"] == 2 and logged[-1]["rl/difficulty"] == 3
    last = sorted((out / "checkpoints").glob("step_*"))[-1]
    assert '"difficulty": 3' in "".join(p.read_text() for p in last.glob("*.json"))
