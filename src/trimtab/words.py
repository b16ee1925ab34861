"""Counts in the words a person reads, shared by every layer's messages (the journal, the console, the
report): the noun agrees with the count ("1 document", "2 documents"; the journal said "1 steps" and
`trimtab data prepare` "1 documents")."""

from __future__ import annotations


def counted(n: int, noun: str) -> str:
    """`n` `noun`s, thousands separated and the noun agreeing with the count: "1 step", "0 steps", "1,024 rows"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def all_of(n: int, noun: str) -> str:
    """All `n` of a source's `noun`s, as the subject of a singular verb: "its only document", "every one of its
    3 documents" ("every one of its 1 documents" before)."""
    return f"its only {noun}" if n == 1 else f"every one of its {n:,} {noun}s"
