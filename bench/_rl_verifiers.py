"""A verifier for bench/rl.py's random-reward control (python:_rl_verifiers:random_reward): the
pool's workers import it from bench/, which rl.py puts on their path."""

import hashlib


def random_reward(response: str, answer: str) -> float:
    """1 for a fixed pseudo-random 15% of (response, answer) pairs, whatever their correctness:
    as often as the warm start is right, uncorrelated with being right."""
    digest = hashlib.sha256(f"{answer}|{response.strip()}".encode()).digest()
    return float(digest[0] < 0.15 * 256)


def leading_space(response: str, answer: str) -> float:
    """1 when the response begins with a space: about half a small model's first tokens do, so
    groups differ and the policy learns it in a few steps (bench/rl_healing.py's task)."""
    return float(response.startswith(" "))


def slow_leading_space(response: str, answer: str) -> float:
    """leading_space after 0.25 s: sound, but slower than rl_healing's tight verifier timeout."""
    import time

    time.sleep(0.25)
    return leading_space(response, answer)
