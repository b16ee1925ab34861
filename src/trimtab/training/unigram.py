"""The row gate's model-free test: a row's tokens against the unigram frequencies of the rows trained on.

Text is Zipfian, its frequent tokens carry a row; random tokens score as uniform draws over the vocabulary
under those frequencies (unigram_z), whatever the model has learnt: the row gate (training/row_gate.py)
reads it where the loss cannot tell, in the LR warm-up. UnigramTables holds the frequencies, host counts.

In a mixture (data.mix) the frequencies are a table per source, keyed by its name (a later phase's
mixture keeps a source's table), a row judged by its own source's (row_gate.py mix_parts): English's scored
a 5% Japanese source's first rows as uniform draws (debug, 80 steps: a clean Japanese row gated at step 2;
none with a table per source). A table judges from UNIGRAM_MIN_TOKENS (two rows), not a token per
vocabulary entry: bad_batch@2 on a 95/5 English/CJK mix (debug-hybrid, 1,024-token BPE) gated 32 of 32
rows, 30 before (the CJK source's 2 trained on); fault-free at 95/5 (40 steps) and 80/20 (30), none. A
random row can still score as text by chance (z -3.46 at step 2 on debug and debug-hybrid, seed 1: 31 of 32).
A source's table starts from a prior, PRIOR_TOKENS of its own rows' targets spread evenly (the trainer's
loader: row_gate.py source_sample), so its first rows have a verdict; the pooled table of all sources is
no sound prior (another script scores near uniform draws under it: 63-99% of such Zipfian rows at 512
tokens, up to 10% at 4,096). Measured (2026-12-01; the 11 KB of CJK text in CPython's test/cjkencodings and
this repository's docs/*.md as a minority source, a 4,096-token BPE over them and code; 20 orders): with
empty tables a source's first 2 rows had no verdict (no random row of it caught), and at a table of 128
tokens 0.03% of clean prose rows scored uniform (nearest z +0.10); with the prior random rows caught from
the first (99.4-100%), no clean row uniform, the nearest at z -13.9 (prose), -41.6 (CJK; -10.3 before).
And a row its source's frequencies call text (unigram_text: a
Chernoff bound, the surprisals being skewed) is not gated by the loss's test either: at 16,384-token
steps (25 steps) that test alone gated 33 clean rows of the mixture, mostly Japanese at distinct
shares 0.83-0.88; none with it, bad_batch@2, 5, 10 on debug still 32 of 32 gated.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np

from trimtab.training.loss import IGNORE_INDEX

# the share of random-token rows a model-free test lets through (the row gate's distinct bar: min_distinct's
# 0.8 at 512 and 64 targets lets through about 1e-4 of them; unigram_text)
UNIFORM_MISS = 1e-3
# the add-one (Laplace) prior on each vocabulary entry's count in the running unigram frequencies:
# a token not yet trained on is rare, not impossible
UNIGRAM_PRIOR = 1.0
# tokens a source's table holds before it judges that source's rows (two rows of 64): z is a test against
# uniform draws under whatever the table holds, so a sparse one stays sound for random rows; measured (Zipfian
# rows, exponents 0.8-1, vocabularies 512-32,768, a table of 128 tokens): no clean row of 300 scored uniform,
# 0.2-2.8% of random rows missed. On real text (a table of 128 / 256 / 512 random tokens of the source's own
# rows; rows past the share bar): prose 0.15-0.6% scored uniform / <= 0.3% / 0, code at V 512 1.8% / 0.3% / 0
# — a minority source's first step or two only (the main source passes 256 in its first micro-batch; ~0.005
# clean rows a run; soaks of 14 fault-free runs, mixtures of 5-25% minorities: none gated). A table of a token
# per vocabulary entry left a 5% source's first rows unjudged (2 garbage rows of 32 trained)
UNIGRAM_MIN_TOKENS = 128
# target tokens of a source's own rows, spread evenly over them, counted into its table when it is added: a
# prior of pseudo-counts from the source's own data (empirical Bayes, a Dirichlet prior's counts: MacKay & Peto
# 1995, "A hierarchical Dirichlet language model"), so its first rows are judged, and against more than the
# two rows UNIGRAM_MIN_TOKENS holds (a table of 512 tokens scored no clean row of prose or code uniform)
PRIOR_TOKENS = 4096

log = logging.getLogger(__name__)


def unigram_verdicts(targets: np.ndarray, frequencies: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of targets [B, T] (IGNORE_INDEX ignored), model-free, from its mean surprisal under the
    unigram frequencies of the rows trained on (`frequencies`, a count per vocabulary entry, add-one
    smoothed), computed once for both: its z-score (unigram_z) and whether those frequencies call it
    text (unigram_text)."""
    means, n, surprisal = _surprisals(targets, frequencies)
    return unigram_z(means, n, surprisal), unigram_text(means, n, surprisal)


def unigram_z(means: np.ndarray, n: np.ndarray, surprisal: np.ndarray) -> np.ndarray:
    """The z-score of each row's mean surprisal (`means` over its `n` targets) against n tokens drawn
    uniformly over the vocabulary, whose surprisals (`surprisal`, the vocabulary's) have the mean and
    variance of the vocabulary's (a sum of independent draws: normal by the central limit theorem).
    Text is Zipfian (its frequent tokens carry most of a row) and stands far under it; uniform tokens
    at z ~ 0. Measured on debug (rows of 64 targets, 512 tokens): after one step's rows (2,048 tokens)
    clean rows at z <= -6.6, random rows >= -2.6; after 59 steps -6.3 and -2.9."""
    return (means - surprisal.mean()) / np.sqrt(max(float(surprisal.var()), 1e-12) / n)


def unigram_text(means: np.ndarray, n: np.ndarray, surprisal: np.ndarray) -> np.ndarray:
    """Per row: whether its mean surprisal (as unigram_z's) stands so
    far under what n uniform draws reach that they would but for UNIFORM_MISS of rows, by the Chernoff
    bound P(mean <= m) <= exp(n min_l<0 (K(l) - l m)), K the log moment generating function of a uniform
    token's surprisal: a bound for any distribution, where the normal tail of unigram_z is not (the surprisals
    are skewed, a few frequent tokens far under the rest: z <= -UNIFORM_Z as this witness called one of the 32
    random rows of tests/test_row_gate_all_gated.py text). 5e-5 of random rows called text under Zipfian
    frequencies (20,000 rows, 600-20,000 tokens counted), every Zipfian row."""
    slopes = -np.geomspace(1e-3, 50.0, 256)  # l < 0: the lower tail
    scaled = slopes[:, None] * surprisal[None, :]
    top = scaled.max(1, keepdims=True)
    log_mgf = (top + np.log(np.exp(scaled - top).mean(1, keepdims=True)))[:, 0]
    bound = (n[:, None] * (log_mgf[None, :] - slopes[None, :] * means[:, None])).min(1)
    return bound < math.log(UNIFORM_MISS)


def _surprisals(targets: np.ndarray, frequencies: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's mean surprisal under `frequencies` (add-one smoothed), its target count, and the
    vocabulary's surprisals."""
    surprisal = -np.log((frequencies + UNIGRAM_PRIOR) / (frequencies.sum() + UNIGRAM_PRIOR * len(frequencies)))
    valid = targets != IGNORE_INDEX
    n = np.maximum(valid.sum(1), 1)
    return np.where(valid, surprisal[np.where(valid, targets, 0)], 0.0).sum(1) / n, n, surprisal


class UnigramTables:
    """The target tokens of the rows trained on, a count per vocabulary entry (host), one table per data.mix
    source (its rows' alone: English's frequencies score a 5% Japanese source's rows as uniform draws): the
    unigram frequencies the model-free test scores a row under. A source's table is added when its first
    row comes, holding its prior (parts); none without a vocabulary."""

    def __init__(self, vocab: int) -> None:
        self.frequencies = np.zeros((0, vocab if vocab >= 2 else 0), dtype=np.int64)  # [S, V]
        # each table's source by its data.mix name (a later phase's mixture keeps a source's table, a new source
        # starts empty); None: an older checkpoint's tables, by position, named from the first mixture met
        self.sources: list[str] | None = []
        # the places (table x V + token) counted since the last mark, which restore() takes back out: a
        # snapshot (the emergency mark's, every step) copies no table; None: no mark taken
        self.since: list[np.ndarray] | None = None

    def parts(self, names: list[str], sample: Callable[[str], np.ndarray | None] | None = None) -> np.ndarray:
        """The table of each of the loader's sources (`names`), one added for a source not met before: holding
        the target tokens `sample` gives of that source's rows (PRIOR_TOKENS of them, [R, T]), else empty."""
        if self.sources is None:
            self._name_legacy(names)
        assert self.sources is not None
        new = [n for n in dict.fromkeys(names) if n not in self.sources]
        if new:
            more = np.zeros((len(new), self.frequencies.shape[1]), dtype=np.int64)
            self.frequencies = np.concatenate([self.frequencies, more])
            self.sources = self.sources + new
            for name in new if sample is not None else []:
                self._seed(self.sources.index(name), sample(name))
        return np.array([self.sources.index(n) for n in names], dtype=np.int64)

    def _seed(self, part: int, targets: np.ndarray | None) -> None:
        """A new table's prior: a sample of its source's target tokens counted in, not logged for restore (a
        restored step keeps its sources' priors: they are the data's, not the step's)."""
        vocab = self.frequencies.shape[1]
        if targets is None or not vocab:
            return
        kept = targets[(targets != IGNORE_INDEX) & (targets >= 0) & (targets < vocab)]
        self.frequencies[part] += np.bincount(kept, minlength=vocab)

    def _name_legacy(self, names: list[str]) -> None:
        """An older checkpoint's tables were by position: they are the sources of the mixture the run resumed
        into, when it has as many (a resume enters the phase it saved in); else they start afresh, said."""
        if len(self.frequencies) == len(names):
            self.sources = list(names)
            return
        sizes = len(self.frequencies), len(names), UNIGRAM_MIN_TOKENS
        said = "row gate: the checkpoint's %d token tables are by position, this phase's data.mix has %d sources: "
        log.warning(said + "they start empty (no verdict on a source until it holds %d tokens)", *sizes)
        self.frequencies, self.sources = self.frequencies[:0], []

    def verdicts(self, targets: np.ndarray, parts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's unigram_z under its own source's frequencies of the rows trained on, model-free: the
        loss cannot tell random tokens from text in the LR warm-up, where the model scores both at
        ~ln(vocab) (bad_batch@5 on debug-hybrid was trained on: +0.28 val); NaN (no verdict) until that
        source's table holds UNIGRAM_MIN_TOKENS (or a token per vocabulary entry, if fewer). And whether they
        call it text (unigram_text)."""
        z, text = np.full(len(targets), np.nan), np.zeros(len(targets), dtype=bool)
        vocab = self.frequencies.shape[1]
        for part in np.unique(parts):
            table, rows = self.frequencies[part], parts == part
            if vocab >= 2 and table.sum() >= min(vocab, UNIGRAM_MIN_TOKENS):
                z[rows], text[rows] = unigram_verdicts(np.minimum(targets[rows], vocab - 1), table)
        return z, text

    def count(self, targets: np.ndarray, parts: np.ndarray) -> None:
        """The target tokens of rows about to be trained on, into their sources' unigram frequencies."""
        vocab = self.frequencies.shape[1]
        kept = (targets != IGNORE_INDEX) & (targets < vocab) & (targets >= 0)
        places = (parts[:, None] * vocab + targets)[kept]  # into the tables flat: O(tokens), not O(S x V)
        np.add.at(self.frequencies.reshape(-1), places, 1)
        if self.since is not None:
            self.since.append(places)

    def load(self, saved: np.ndarray, sources: list[str] | None) -> None:
        """A checkpoint's tables [S, V] and their sources (None: by position, an older checkpoint's:
        _name_legacy), unless of another vocabulary (other tokens: these kept); no mark since."""
        if saved.ndim == 2 and saved.shape[1] == self.frequencies.shape[1]:
            self.frequencies = np.ascontiguousarray(saved)
            self.sources = sources
        self.since = None

    def mark(self) -> list[np.ndarray]:
        """From here on the counts are logged (since), for restore: no table is copied (S x V counts)."""
        self.since = []
        return self.since

    def restore(self, mark: list[np.ndarray]) -> None:
        """Back to the latest mark: the counts made since it taken back out of the tables."""
        if mark is not self.since:  # only the latest's counts are logged: never fail the save over it
            log.warning("row gate: an older snapshot restored; its token tables keep the counts made since")
        elif self.since:
            np.subtract.at(self.frequencies.reshape(-1), np.concatenate(self.since), 1)
        self.since = []
