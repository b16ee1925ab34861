"""Decisions' reasoning states the thresholds it judged by in the units they are in (mix2's scenarios)."""

from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.too_high import _too_high_why


def test_unigram_stall_margin_is_a_share_not_nats():
    # debug-moe at 3x its LR (optim.lr=0.009): the loss stalled at 5.044, 0.21 nats under the data's
    # unigram entropy 5.258, and the decision said "within 0.05 of the 5.258": the margin is 5% of it
    evidence = {"level": 5.044, "window": 10, "unigram": 5.258, "unigram_margin": 0.05, "since": 1, "loss": 4.99}
    f = Finding(rule="above_start", family="instability", step=35, evidence=evidence, summary="", strength=1.0)
    why = _too_high_why(f, 0.316)
    assert "within 5% of the 5.258" in why
    assert "within 0.05 of" not in why
