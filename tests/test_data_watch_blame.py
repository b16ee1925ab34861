"""The data watch (orchestrator/attribution.py) blames a watched step as a lone spike's: only when
one of its rows stands above the rows rule's bar, then its rows are judged by the usual one."""

from __future__ import annotations

import random

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.attribution import DataAttribution
from trimtab.orchestrator.monitors import StepMetrics


class View:
    """One source; `held` the held-out rows' losses (by default 64 around 5.14 nats, spread 0.14, as
    debug's at step 22), `scores` the training rows'."""

    def __init__(self, scores: dict[int, float], held: list[float] | None = None):
        rng = random.Random(0)
        self.scores, self.held = scores, held or [rng.gauss(5.14, 0.14) for _ in range(64)]

    def row_losses(self, rows):
        return {r: self.scores[r] for r in rows}

    def row_parts(self, rows):
        return None

    def row_sources(self, rows):
        return {"stdlib/test/test_quopri.py": len(rows)}

    def held_out_row_losses(self, limit, part=None):
        return self.held[:limit]


def test_a_clean_hard_row_in_a_watched_step_is_not_left_out_but_a_garbage_steps_rows_are():
    """debug, bad_batch@20, seed 1 (and debug-moe): two steps after the garbage batch was left out, a
    clean test_quopri.py row of quoted-printable text scored 1.25 nats above the held-out median
    (8.5 spreads, over the 0.5-nat floor) among 31 ordinary rows, and the watch left it out for good.
    A step holding garbage (2.3 nats out, as step 20's rows scored) is still blamed, and then its
    rows above the usual bar go with it, one 1.0 nat out too."""
    rng = random.Random(1)
    scores = {r: rng.gauss(4.95, 0.15) for r in range(100, 131)} | {131: 5.14 + 1.25}  # step 22: clean + hard
    garbage = [200, 204, 208, 212, 216, 220, 224]
    scores |= {r: rng.gauss(4.95, 0.15) for r in range(200, 232) if r not in garbage}
    scores |= dict.fromkeys(garbage[:-1], 7.45) | {garbage[-1]: 5.14 + 1.0}  # step 23: a quarter garbage
    watch, view = DataAttribution(OrchestratorConfig()), View(scores)
    watch.record(20, list(range(32)))
    watch.watch_more()  # step 20's rows were left out: steps 21-30 watched
    watch.record(22, list(range(100, 132)))
    assert watch.watch(view, StepMetrics(step=22, loss=5.0, grad_norm=1.0, rows=list(range(100, 132)))) is None
    watch.record(23, list(range(200, 232)))
    found = watch.watch(view, StepMetrics(step=23, loss=5.5, grad_norm=1.0, rows=list(range(200, 232))))
    assert found is not None and found.evidence["rows"] == garbage
    assert found.evidence["gate"] > 5.14 + 1.4 > found.evidence["threshold"]  # blamed at 1.5 nats, judged at 0.5
