"""Verifiable rewards (rl/rewards.py): the built-in verifiers, and the pool that kills a hung
verification with its process, says it, and goes on."""

import time

import pytest

from trimtab.errors import ConfigError
from trimtab.rl.rewards import VerifierPool, final_answer, verifier


def test_the_final_answer_is_the_last_boxed_then_after_hashes_then_the_last_line():
    assert final_answer(r"so \boxed{1} no, \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert final_answer("work\n#### 42 ") == "42"
    assert final_answer("first\n  the end  \n\n") == "the end"
    assert final_answer("") == ""


def test_the_built_in_verifiers():
    assert verifier("exact")(r"it is \boxed{ 4 2 }", "42") == 1.0
    assert verifier("exact")("#### 41", "42") == 0.0
    assert verifier(r"regex:answer: (-?\d+)")("so answer: 17.", "17") == 1.0
    assert verifier(r"regex:answer: (-?\d+)")("no answer", "17") == 0.0
    assert verifier(r"format:<think>.*</think>\s*\d+")("<think>a\nb</think> 7", "") == 1.0
    assert verifier(r"format:<think>.*</think>\s*\d+")("7", "") == 0.0
    math = verifier("math")
    assert math(r"The answer is $\boxed{\frac{1}{2}}$", "0.5") == 1.0
    assert math(r"The answer is $\boxed{\frac{1}{3}}$", "0.5") == 0.0
    assert verifier("python:rl_verifiers:flaky")("a", "a") == 1.0


def test_a_format_reward_matches_the_response_as_generated():
    """Its whitespace is part of the form (docs/rl.md: the whole response): stripped, a response
    with a stray leading space or trailing line earned the format anyway, and a format asking for
    a leading space (the built-in task's answers follow one: `12+34= 46`) could never be earned."""
    assert verifier(r"format: \d+")(" 46", "") == 1.0
    assert verifier(r"format:<think>.*</think>\n\d+")("<think>a</think>\n7", "") == 1.0
    assert verifier(r"format:<think>.*</think>\n\d+")("<think>a</think>\n7\n", "") == 0.0
    assert verifier(r"format:<think>.*</think>")(" <think>a</think>", "") == 0.0
    assert verifier(r"format:\s*<think>.*</think>\s*")(" <think>a</think>\n", "") == 1.0  # allowed: said so


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("nope", "names no verifier: use math, exact"),
        ("exact:x", "names no verifier"),
        ("regex:(", "rl.reward 'regex:\\(':"),
        ("python:no_such_module_here:f", "no_such_module_here"),
        ("python:rl_verifiers:missing", "missing"),
    ],
)
def test_a_bad_spec_is_told_with_the_key(spec, says):
    with pytest.raises(ConfigError, match=says):
        verifier(spec)


def test_a_verifier_module_that_fails_to_import_is_told_with_the_key(tmp_path, monkeypatch):
    """Its own error at import (a syntax error, a failing statement) was a traceback."""
    (tmp_path / "broken_syntax.py").write_text("def f(x)\n    return 1\n")
    (tmp_path / "broken_statement.py").write_text("raise ValueError('no database')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"rl.reward 'python:broken_syntax:f': importing broken_syntax failed"):
        verifier("python:broken_syntax:f")
    with pytest.raises(ConfigError, match=r"importing broken_statement failed: ValueError: no database"):
        verifier("python:broken_statement:f")


def test_a_verifier_timeout_past_a_day_is_refused():
    """inf (or 1e10) overflowed the wait on the verifier processes mid-run."""
    from trimtab.config import load_config

    with pytest.raises(ConfigError, match=r"rl.verifier_timeout_s' must be in \(0, 86400\] seconds"):
        load_config(preset="debug", sets=["rl.verifier_timeout_s=inf"])


def test_a_hung_verification_is_killed_at_its_limit_and_the_rest_are_scored():
    """Four answers, one verification that never ends, one that raises, one that kills its own
    process: the rewards of the others are exact; each failure is 0 and said; the hung one is
    killed at the limit (once: a hang is not tried again), not waited for."""
    pool = VerifierPool("python:rl_verifiers:flaky", workers=2, timeout_s=1.0, retries=1)
    try:
        started = time.monotonic()
        scored = pool.score(["a", "hang", "b", "raise", "crash", "c"], ["a", "x", "x", "x", "x", "c"])
        took = time.monotonic() - started
        assert scored.rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        said = {e["index"]: (e["kind"], e["detail"]) for e in scored.events}
        assert said[1] == ("timeout", "no verdict within 1 s") and said[3][0] == "error" and "cannot read" in said[3][1]
        assert said[4] == ("died", "the verifier's process died") and set(said) == {1, 3, 4}
        assert took < 8, took  # one try of 1 s for the hung one, beside the others
        assert pool.score(["a"], ["a"]).rewards == [1.0]  # the pool goes on with fresh workers
    finally:
        pool.close()


def test_a_reward_that_is_no_finite_number_is_the_verifiers_error_not_a_nan_in_training():
    """A verifier returning NaN made every advantage of its group NaN: each step's loss was NaN
    and the orchestrator skipped, cut the LR and rolled back a sound model. Such a return, an
    infinity or text, is the verifier's error now: reward 0, said (rule rl_verifier's evidence)."""
    pool = VerifierPool("python:rl_verifiers:not_a_number", workers=1, timeout_s=5.0, retries=0)
    try:
        scored = pool.score(["nan", "inf", "text", "none", "huge", "fine"], [""] * 6)
    finally:
        pool.close()
    assert scored.rewards == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert scored.events[-1]["detail"] == "ValueError: the verifier returned 1e+300, beyond the +-1e+06 a reward may be"
    said = {e["index"]: (e["kind"], e["detail"]) for e in scored.events}
    assert said[0] == ("error", "ValueError: the verifier returned nan, not a finite number")
    assert said[1] == ("error", "ValueError: the verifier returned inf, not a finite number")
    assert said[2] == ("error", "TypeError: the verifier returned str '1', not a number")
    assert said[3][0] == "error" and "returned None" in said[3][1] and set(said) == {0, 1, 2, 3, 4}


def test_verifications_queued_behind_a_hung_one_are_scored_and_not_counted_against_it():
    """A worker holds several jobs at once (rewards.PIPELINE): the ones waiting behind a hung
    verification go to a fresh worker, untried; with no retry, only the hung one is lost."""
    pool = VerifierPool("python:rl_verifiers:flaky", workers=1, timeout_s=0.5, retries=0)
    try:
        scored = pool.score(["a", "hang", "b", "c", "d"], ["a", "x", "b", "c", "x"])
    finally:
        pool.close()
    assert scored.rewards == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert [(e["index"], e["kind"]) for e in scored.events] == [(1, "timeout")]


def test_a_verification_that_hung_is_not_tried_again_one_whose_process_died_is(tmp_path):
    """A hang was retried rl.verifier_retries times, each waiting the full limit, though the same
    (response, answer) hangs again (a step with one hang under a 2 s limit: 4.5 s, 2.2 s now). A
    process that died (the OOM killer) may not die again: tried again."""
    (tmp_path / "hang").mkdir()
    (tmp_path / "crash").mkdir()
    pool = VerifierPool("python:rl_verifiers:hang_once", workers=1, timeout_s=0.5, retries=1)
    try:
        hung = pool.score(["r1"], [str(tmp_path / "hang")])
    finally:
        pool.close()
    assert hung.rewards == [0.0] and [e["kind"] for e in hung.events] == ["timeout"]
    pool = VerifierPool("python:rl_verifiers:crash_once", workers=1, timeout_s=5.0, retries=1)
    try:
        died = pool.score(["r1", "r2"], [str(tmp_path / "crash")] * 2)
    finally:
        pool.close()
    assert died.rewards == [1.0, 1.0] and died.events == []


def test_a_worker_that_died_idle_is_replaced_before_its_next_job_and_charges_it_no_try():
    """A worker killed between steps (the OOM killer) was only found dead at the next job's read:
    that job was charged a try it never had (with no retry: a reward of 0 and a `died` event)."""
    pool = VerifierPool("exact", workers=1, timeout_s=5.0, retries=0)
    try:
        dead = pool._workers[0].process
        dead.kill()
        dead.wait()
        scored = pool.score([r"\boxed{4}", r"\boxed{5}"], ["4", "5"])
        assert pool._workers[0].process is not dead
    finally:
        pool.close()
    assert scored.rewards == [1.0, 1.0] and scored.events == []
