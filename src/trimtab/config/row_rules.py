"""The orchestrator's rules on bad rows (orchestrator.data: a bad stretch's rows scored one by one,
orchestrator/attribution.py; orchestrator.rows: outlier rows, orchestrator/outliers.py;
orchestrator.row_gate: rows left out inside a step, training/row_gate.py), and their checks. Apart
from config/orchestrator.py (OrchestratorConfig holds them) so that each module stays one family of rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trimtab.config.checks import Section, _check, _positive

if TYPE_CHECKING:
    from trimtab.config.orchestrator import OrchestratorConfig


# rows a source's own reference needs in the data watch (orchestrator/attribution.py): the MAD of fewer is
# noise (a small source's eval split holds a row or two; a rare source has a few rows a step); with fewer,
# the next fallback (_bars). Here, not there: training/setup.py says it, and training never imports the orchestrator
MIN_OWN = 8


@dataclass
class DataRule(Section):
    """Data attribution: when a bad stretch is the data's, the rows of its flagged steps are scored
    one by one on the current weights and a row is left out when its loss is above the held-out
    rows' median (scored alike) by max(sigma x their spread, min_gap); the spread is the median
    absolute deviation x 1.4826, a standard deviation robust to the outliers being sought."""

    sigma: float = 4.0
    min_gap: float = 0.5  # nats
    reference_rows: int = 64  # held-out rows scored for the reference
    watch_steps: int = 10  # after rows were left out, each next step's rows are scored this long


@dataclass
class RowsRule(Section):
    """Outlier rows (thinly spread bad data; orchestrator/outliers.py): every step's rows, as the
    training forward scored them, against the last `window` rows of their mixture source (data.mix:
    each source its own reference, outliers.py says why): an outlier is above their
    median by max(sigma x their spread, min_gap). It is named (and in auto mode left out) when
    it is an outlier again `confirm_after` steps later, scored on the then weights, or on its next
    sighting, or at once by `certain_gap` nats."""

    enabled: bool = True
    window: int = 512  # training rows: the reference
    min_reference: int = 128  # rows seen before any is judged
    min_targets: int = 32  # a row's mean over fewer is noise (a document's first line): not judged
    sigma: float = 4.0
    min_gap: float = 1.5  # nats
    # nats above the median that name a row at its first sighting: garbage of whole tokens scores
    # ~ln(vocab) or more (6.2 at the debug presets' 512 tokens, 10.4 at 32K) where text sits at
    # 2-5; the debug corpus's own hardest file (quoted-printable test data) reached 2.4 above the
    # median on debug and 3.1 on debug-moe before the model had seen it
    certain_gap: float = 4.0
    max_suspects: int = 100_000  # rows remembered from their first sighting
    # steps after a suspect's first sighting when it is scored again on the current weights
    # (0: never; it waits for its next epoch). Measured on debug (80 steps, a quarter of a step's
    # rows garbage every 8): the 38 garbage suspects stayed 1.6-2.0 nats out at every delay from 2
    # to 24 steps; a clean hard row first 2.3 out was still 1.9 out 8 steps later, 1.3 at 12, 1.2
    # at 16 (under min_gap): the model needs more than its one step on a row to learn it. Off by
    # default: on the healing benchmark (2026-11-30) it named 44 of 108 thin garbage rows (4
    # without it) but also 2 clean rows in 8 fault-free runs (debug-moe, debug-mod), whose hard
    # rows stay as far out as garbage does; 16 is the delay to set where thin bad data is expected
    confirm_after: int = 0
    confirm_rows: int = 64  # suspects scored again at most per step (one scoring forward)
    # outliers at one step that name each other at their first sighting (outliers.py: several at once are
    # no hard rows' chance), and start the data watch over the next steps (orchestrator.data.watch_steps)
    step_outliers: int = 3
    # nats over their level (sigma x spread when more) from which a step's rows under min_gap are a second family:
    # step_outliers + 1 of them at once blame the step and are named. Garbage met after the model trained on its
    # like stands 1.2-1.6 nats out (debug, bad_rows@20, seed 3, steps 22-23); clean rows there came at most 2 a
    # step (outliers.py). Off (0) by default: a clean 2-rank DDP run (debug, 150 KB of data) had 4 rows of one
    # hard document 1.1-1.35 nats out at step 9, and the family named them; 1.0 catches seed 3's garbage
    blame_gap: float = 0.0


@dataclass
class RowGateRule(Section):
    """The row gate (training/row_gate.py): inside a step, before its backward, a row whose target
    tokens are mostly distinct (`min_distinct` of them: random tokens) and whose loss stands above
    the median of the last `window` rows by max(sigma x their spread, min_gap) is left out of the
    step's objective; or, model-free (the LR warm-up, where the loss cannot tell), whose tokens score
    as uniform draws under the unigram frequencies of the rows trained on. Auto mode only. Measured
    on the healing benchmark (2026-11-30, 120 steps): thin_bad_data +2.1% against +4.7% without it;
    no clean row gated in 9 fault-free runs of the four debug presets; with the spread between
    neighbouring rows the nearest came within 0.21 nats of the loss's bar at a run's first judged steps,
    kept by its score against random tokens (training/row_gate.py)."""

    enabled: bool = True
    # random tokens of a 512-token vocabulary in rows of 64 targets: 0.86-1.0 distinct; clean rows
    # reach 0.88, but none of those stood out by its loss (the most 0.97 nats above the median)
    min_distinct: float = 0.8
    window: int = 512  # training rows: the reference
    min_reference: int = 128  # rows seen before any is gated
    min_targets: int = 32  # a row's mean over fewer is noise
    sigma: float = 4.0
    # nats: the reference bar's floor (a row above it stays out of the reference; a step whose ordinary
    # rows stand above it stands the gate down); a row scored beside ordinary rows the model has learnt
    # is gated at sigma x spread alone, once it scores as random tokens would (training/row_gate.py gated)
    min_gap: float = 1.0


def check_row_rules(o: OrchestratorConfig) -> None:
    """The row rules' checks, in the order OrchestratorConfig.validate makes them."""
    _positive(o.data, "orchestrator.data", "sigma", "reference_rows")
    _check(
        o.data.min_gap >= 0 and o.data.watch_steps >= 0,
        "orchestrator.data",
        "min_gap and watch_steps must be >= 0",
    )
    _positive(o.rows, "orchestrator.rows", "window", "sigma", "max_suspects", "confirm_rows")
    _check(o.rows.confirm_after >= 0, "orchestrator.rows.confirm_after", "must be >= 0 (0: never)")
    _check(
        o.rows.step_outliers >= 1,
        "orchestrator.rows.step_outliers",
        "must be >= 1 (1: every outlier is named at its first sighting)",
    )
    _check(
        0 <= o.rows.min_gap <= o.rows.certain_gap and o.rows.min_reference >= 0,
        "orchestrator.rows",
        "min_gap and min_reference must be >= 0, certain_gap >= min_gap",
    )
    _check(
        0 <= o.rows.blame_gap <= o.rows.min_gap,
        "orchestrator.rows.blame_gap",
        f"must be in [0, min_gap={o.rows.min_gap:g}]: the rows between the two are the second family",
    )
    _positive(o.row_gate, "orchestrator.row_gate", "window", "sigma")
    _check(
        0 < o.row_gate.min_distinct <= 1 and o.row_gate.min_gap >= 0 and o.row_gate.min_reference >= 0,
        "orchestrator.row_gate",
        "min_distinct must be in (0, 1], min_gap and min_reference >= 0",
    )
