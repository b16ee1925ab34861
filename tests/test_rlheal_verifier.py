"""A user's verifier meeting real faults (rl.reward python:MODULE:FUNCTION): one that hangs on
some responses, and one the `trimtab` command cannot import from the working directory."""

from types import SimpleNamespace

import pytest

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.errors import ConfigError
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.rl_remedies import remedy
from trimtab.orchestrator.rl_verifier import VerifierFailures
from trimtab.rl.rewards import VerifierPool, verifier
from trimtab.rl.step import RolloutBatch


def _step(step: int, counts: tuple[int, int, int], slowest: float) -> StepMetrics:
    sums = dict.fromkeys(("groups", "flat", "solved", "reward", "rollouts", "entropy", "truncated", "tokens"), 1.0)
    sums |= {"verified": counts[0], "failures": counts[1], "timeouts": counts[2]}
    health = RolloutBatch(
        [], 0, 0, [], sums=sums, slowest=slowest
    ).health  # the loader's figures, as the trainer hands them on
    return StepMetrics(step=step, loss=0.0, grad_norm=1.0, overflow=False, tokens_per_s=1.0, lr=1e-4, rl=health)


def _found(slowest: float, counts: tuple[int, int, int] = (16, 2, 2)):
    cfg = OrchestratorConfig()
    mon = VerifierFailures(cfg)
    found = [mon.observe(_step(i + 1, counts, slowest)) for i in range(cfg.rl_verifier.window)]
    assert found[-1] is not None
    return found[-1], cfg


def test_a_verifier_that_hangs_on_some_responses_keeps_its_limit():
    """Timeouts while every verification that finished took milliseconds are hangs: the rule
    doubled the limit to 120 s, and each hang then cost that (30 steps: 10 s clean, 259 s)."""
    found, cfg = _found(slowest=0.006)
    assert found.evidence["slowest_s"] == 0.006
    kept = remedy(found, SimpleNamespace(rl_verifier_timeout=0.5), cfg)
    assert kept.action == "none" and "hang" in kept.reasoning and "0.006 s" in kept.reasoning


def test_a_slow_verifier_still_gets_longer():
    """Verdicts up to near the limit (a slow check), or none at all (0.25 s under 0.1 s): longer."""
    found, cfg = _found(slowest=0.4)
    raised = remedy(found, SimpleNamespace(rl_verifier_timeout=0.5), cfg)
    assert (raised.action, raised.params) == ("set_verifier_timeout", {"value": 1.0})
    found, cfg = _found(slowest=0.0, counts=(16, 16, 16))  # none finished: no evidence of speed
    assert "slowest_s" not in found.evidence
    assert remedy(found, SimpleNamespace(rl_verifier_timeout=0.1), cfg).action == "set_verifier_timeout"


def test_the_pool_measures_its_longest_verdict():
    pool = VerifierPool("python:rl_verifiers:flaky", workers=1, timeout_s=0.5, retries=0)
    try:
        scored = pool.score(["1", "hang", "2"], ["1", "1", "2"])
    finally:
        pool.close()
    assert scored.rewards == [1.0, 0.0, 1.0] and [e["kind"] for e in scored.events] == ["timeout"]
    assert 0 < scored.slowest < 0.25  # the hang's 0.5 s is not a verdict's time


def test_a_verifier_file_in_the_working_directory_names_the_fix(tmp_path, monkeypatch):
    """`trimtab rl --set rl.reward=python:myreward:score` beside myreward.py said only
    "No module named 'myreward'": the command's import path has no working directory."""
    (tmp_path / "myreward.py").write_text("def score(response, answer):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    with pytest.raises(ConfigError, match=r"rl.reward 'python:myreward:score': .*myreward.py .* PYTHONPATH=\."):
        verifier("python:myreward:score")
    with pytest.raises(ConfigError, match=r"no module named absent_module .* PYTHONPATH"):
        verifier("python:absent_module:score")


def test_a_response_the_verifier_failed_on_has_no_advantage(caplog):
    """A verifier that raises on a response scored it 0: with a right answer beside it, the
    failed one was trained as wrong (advantage < 0). Now it has no advantage, the log names the
    prompt it answered, and the others keep their sign."""
    from trimtab.config.rl import RLConfig
    from trimtab.rl.batches import RolloutLoader
    from trimtab.rl.rollout import Rollout
    from trimtab.rl.tasks import Problem

    class Chars:
        eos_id = pad_id = 0
        encode = staticmethod(lambda text, specials=False: [ord(c) for c in text])
        decode = staticmethod(lambda ids: "".join(map(chr, ids)))

    def scripted(prompts, seed):  # flaky's verdicts: right, raises, wrong, wrong
        texts = [t for _ in range(len(prompts) // 4) for t in ("1", "raise", "2", "2")]
        return [Rollout(p, [ord(c) for c in t] + [0], [-0.5] * (len(t) + 1), False) for p, t in zip(prompts, texts)]

    cfg = RLConfig(group_size=4, prompts_per_step=1, reward="python:rl_verifiers:flaky", verifier_workers=1)
    ours = RolloutLoader([Problem("q1", "1", "tasks.jsonl:7")], Chars(), cfg, 0, seed=0, max_prompt_tokens=2)
    ours.policy = scripted
    try:
        batch = ours.next_batch()
    finally:
        ours.close()
    assert batch.rewards[1] == pytest.approx(1 / 3) and batch.advantage[1] == pytest.approx(0, abs=1e-6)
    assert batch.advantage[0] > 0 > batch.advantage[2] == batch.advantage[3]
    assert batch.sums["failures"] == 1
    assert "prompt 'q1' (tasks.jsonl:7)" in caplog.text and "cannot read this answer" in caplog.text


def test_the_longest_verdict_of_a_step_is_the_longest_of_the_ranks_not_their_sum():
    """Each rank's longest verdict was summed over the data-parallel ranks: two ranks whose
    verifications took 0.25 s read as 0.5 s, a verifier twice as slow (8 ranks: 8x) to rule
    rl_verifier, which tells hangs from a slow check by it. Two ranks simulated in threads."""
    import threading

    from trimtab.config.rl import RLConfig
    from trimtab.rl.batches import RolloutLoader
    from trimtab.rl.rollout import Rollout
    from trimtab.rl.tasks import Problem

    class Chars:
        eos_id = pad_id = 0
        encode = staticmethod(lambda text, specials=False: [ord(c) for c in text])
        decode = staticmethod(lambda ids: "".join(map(chr, ids)))

    barrier, sent = threading.Barrier(2), [[], []]

    def all_sum(rank: int, values: list[float]) -> list[float]:  # as the trainer's all-reduce over 2 ranks
        sent[rank] = values
        barrier.wait()
        summed = [a + b for a, b in zip(*sent)]
        barrier.wait()
        return summed

    def scripted(prompts, seed):
        return [Rollout(p, [ord(" "), 0], [-0.5, -0.5], False) for p in prompts]

    cfg = RLConfig(group_size=2, prompts_per_step=2, reward="python:rl_verifiers:slow", verifier_workers=1)
    problems = [Problem(f"q{i}", "1") for i in range(4)]
    loaders = [RolloutLoader(problems, Chars(), cfg, 0, 0, 2, None, rank, 2) for rank in (0, 1)]
    batches = [None, None]

    def step(rank: int) -> None:
        loaders[rank].policy, loaders[rank].all_sum = scripted, lambda values: all_sum(rank, values)
        batches[rank] = loaders[rank].next_batch()

    threads = [threading.Thread(target=step, args=(r,)) for r in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        for made in loaders:
            made.close()
    assert batches[0].sums["verified"] == 4  # both ranks' responses counted
    assert batches[0].slowest == batches[1].slowest  # the same on every rank
    assert 0.25 <= batches[0].slowest < 0.45, batches[0].slowest  # one verification's 0.25 s, not two ranks' 0.5
