"""A verifier for bench/rl.py's random-reward control (python:_rl_verifiers:random_reward): the
pool's workers import it from bench/, which rl.py puts on their path."""

import hashlib


def random_reward(response: str, answer: str) -> float:
    """1 for a fixed pseudo-random 15% of (response, answer) pairs, whatever their correctness:
    as often as the warm start is right, uncorrelated with being right."""
    digest = hashlib.sha256(f"{answer}|{response.strip()}".encode()).digest()
    return float(digest[0] < 0.15 * 256)
