"""The `garbage` rule: documents the data screen flagged and kept, left out as a decision.

With data.garbage_filter=warn (the default) the screen (data/quality.py) only names the documents
that pack into tokens as random bytes, base64, hex dumps and mis-encoded text do, and they are
trained on. No loss rule finds them later: a model soon learns "random characters here", and such
rows then score near the median loss (docs/orchestrator.md, the rows rule's blind spot). So at the
start of each phase the orchestrator leaves out the training rows at least half made of them, as
one journaled skip_data decision (advice in advise mode); their held-out rows are not scored
either (data/held_out.py leaves them out in auto mode, so val_loss is the text trained on).

A resume does not decide again: the decision is in the checkpointed journal and the rows in the
loader's checkpointed skip set (the loop applies what hooks request at the start before the
initial checkpoint, so even that one holds them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.remedies import Remedy
from trimtab.words import counted

if TYPE_CHECKING:
    from trimtab.data.quality import Flagged
    from trimtab.orchestrator.deciding import Deciding
    from trimtab.training.view import RunView

RULE = "garbage"
# how sure the screen is of a flagged document: precision 0.93-1.00 measured on the healing
# benchmark's corpus (docs/data.md); a false one is mostly embedded binary, garbage to a model too
STRENGTH = 0.9
REASONING = (
    "the data screen (data/quality.py) flagged these documents before training: they pack into tokens as random "
    "bytes, base64, hex dumps and mis-encoded text do, far under their source's text; their loss does not stand "
    "out once a model has learnt the mode (random characters cost a small model about what text costs), so no "
    "loss rule would find them: leave out from the start the training rows at least half theirs (their held-out "
    "rows are not scored either). data.garbage_filter=off keeps them (and skips the screen); data.garbage_filter=drop "
    "leaves the documents out before training, without the orchestrator. Junk that packs like text (data/junk.py: "
    "mis-encoded pages, random letters, word salad) packs near the median instead: each named document's evidence "
    "says which it is, its score and the bar it crossed"
)


class ScreenedRows:
    """Decides once per phase; its state is the journal's (checkpointed)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()  # phases this session has looked at

    def check(self, orchestrator: Deciding, run: RunView) -> None:
        """At a phase's first step (and at a session's start): decide, unless this phase's
        decision is in the journal (a resume)."""
        if run.phase in self.seen:
            return
        self.seen.add(run.phase)
        if any(d.rule == RULE and d.evidence.get("phase") == run.phase for d in orchestrator.journal.decisions):
            return
        flagged = run.garbage_rows()
        rows = sorted({int(r) for f in flagged for r in f.rows})
        if rows:
            orchestrator._decide(run, finding(flagged, run.step, run.phase), remedy(rows))


def finding(flagged: list[Flagged], step: int, phase: int) -> Finding:
    """The evidence a person reads: per source, how many documents, the first few by name with
    their bytes per token against the source's median and why each was flagged (its packing, or
    the junk it is: data/junk.py's kind, score and bar), the threshold, and how many rows."""
    sources = [
        {
            "source": f.scale.key,
            "documents": f.documents,
            "rows": len(f.rows),
            "median_bytes_per_token": round(f.scale.median, 3),
            "threshold": round(f.scale.threshold, 3),
            "first": {name: round(packing, 3) for name, packing in zip(f.names, f.packing)},
            "why": dict(zip(f.names, f.reasons())),
        }
        for f in flagged
    ]
    documents = sum(f.documents for f in flagged)
    rows = len({int(r) for f in flagged for r in f.rows})
    first = ", ".join(f"{name} ({why})" for f in flagged for name, why in zip(f.names, f.reasons()))
    worst = max(f.scale.threshold for f in flagged)
    return Finding(
        rule="garbage",  # RULE, spelt out for the architecture map's scan (tests/test_architecture.py)
        family=RULE,  # its own: a later outlier-rows finding is other data, not this decision failing
        step=step,
        evidence={"phase": phase, "documents": documents, "rows": rows, "sources": sources},
        summary=f"{counted(documents, 'document')} flagged as {_what(worst)} (data.garbage_filter=warn; {first}): "
        f"{counted(rows, 'training row')} at least half theirs",
        strength=STRENGTH,
    )


def _what(threshold: float) -> str:
    """What the documents were flagged for: threshold 0 is a source too small for a packing scale (under
    quality.MIN_DOCS documents), where only junk judged by each document alone is (data/junk.py)."""
    if threshold > 0:
        return f"packing under {threshold:.2f}x the source's median bytes per token, or junk that packs like text"
    return "junk, each judged alone (too few documents for a packing scale)"


def remedy(rows: list[int]) -> Remedy:
    return Remedy(action="skip_data", params={"rows": rows}, reasoning=REASONING)
