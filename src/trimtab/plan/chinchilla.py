"""Compute-optimal sizing: parameters, tokens, epochs over the data, steps, FLOPs and budgets.

Formulas (docs/planner.md has the derivations):

- Compute-optimal tokens D = k * N with k ~ 20 tokens per parameter (Hoffmann et al. 2022,
  "Training Compute-Optimal Large Language Models", table 3: 70B -> 1.4T tokens). N counts all
  parameters, embeddings included, as Hoffmann et al. did (Pearce & Song 2024 show that Kaplan
  et al.'s non-embedding count explains much of the gap between the two scaling laws).
- MoE: N is the *active* count. Training compute is C ~ 6 * N_active * D (each token passes
  through top_k experts), and the 20x rule is the compute-optimal split of C = 6ND.
- A FLOP budget C splits as N = sqrt(C / (6k)), D = k * N (Hoffmann et al.: N and D both grow
  as C^0.5).
- Repeated data (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models", eq. 5):
  U unique tokens seen for R = epochs - 1 extra passes are worth D' = U + U R* (1 - exp(-R / R*))
  fresh tokens, R* ~ 15.4: up to ~4 epochs are nearly as good as fresh data, and by ~16 further
  passes add little.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trimtab.config import DataConfig, RunConfig
from trimtab.errors import ConfigError
from trimtab.model.catalog import ModelSize, model_size
from trimtab.plan.junk_screen import screen
from trimtab.words import all_of

if TYPE_CHECKING:
    from trimtab.data.sources import Document

FRESH_EPOCHS = 4.0  # Muennighoff et al. 2023: up to here, repeated tokens ~ fresh ones
MAX_EPOCHS = 16.0  # ... and by here the value of another pass has nearly vanished
REPEAT_DECAY = 15.4  # R*_D of their fit: the e-folding number of repetitions
BYTES_PER_TOKEN = 4.0  # rule of thumb for GPT-2-class BPE on English text (OpenAI tokenizer docs)


def effective_tokens(unique: float, epochs: float) -> float:
    """Fresh-token worth of `epochs` passes over `unique` tokens (Muennighoff et al. 2023, eq. 5)."""
    if epochs <= 1:
        return unique * epochs
    repeats = epochs - 1
    return unique + unique * REPEAT_DECAY * (1 - math.exp(-repeats / REPEAT_DECAY))


@dataclass(kw_only=True)
class DataPlan:
    dataset_tokens: int
    source: str  # how the count was made: given, counted with a tokenizer, estimated from bytes
    epochs: float  # compute-optimal tokens / dataset tokens
    recommended_epochs: float  # epochs bounded to MAX_EPOCHS
    recommended_tokens: int
    effective_tokens: float  # what the recommended tokens are worth in fresh tokens
    run_epochs: float  # the configured run (train.max_steps x train.batch_tokens)
    warnings: list[str] = field(default_factory=list)


def data_plan(
    optimal_tokens: int, run_tokens: int, dataset_tokens: int, source: str, tokens_per_param: float
) -> DataPlan:
    epochs = optimal_tokens / dataset_tokens
    bounded = min(epochs, MAX_EPOCHS)
    tokens = round(bounded * dataset_tokens)
    plan = DataPlan(
        dataset_tokens=dataset_tokens,
        source=source,
        epochs=epochs,
        recommended_epochs=bounded,
        recommended_tokens=tokens,
        effective_tokens=effective_tokens(dataset_tokens, bounded),
        run_epochs=run_tokens / dataset_tokens,
    )
    for what, n in (("the compute-optimal run", epochs), ("the configured run", plan.run_epochs)):
        if n > MAX_EPOCHS:
            plan.warnings.append(
                f"{what} repeats the data {n:.1f} times; by ~{MAX_EPOCHS:.0f} epochs another pass adds "
                f"almost nothing (Muennighoff et al. 2023)"
                + (
                    f", so the plan stops at {MAX_EPOCHS:.0f} epochs ({tokens:,} tokens). For this data a "
                    f"compute-optimal model has ~{_human(FRESH_EPOCHS * dataset_tokens / tokens_per_param)} "
                    f"parameters ({FRESH_EPOCHS:.0f} epochs at {tokens_per_param:g} tokens per parameter): "
                    "use a smaller model or more data"
                    if what.endswith("optimal run")
                    else ""
                )
            )
        elif n > FRESH_EPOCHS:
            worth = effective_tokens(dataset_tokens, n) / (n * dataset_tokens)
            plan.warnings.append(
                f"{what} repeats the data {n:.1f} times; beyond ~{FRESH_EPOCHS:.0f} epochs repeated "
                f"tokens are worth less than fresh ones: its tokens count as ~{worth:.0%} fresh "
                "(Muennighoff et al. 2023, eq. 5)"
            )
    return plan


def count_dataset_tokens(cfg: RunConfig, path: str, key: str = "--data") -> tuple[int, str]:
    """Training tokens in the data at `path` as the run would read it (data.format,
    data.max_bytes, the eval hold-out): counted with the run's tokenizer when there is one
    (data.tokenizer, or RUN_DIR/tokenizer.json), else estimated from the text's bytes. The
    hold-out is the split's own (whole documents, a large one's tail: data/prepared.py hold_out),
    not a flat data.eval_fraction of the tokens: a corpus of one huge document and small ones
    held out 2% of the tokens by that, ~0.1% by the split. `key`: how errors name the path
    (`trimtab plan --data`), not data.source, which the plan leaves unread. Raw text is screened for junk as
    training screens it (junk_screen.py, on a sample): its flagged share counted out where training leaves it out."""
    from trimtab.data import read_documents
    from trimtab.data.prepared import read_manifest

    data = dataclasses.replace(cfg.data, source=path, mix=[])
    fraction = 0.0 if data.eval_source else data.eval_fraction
    if read_manifest(Path(path)) is not None:  # prepared: its index holds each document's tokens
        return _prepared_train_tokens(path, fraction, key, data.garbage_filter)
    docs, _ = read_documents(data, key=key)
    train, source = _raw_train_tokens(cfg, data, docs)
    found = screen(cfg, [d.text for d in docs], [d.source or f"document {i}" for i, d in enumerate(docs)], path, key)
    if found is None:
        return train, source
    junk = f"~{found.share:.1%} of it judged junk ({found.kinds}; named above)"
    if found.left_out:  # training leaves the flagged documents' tokens out (run_length.left_out_tokens)
        return round(train * (1 - found.share)), f"{source}, less {junk}: training leaves it out"
    return train, f"{source}; {junk}: trained on (data.garbage_filter={cfg.data.garbage_filter})"


def _raw_train_tokens(cfg: RunConfig, data: DataConfig, docs: list[Document]) -> tuple[int, str]:
    """count_dataset_tokens of documents read from raw text: counted with the run's tokenizer, else estimated."""
    from trimtab.data import TextTokenizer
    from trimtab.data.tokenizer import configured_tokenizer

    fraction = 0.0 if data.eval_source else data.eval_fraction
    capped = f" (capped by data.max_bytes={data.max_bytes:,}; 0 reads everything)" if data.max_bytes else ""
    tok_path = Path(cfg.data.tokenizer) if cfg.data.tokenizer else cfg.run_dir / "tokenizer.json"
    tok = configured_tokenizer(cfg.data)  # as training reads data.tokenizer: a file, or a directory holding one
    if tok is None and tok_path.is_file():
        tok = TextTokenizer.load(tok_path)
    if tok is not None:
        lengths = np.array([len(ids) + 1 for ids in tok.encode_batch([d.text for d in docs])])  # + end of text
        train = _train_tokens(lengths, fraction, cfg.train.seed)
        return train, f"counted with the tokenizer {tok_path}{_held(lengths, train)}{capped}"
    n_bytes = np.array([len(d.text.encode()) for d in docs])
    lengths = np.round(n_bytes / BYTES_PER_TOKEN).astype(np.int64)
    train = _train_tokens(lengths, fraction, cfg.train.seed)
    return train, (
        f"estimated from {int(n_bytes.sum()):,} bytes at {BYTES_PER_TOKEN:g} bytes per token (no tokenizer yet: "
        f"data.tokenizer is unset and {tok_path} does not exist; a small BPE vocabulary gives fewer "
        f"bytes per token, so more tokens){_held(lengths, train, estimated=True)}{capped}"
    )


def _train_tokens(lengths: np.ndarray, fraction: float, seed: int) -> int:
    """The tokens the in-memory split leaves to training (data/packing.py, with train.seed)."""
    from trimtab.data.packing import train_lengths

    return int(train_lengths(lengths, fraction, seed).sum())


def _prepared_train_tokens(path: str, fraction: float, key: str, garbage_filter: str) -> tuple[int, str]:
    """A prepared directory's training tokens: its documents less the held-out split (split_ranges). One whose
    every document `data prepare` flagged and kept is refused, as training refuses it alone and leaves it out of a
    mixture (data/dataset.py), where the plan counted it whole."""
    from trimtab.data.packing import every_flagged
    from trimtab.data.prepared import PreparedData, split_ranges

    data = PreparedData(path, key=key, verify=False)
    if garbage_filter == "warn" and every_flagged(data.garbage):
        raise ConfigError(
            f"{key} {path}: {all_of(len(data.garbage), 'document')} was flagged as junk by `trimtab data "
            "prepare` (its manifest's garbage): training refuses it alone and leaves it out of a mixture, so it has "
            "no training tokens; plan on the data that trains, or set data.garbage_filter=off to count it as it is"
        )
    bounds = data.doc_bounds()
    starts, ends = split_ranges(bounds, fraction, "train", documents=True)
    train = int((ends - starts).sum())
    return train, f"the prepared directory's manifest{_held(np.diff(bounds), train)}"


def _held(lengths: np.ndarray, train: int, estimated: bool = False) -> str:
    """How much the eval hold-out took, for the count's source line."""
    total = int(lengths.sum())
    if train >= total:
        return ""
    held, about = total - train, "~" if estimated else ""
    return f", less the eval hold-out's {about}{held:,} tokens ({held / max(total, 1):.1%}: whole documents)"


@dataclass(kw_only=True)
class BudgetPlan:
    flops: float
    hours: float | None  # at the assumed throughput (None without a known peak)
    optimal_params: float  # N = sqrt(C / (6k))
    optimal_tokens: float  # D = k N
    preset_tokens: float  # what this preset can train on within C (C / flops_per_token)
    preset_tokens_per_param: float
    preset_steps: int
    preset_optimal_flops: float  # what this preset needs to be compute-optimal (its own 20x tokens)
    verdict: str
    nearest_preset: str = ""


def budget_plan(
    size: ModelSize, flops: float, hours: float | None, batch_tokens: int, tokens_per_param: float
) -> BudgetPlan:
    n_opt = math.sqrt(flops / (6 * tokens_per_param))
    tokens = flops / size.flops_per_token
    per_param = tokens / size.compute_params
    own = size.compute_params * tokens_per_param * size.flops_per_token
    ratio = per_param / tokens_per_param
    if 0.5 <= ratio <= 2:
        verdict = (
            f"this preset is close to compute-optimal for the budget ({per_param:.1f} tokens per "
            f"parameter, {tokens_per_param:g} is optimal)"
        )
    elif ratio < 0.5:
        verdict = (
            f"the budget buys only {per_param:.2g} tokens per parameter for this preset: it is "
            f"~{size.compute_params / n_opt:.1f}x larger than compute-optimal; a ~{_human(n_opt)}-"
            f"parameter model on {_human(tokens_per_param * n_opt)} tokens would reach a lower loss"
        )
    else:
        verdict = (
            f"the budget would give this preset {per_param:.0f} tokens per parameter: it is "
            f"~{n_opt / size.compute_params:.1f}x smaller than compute-optimal; a ~{_human(n_opt)}-"
            f"parameter model would use the budget better, or this preset is compute-optimal at "
            f"{own:.3g} FLOPs"
        )
    return BudgetPlan(
        flops=flops,
        hours=hours,
        optimal_params=n_opt,
        optimal_tokens=tokens_per_param * n_opt,
        preset_tokens=tokens,
        preset_tokens_per_param=per_param,
        preset_steps=math.ceil(tokens / batch_tokens),
        preset_optimal_flops=own,
        verdict=verdict,
    )


def nearest_preset(params: float, moe: bool) -> str:
    """The preset whose compute parameter count (active for MoE) is nearest `params` on a log
    scale, among presets of the same kind (MoE or not)."""
    from trimtab.config import available_presets

    best, best_gap = "", math.inf
    for name in available_presets():
        is_moe, count = _preset_params(name)
        gap = abs(math.log(count / params))
        if is_moe == moe and gap < best_gap:
            best, best_gap = name, gap
    return best


@functools.cache
def _preset_params(name: str) -> tuple[bool, int]:
    """(MoE or not, compute parameter count) of a preset; presets are files that do not change
    while a process runs."""
    from trimtab.config import load_config

    cfg = load_config(preset=name)
    return any("moe" in k for k in cfg.model.layers), model_size(cfg).compute_params


def _human(n: float) -> str:
    """1_100_048_384 -> '1.10B': three significant digits."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f}{unit}"
    return f"{n:.0f}"
