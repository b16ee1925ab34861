"""Outlier rows: bad data spread thinly, which never spikes a step's loss.

A few garbage documents shuffled through a corpus (random bytes, base64 blobs, mojibake, another
script) cost a few percent of final loss without any step standing out: attribution after a spike
(orchestrator/attribution.py) never starts. So every row of every step is watched, at no extra
cost: the training forward reports each row's mean loss (training.runtime.RowLosses), and a row
is an outlier when its loss is above the median of the last `window` rows by max(sigma x their
spread, min_gap), the spread being the median absolute deviation x 1.4826. This is perplexity
filtering (CCNet, Wenzek et al. 2020, arXiv 1911.00359) done with the model being trained,
against its own current distribution rather than a fixed reference model.

A hard row is not a bad one: a rarer domain of a mixture or an unusual file scores high the first
time and lower once the model has seen it. So a row is named only when it *stays* an outlier: on
its second sighting (the next epoch) it must be one again, or on its first already by
`certain_gap` nats, which learnable text does not reach. Rows seen once are remembered as
suspects (up to `max_suspects`, the oldest forgotten first).
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median
from typing import Any

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding, Monitor, StepMetrics


class OutlierRows(Monitor):
    rule, family = "rows", "data"

    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg.rows
        self.recent: deque[float] = deque(maxlen=self.cfg.window)  # training rows' losses: the reference
        self.suspects: dict[str, float] = {}  # row (a string: JSON keys) -> its gap at its first sighting

    def observe(self, m: StepMetrics) -> Finding | None:
        """This step's rows that stay far above the recent rows (None when none does)."""
        cfg, losses = self.cfg, m.row_losses
        if not losses:
            return None
        values = [x for x in losses.values() if math.isfinite(x)]
        if len(self.recent) < cfg.min_reference or len(values) < len(losses) / 2:  # a broken forward is not the rows'
            self.recent.extend(values)
            return None
        reference = list(self.recent) + values
        middle = median(reference)
        spread = 1.4826 * median([abs(x - middle) for x in reference])
        gap = max(cfg.sigma * spread, cfg.min_gap)
        bad, seen_before = [], {}
        for row, loss in sorted(losses.items()):
            if math.isfinite(loss) and loss <= middle + gap:
                continue
            key = str(row)
            if key in self.suspects or not math.isfinite(loss) or loss - middle >= cfg.certain_gap:
                bad.append(row)
                seen_before[key] = self.suspects.pop(key, None)
            else:
                self.suspects[key] = loss - middle
        while len(self.suspects) > cfg.max_suspects:
            del self.suspects[next(iter(self.suspects))]
        self.recent.extend(x for x in values if x <= middle + gap)
        if not bad:
            return None
        evidence = {
            "rows": bad,
            "threshold": middle + gap,
            "median": middle,
            "spread": spread,
            "rows_reference": len(reference),
            "losses": {str(r): losses[r] for r in bad[:10]},
            "first_gaps": {k: v for k, v in list(seen_before.items())[:10] if v is not None},
            "suspects": len(self.suspects),
        }
        again = sum(v is not None for v in seen_before.values())
        summary = (
            f"{len(bad)} of the step's {len(losses)} rows score above {middle + gap:.3f} (the last {len(reference)} "
            f"rows' median {middle:.3f} + {gap:.3f}): {again} an outlier when last seen too, "
            f"{len(bad) - again} by {cfg.certain_gap:g} nats or more"
        )
        return Finding(rule="rows", family="data", step=m.step, evidence=evidence, summary=summary, strength=1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "suspects": self.suspects}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent = deque(state.get("recent", []), maxlen=self.cfg.window)
        self.suspects = dict(state.get("suspects", {}))
