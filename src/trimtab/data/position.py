"""Where the data resumes, in words, from a loader's state (data/batches.py Batches.state_dict: each
source's epoch, cursor and row count): a resume line said only the step, and on another world size the
step no longer tells the data position (the rows a step draws depend on the ranks)."""

from __future__ import annotations

from typing import Any


def data_position(state: dict[str, Any]) -> str:
    """The position as "epoch 0, row 1,234 of 10,000" (a mixture: each source's, by name); "" for a loader
    that keeps no such position (its state lacks cursor and n_rows)."""
    parts = [p for p in state.get("parts") or [state] if "cursor" in p and "n_rows" in p]
    if len(parts) <= 1:
        return _part(parts[0]) if parts else ""
    return "; ".join(f"{p.get('name') or f'source {i}'}: {_part(p)}" for i, p in enumerate(parts))


def _part(part: dict[str, Any]) -> str:
    return f"epoch {int(part.get('epoch', 0))}, row {int(part['cursor']):,} of {int(part['n_rows']):,}"
