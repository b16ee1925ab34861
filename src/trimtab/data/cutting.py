"""How a long text is encoded in pieces (formats.pieces) into the whole text's ids, learned once from the
tokenizer itself.

A byte-level tokenizer (trimtab's own, GPT-2's, Llama 3's) splits before a space that precedes a word, so its
pieces, cut there, encode to the whole text's ids. A SentencePiece-converted one (Llama 2 and Mistral v0.1:
normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer; newer conversions: Metaspace, prepend_scheme
"always" or "first") puts "▁" before every text it encodes, so every later piece gained a "▁" of its own, a
token more a cut: 2,435 -> 2,455 ids on 6,000 characters of prose in 21 pieces (tests/test_tokenizer_cuts.py;
Metaspace cut before a newline too: 3,544 -> 3,565 on a word a line). A later piece is encoded
without what the tokenizer puts before a text (`Cutting.later`), and a cut is taken only where a probe, and the
tokenizer's vocabulary where its pre-tokenizer does not split there, show that no token spans it."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

# Cuts formats.pieces makes: before a space between two words (its first choice), before whitespace that
# precedes a word (a blank line into indentation, a tab, two spaces). Each cut of _PROBE is tried.
_PROBE = (
    'The cat sat on the mat. x = f(a, b) + 1; naïve "café" 1999 2024 日本 語 ▁word\n'
    "New line.\n\n    indented  double\tand\ttabs;\r\nend) \n(more) see (x).\nNext:\tone"
)


@dataclass(frozen=True)
class Cutting:
    """A tokenizer's pieces: `later` encodes a piece after the first (special-token text as text; None: the
    tokenizer puts nothing before a text, a later piece is encoded as the first); `exact`, the kinds of cut
    (_kind) that give the whole text's ids; `marker`, what a space is to the model ("▁", "Ġ")."""

    later: Tokenizer | None = field(repr=False)
    exact: frozenset[tuple[str, bool]]
    marker: str

    def whole(self, pieces: list[str]) -> bool:
        """Whether `pieces` (formats.pieces of one text) encode, the first with the tokenizer and the rest with
        `later`, to the whole text's ids. A cut inside a word (no whitespace in half a piece) is taken as
        formats.pieces made it: the bound on an encode call's memory comes first there."""
        cuts = [_kind(before, piece, self.marker) for before, piece in zip(pieces, pieces[1:]) if piece[:1].isspace()]
        return all(cut in self.exact for cut in cuts)

    def joined(self, pieces: Iterable[str]) -> Iterator[str]:
        """`pieces` of one text, in order, joined where a cut between two is not exact (`whole`), one at a
        time (a long file's records, data/shards.py): pieces whose ids are the whole text's, as a text
        encode_documents cannot cut exactly is encoded whole."""
        held: list[str] = []  # joined once whole: a text joined piece by piece was copied at each
        for piece in pieces:
            if held and self.whole([held[-1], piece]):
                yield "".join(held)
                held = []
            held.append(piece)
        if held:
            yield "".join(held)


def _kind(left: str, right: str, marker: str = "") -> tuple[str, bool]:
    """A cut's kind: the whitespace `right` starts with, and whether a word ends `left` (not whitespace, nor
    a space's marker: Llama 2's "▁▁" could span a cut after one)."""
    return right[0], bool(left[-1:].strip()) and left[-1] != marker


def learn(tok: Tokenizer) -> Cutting:
    """`tok`'s Cutting (its probe holds no special-token text), probed on _PROBE cut before
    each whitespace that precedes a word: the ids of its pieces against the whole's, and whether a token could
    span such a cut in any text. Once a tokenizer: 23 ms for trimtab's 4K tokens, 0.11 s for 32K Llama-2-like."""
    later = _without_prefix(tok)
    rest = later if later is not None else tok
    spanning: tuple[set[str], set[str]] = (set(), set())  # read only where the pre-tokenizer does not split
    found: dict[tuple[str, bool], bool] = {}
    for at in range(1, len(_PROBE) - 1):
        if not _PROBE[at].isspace() or _PROBE[at + 1].isspace():
            continue
        left, right = _PROBE[:at], _PROBE[at:]
        kind = _kind(left, right)
        ok = tok.encode(left + right).ids == tok.encode(left).ids + rest.encode(right).ids
        if ok and not _split(tok, left, right):  # a token spanning the cut would join the pieces' ends
            spanning = spanning if spanning[0] else _inside(tok)
            ok = _marker(rest, right[0]) not in spanning[kind[1]]
        found[kind] = found.get(kind, True) and ok
    return Cutting(later, frozenset(kind for kind, ok in found.items() if ok), _marker(rest))


def _split(tok: Tokenizer, left: str, right: str) -> bool:
    """Whether `tok`'s pre-tokenizer starts a pre-token where `right` starts in `left` + `right`: no token of
    any model then spans the cut."""
    if tok.pre_tokenizer is None:
        return False
    text = tok.normalizer.normalize_str(left + right) if tok.normalizer else left + right
    at = len(tok.normalizer.normalize_str(left)) if tok.normalizer else len(left)
    return any(start == at for _, (start, _) in tok.pre_tokenizer.pre_tokenize_str(text))


def _without_prefix(tok: Tokenizer) -> Tokenizer | None:
    """A copy of `tok` that puts nothing before a text (no Prepend normalizer, Metaspace prepend_scheme
    "never", ByteLevel without add_prefix_space) and reads special-token text as text: what a later piece of
    a text is encoded with. None when `tok` puts nothing there."""
    definition = json.loads(tok.to_str())
    changed = _drop_prepend(definition.get("normalizer")) | _no_prefix_space(definition.get("pre_tokenizer"))
    if not changed:
        return None
    later = Tokenizer.from_str(json.dumps(definition))
    later.encode_special_tokens = True
    return later


def _drop_prepend(normalizer: dict[str, Any] | None) -> bool:
    """Take a Prepend out of `normalizer` (in place, nested in a Sequence); whether one was."""
    if not normalizer:
        return False
    if normalizer.get("type") == "Prepend":
        normalizer.clear()
        normalizer["type"] = "Sequence"
        normalizer["normalizers"] = []
        return True
    return any([_drop_prepend(n) for n in normalizer.get("normalizers") or []])  # each, not the first only


def _no_prefix_space(pre: dict[str, Any] | None) -> bool:
    """Turn off what `pre` (a pre-tokenizer, in place) puts before a text; whether it put anything."""
    if not pre:
        return False
    if pre.get("type") == "Metaspace" and pre.get("prepend_scheme", "always") != "never":
        pre["prepend_scheme"] = "never"
        return True
    if pre.get("type") == "ByteLevel" and pre.get("add_prefix_space"):
        pre["add_prefix_space"] = False
        return True
    return any([_no_prefix_space(p) for p in pre.get("pretokenizers") or []])  # each, not the first only


def _marker(later: Tokenizer, space: str = " ") -> str:
    """What whitespace `space` before a word is to the model (its first character once normalized and
    pre-tokenized): "▁" for SentencePiece's, "Ġ" for a byte-level space, the character itself else."""
    text = later.normalizer.normalize_str(space + "a") if later.normalizer else space + "a"
    if later.pre_tokenizer is not None:
        found = later.pre_tokenizer.pre_tokenize_str(text)
        text = found[0][0] if found else text
    return text[:1] or space


def _inside(tok: Tokenizer) -> tuple[set[str], set[str]]:
    """The characters `tok`'s tokens hold after their first, and those of them that follow another
    character: a token holding a space's marker ("▁") so could span a cut before that space (after a word's
    end: Llama 2 has "▁▁" but no "a▁")."""
    tokens = tok.get_vocab(with_added_tokens=False)
    later = {c for token in tokens for c in token[1:]}
    after_other = {c for token in tokens for a, c in zip(token, token[1:]) if a != c}
    return later, after_other
