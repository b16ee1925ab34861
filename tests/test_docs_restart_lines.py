"""The restart lines the docs quote are the journal's own: a restart's summary says where the data
resumed (`resumed at step 5 (data at epoch 0, row 160 of 2,798) on 2 ranks`), so a quoted line
without it is one the code no longer prints (docs/resilience.md quoted `resumed at step 4 on 2 ranks`
for a run that now resumes at step 5, from rank 0's emergency save, and names the data position)."""

import re
from pathlib import Path

from trimtab.orchestrator.restarts import restart_finding

DOCS = sorted((Path(__file__).resolve().parent.parent / "docs").glob("*.md"))
LOST = {"kind": "lost_rank", "ranks_to_blame": [1], "step": 5, "resumed_step": 5, "steps_lost": 0, "down_s": 2.9}


def test_a_restart_summary_names_where_the_data_resumed():
    """The form the docs are checked against below is the one restart_finding prints."""
    finding = restart_finding({**LOST, "world_before": 2, "world_after": 2, "data_at": "epoch 0, row 160 of 2,798"}, 5)
    assert "; resumed at step 5 (data at epoch 0, row 160 of 2,798) on 2 ranks (0 steps lost, 2.9 s down)" in (
        finding.summary
    )


def test_every_quoted_restart_line_names_the_data_position():
    """An indented (quoted) `resumed at step N on ...` without `(data at ...)` is the old wording."""
    old = re.compile(r"; resumed at step \d+ on ")
    bad = [
        f"{path.name}:{number}: {line.strip()[:100]}"
        for path in DOCS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if line.startswith("    ") and old.search(line)
    ]
    assert bad == []
