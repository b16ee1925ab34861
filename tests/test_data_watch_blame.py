"""The data watch (orchestrator/attribution.py) blames a watched step as a lone spike's: only when
one of its rows stands above the rows rule's bar, then its rows are judged by the usual one."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.attribution import DataAttribution
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.training.control import Control
from trimtab.training.view import RunView


class View:
    """One source; `held` the held-out rows' losses (by default 64 around 5.14 nats, spread 0.14, as
    debug's at step 22), `scores` the training rows', `repeats` those a handful of tokens repeated."""

    def __init__(
        self, scores: dict[int, float], held: list[float] | None = None, repeats: dict[int, float] | None = None
    ):
        rng = random.Random(0)
        self.scores, self.held = scores, held or [rng.gauss(5.14, 0.14) for _ in range(64)]
        self.repeats = repeats or {}  # rows a handful of tokens repeated, and their share (RunView.row_repeats)

    def row_losses(self, rows):
        return {r: self.scores[r] for r in rows}

    def row_parts(self, rows):
        return None

    def row_sources(self, rows):
        return {"stdlib/test/test_quopri.py": len(rows)}

    def held_out_row_losses(self, limit, part=None):
        return self.held[:limit]

    def row_repeats(self, rows):
        return {r: self.repeats[r] for r in rows if r in self.repeats}


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
    assert watch.watch(view, StepMetrics(step=22, loss=5.0, grad_norm=1.0, rows=list(range(100, 132))), 21) is None
    watch.record(23, list(range(200, 232)))
    found = watch.watch(view, StepMetrics(step=23, loss=5.5, grad_norm=1.0, rows=list(range(200, 232))), 22)
    assert found is not None and found.evidence["rows"] == garbage
    assert found.evidence["gate"] > 5.14 + 1.4 > found.evidence["threshold"]  # blamed at 1.5 nats, judged at 0.5


def test_a_clean_row_of_one_character_run_is_kept_beside_the_garbage_of_its_step():
    """debug, bad_rows@20, seed 1: at step 22 a clean test_quopri.py row, 37 of its 64 targets one "zzzz" token
    (0.64 of them its 4 commonest: RunView.row_repeats), scored 0.94 nats over the held-out median, over the
    0.74-nat bar, and was left out for good beside the step's 7 garbage rows (1.8-2.3 nats out). On debug-moe
    it read 1.51 (1.66 on another machine), over the 1.5-nat bar that blames a step: a step of it alone is not
    blamed either. Kept, and named."""
    rng = random.Random(2)
    garbage = [340, 508, 1396, 1688, 1800, 2004, 2052]
    rows = sorted({*garbage, 517, *range(2600, 2624)})
    scores = {r: rng.gauss(5.14, 0.14) for r in rows} | dict.fromkeys(garbage, 5.14 + 2.0) | {517: 5.14 + 0.94}
    view = View(scores, repeats={517: 0.64})
    watch = DataAttribution(OrchestratorConfig())
    watch.record(20, list(range(32)))
    watch.watch_more()
    found = watch.watch(view, StepMetrics(step=22, loss=5.5, grad_norm=1.0, rows=rows), 21)
    assert found is not None and found.evidence["rows"] == garbage
    assert found.evidence["kept_repeats"] == {"517": {"loss": 5.14 + 0.94, "repeat_share": 0.64}}
    alone = {r: rng.gauss(5.14, 0.14) for r in range(3000, 3031)} | {517: 5.14 + 1.66}
    step = StepMetrics(step=23, loss=5.2, grad_norm=1.0, rows=list(alone))
    assert watch.watch(View(alone, repeats={517: 0.64}), step, 22) is None


def test_the_run_view_reads_which_rows_are_a_handful_of_tokens_repeated_from_their_targets():
    """RunView.row_repeats: a row's trained targets (its mask's, the first token no target) only; {} with no rows."""
    rng = random.Random(0)
    quopri = [9] + [430] * 37 + [12] * 2 + list(range(100, 125))  # 65 tokens: 64 targets, 0.64 in its 4 commonest
    masked = [9] + [7] * 40 + [rng.randrange(512) for _ in range(40)]  # the run is a prompt's: not trained on
    rows = {
        0: (np.array(quopri), np.ones(len(quopri), dtype=bool)),
        1: (np.array([rng.randrange(512) for _ in range(65)]), np.ones(65, dtype=bool)),
        2: (np.array(masked), np.array([True] + [False] * 40 + [True] * 40)),
    }
    phase = SimpleNamespace(train_rows=SimpleNamespace(get=rows.__getitem__))
    trainer = SimpleNamespace(phases=[phase, SimpleNamespace(train_rows=None)], state=SimpleNamespace(phase=0))
    view = RunView(trainer, Control(trainer))
    assert view.row_repeats([0, 1, 2]) == {0: 41 / 64}
    trainer.state.phase = 1  # an RL or DPO phase
    assert view.row_repeats([0]) == {}
