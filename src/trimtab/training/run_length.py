"""A phase's length in steps (train.max_steps, train.epochs or the Chinchilla budget) and how often
it repeats its data: a mixture's sources judged each at its own weight (data/batches.py draws each
at its weight's share of the tokens, over its own epochs)."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from trimtab.config import RunConfig
from trimtab.data import TextTokenizer
from trimtab.data.dataset import PhaseData
from trimtab.data.packing import ConcatRows, Rows
from trimtab.model.catalog import model_size
from trimtab.plan.chinchilla import FRESH_EPOCHS

if TYPE_CHECKING:
    from trimtab.data.prepared import ShardedRows

log = logging.getLogger(__name__)


def mixed_sources(built: PhaseData, section: str, left: list[int] | None = None) -> list[tuple[str, str, float, int]]:
    """A mixture's sources as (config key, by its index in the config: PhaseData.indices; name, weight, training
    tokens trained on: less `left`, each source's tokens left out, left_out_tokens); none for one source."""
    if not isinstance(built.train, ConcatRows):
        return []
    parts = zip(built.indices, built.names, built.weights, built.train.parts, left or [0] * len(built.names))
    return [(f"{section}.mix[{i}]", name, weight, rows.n_tokens - out) for i, name, weight, rows, out in parts]


def kept_whole(built: PhaseData, section: str, left: list[int]) -> list[int]:
    """`left` (left_out_tokens) less a mixture's sources it would leave out whole: every training row
    of such a source is flagged junk, yet the loader keeps a row of each source (BatchLoader.skip_rows
    refuses, and the orchestrator's skip_data fails), so the source trains at its full weight, junk and
    all. Counted out, it read as 0 tokens repeated 2457.6 times (builtin 0.7 with 0.3 of random letters). A source is
    named by its index in the config (PhaseData.indices), not its place among the sources kept."""
    if not isinstance(built.train, ConcatRows):
        return left
    kept = list(left)
    for k, (i, name, weight, rows) in enumerate(zip(built.indices, built.names, built.weights, built.train.parts)):
        if rows.n_tokens and left[k] >= rows.n_tokens:
            kept[k] = 0
            log.warning(
                "%s.mix[%d] ('%s'): every one of its %d training rows is flagged as junk, and a mixture source "
                "cannot be left out whole (the orchestrator leaves out a source's flagged rows only while it keeps "
                "some): it is trained on at its full weight %.2f; remove it from %s.mix or replace its data",
                section,
                i,
                name,
                len(rows),
                weight,
                section,
            )
    return kept


def left_out_tokens(rows: Rows | ConcatRows | ShardedRows, skip: frozenset[int]) -> list[int]:
    """Each source's tokens in the training rows `skip`: the flagged documents' rows the orchestrator
    leaves out from the start (orchestrator/screened.py; data/held_out.py flagged_rows). They are never
    trained on, so they count neither to train.epochs nor to how often the data repeats: counted, a
    corpus 9% garbage trained 4.1 times over was said to repeat 3.8 times, under the warning."""
    parts = rows.parts if isinstance(rows, ConcatRows) else [rows]
    left = [0] * len(parts)
    for row in skip:
        part, i = rows.locate(row) if isinstance(rows, ConcatRows) else (0, row)
        left[part] += parts[part].length(i)
    return left


def resolve_max_steps(
    cfg: RunConfig, train_tokens: int, tok: TextTokenizer, sources: list[tuple[str, str, float, int]] | None = None
) -> int:
    """train.max_steps as a number: from train.epochs over the training rows' tokens, or
    (auto) the Chinchilla budget of this model (setup's completed config records it). `sources`:
    a mixture's (mixed_sources), whose repetition is judged source by source."""
    train = cfg.train
    steps = train.max_steps
    if train.epochs > 0:
        steps = max(1, math.ceil(train.epochs * train_tokens / train.batch_tokens))
    elif steps == "auto":
        size = model_size(cfg, tok.vocab_size)
        steps = max(1, math.ceil(size.compute_params * cfg.plan.tokens_per_param / train.batch_tokens))
    if sources:
        _warn_mixed_repeats(steps, train.batch_tokens, sources)
        return steps
    epochs = steps * train.batch_tokens / max(train_tokens, 1)
    if epochs > FRESH_EPOCHS:
        log.warning(
            "train.max_steps=%d repeats the training data %.1f times; beyond ~%d epochs repeated tokens are worth "
            "less than fresh ones (Muennighoff et al. 2023): more data, or a smaller model, uses the compute better",
            steps,
            epochs,
            FRESH_EPOCHS,
        )
    return steps


def _warn_mixed_repeats(steps: int, batch_tokens: int, sources: list[tuple[str, str, float, int]]) -> None:
    """Each source of a mixture is drawn at its weight's share of the tokens, over its own epochs
    (data/batches.py): a small source with a large weight repeats far more than the mix's total
    says (weights 0.1 / 0.9 over a large and a 6 KB source at train.epochs 3: the small one 49.6
    epochs, the large one 0.32). Beyond ~FRESH_EPOCHS repeated tokens are worth less than fresh
    ones (Muennighoff et al. 2023)."""
    drawn = steps * batch_tokens
    for key, name, weight, tokens in sources:
        epochs = drawn * weight / max(tokens, 1)
        if epochs > FRESH_EPOCHS:
            log.warning(
                "train.max_steps=%d repeats mixture source '%s' (%s) %.1f times: its weight %.2f of the run's %d "
                "tokens over its own %d training tokens; beyond ~%d epochs repeated tokens are worth less than "
                "fresh ones (Muennighoff et al. 2023): give it more data, lower %s.weight, or train fewer steps",
                steps,
                name,
                key,
                epochs,
                weight,
                drawn,
                tokens,
                FRESH_EPOCHS,
                key,
            )
