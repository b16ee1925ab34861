"""Verifiers for tests/test_rl_rewards.py (python:rl_verifiers:NAME), imported by the pool's
worker processes: no torch, so a worker starts in a blink."""

import os
import time


def flaky(response: str, answer: str) -> float:
    """Hangs on 'hang', raises on 'raise', kills its own process on 'crash'; else exact."""
    if response == "hang":
        time.sleep(600)
    if response == "raise":
        raise ValueError("cannot read this answer")
    if response == "crash":
        os._exit(3)
    return float(response == answer)


def not_a_number(response: str, answer: str):
    """What a verifier returns by mistake: NaN, an infinity, text; a number otherwise."""
    return {"nan": float("nan"), "inf": float("inf"), "text": "1", "none": None, "huge": 1e300}.get(response, 1.0)


def hang_once(response: str, answer: str) -> float:
    """Hangs the first time it sees a response (a marker file per response), then answers."""
    marker = os.path.join(answer, response)
    if not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(600)
    return 1.0


def crash_once(response: str, answer: str) -> float:
    """Kills its own process the first time it sees a response (a marker file per response, as
    hang_once), then answers: a crash that does not recur (the OOM killer, a flaky native call)."""
    marker = os.path.join(answer, response)
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)
    return 1.0


def starts_with_space(response: str, answer: str) -> float:
    """1 when the response begins with a space: about half a small model's first tokens do, so
    groups differ and the policy can learn to (tests/test_rl_train.py)."""
    return float(response.startswith(" "))


def nothing(response: str, answer: str) -> float:
    """0 for every response: every group earns one reward, the signal is gone (rule rl_signal)."""
    return 0.0


def slow(response: str, answer: str) -> float:
    """starts_with_space after 0.25 s: sound, but slower than a tight timeout (rule rl_verifier)."""
    time.sleep(0.25)
    return starts_with_space(response, answer)


def half_credit(response: str, answer: str) -> float:
    """0.5 for a response that starts with a space, 1 when a digit follows the space: at a high
    learning rate the policy settles on the half it finds first and stops exploring (rl_entropy)."""
    spaced = response.startswith(" ")
    return 0.5 * spaced + 0.5 * (spaced and response[1:2].isdigit())


def longer(response: str, answer: str) -> float:
    """The longer the better (characters, up to 40): a reward that teaches a policy to run on
    past its answer into the length budget (rule rl_length)."""
    return min(len(response), 40) / 40


def no_space(response: str, answer: str) -> float:
    """starts_with_space's opposite: as the held-out verifier (rl.held_out_reward) of a run
    trained on starts_with_space, the training reward rises as the held-out one falls, the sign
    of reward hacking (rule rl_hacking)."""
    return 1.0 - starts_with_space(response, answer)


def broken(response: str, answer: str) -> float:
    """A verifier with a bug every call meets (a key its problems do not have): rule rl_verifier's
    errors, every response scored 0."""
    return float(response == {"expected": answer}["answer"])
