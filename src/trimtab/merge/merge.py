"""`trimtab merge RECIPE.yaml --out DIR` and `trimtab merge RUN_DIR --method average --last K
--out DIR`: the merged model as a trimtab run directory (config.yaml, tokenizer, one checkpoint
at step 0), which trains (train.init_from), generates, evaluates and exports like any run.

Inputs are run directories (their newest valid checkpoint) or Hugging Face directories, read
through trimtab.api.load_run, so every input is a trimtab model with trimtab's tensor names. They
must be one architecture with one tokenizer: the same tensors (_same_structure) and the same
settings that decide the function or the ids (_same_function), else the merge is refused.
Tensors merge unit by unit as mergekit sees them in transformers 5's layout (units.py): q, k and v
apart; an MoE layer's experts as two fused tensors (gate_up_proj, down_proj), or each expert apart
with parameters.per_expert. Memory: every input is held at once (N models) plus the output.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trimtab.api import load_run, load_run_at
from trimtab.checkpoint import (
    STATE,
    checkpoint_root,
    list_checkpoints,
    save_checkpoint,
    saved_healthy,
    say_skipped,
    verify,
)
from trimtab.checkpoint_load import apply_structure, load_checkpoint
from trimtab.config import RunConfig, derive, dump_config
from trimtab.data import TextTokenizer
from trimtab.errors import CheckpointError, ConfigError, NewerCheckpointError
from trimtab.hf.card import tokens_seen
from trimtab.hf.importer import SOURCE, is_hf_dir, read_source, source_record
from trimtab.merge import methods
from trimtab.merge.recipe import TASK_ARITHMETIC, Recipe, read_recipe
from trimtab.merge.units import groups, join, split
from trimtab.model import Transformer
from trimtab.model.upgrade import upgrade_weights
from trimtab.rundir import DECISIONS_FILE, read_decisions

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def merge(recipe: str | Path | dict[str, Any], out: str | Path) -> Path:
    """Merge as the recipe says; returns the output run directory."""
    r = read_recipe(recipe)
    _check_out(Path(out))  # before the inputs load: a merge can take minutes
    order = ([r.base] if r.base else []) + [m.path for m in r.others()]
    where = "the recipe" if isinstance(recipe, dict) else str(recipe)
    hf_source = _named(order[0], r, where, lambda path: _hf_source(path, r.dtype))  # before too: it may be damaged
    loaded = {path: _named(path, r, where, load_run_at) for path in order}
    cfg, base_model, tok, _ = loaded[order[0]]
    models = {path: m for path, (_, m, _, _) in loaded.items()}
    _same_structure(models)
    _same_function({path: (m, t) for path, (_, m, t, _) in loaded.items()})
    states = {path: m.state_dict() for path, m in models.items()}
    for path, state in states.items():
        _check_finite(path, state, where)
    tied = {"lm_head.weight"} if cfg.model.tie_embeddings else set()  # merged once, as tok_emb
    names = [name for name in states[order[0]] if name not in tied]
    merged: dict[str, torch.Tensor] = {}
    for group in groups(names):
        merged.update(_merge_group(r, group, states, base_model))
    merged = {name: merged[name] for name in names}
    record = {
        "method": r.method,
        "base_model": r.base,
        "models": [vars(m) for m in r.models],
        "parameters": r.parameters,
        "decisions": {path: _decisions_of(path) for path in order},
        "inputs": {path: _provenance(path, step) for path, (*_, step) in loaded.items()},
    }
    return _write(Path(out), cfg, tok, base_model, merged, {"merge": record}, hf_source, r.dtype)


def _provenance(path: str, step: int | None) -> dict[str, Any]:
    """Where a recipe's input is and what it had trained, kept for the merged model's card (which
    said "tokens seen: 0" and the paths as the recipe spelt them: a relative one means nothing to
    its reader): the location (a local path resolved, a URL as it is), a run's checkpoint step
    (None: a Hugging Face model) and tokens seen (None where no state.json is at hand: a Hugging
    Face model, a run in object storage)."""
    if "://" in path:
        return {"location": path, "step": step, "tokens": None}
    location = Path(path).resolve()
    if step is None:
        return {"location": str(location), "step": None, "tokens": None}
    state = json.loads((checkpoint_root(location) / f"step_{step:06d}" / STATE).read_text())
    return {"location": str(location), "step": step, "tokens": tokens_seen(state)}


def _named(path: str, r: Recipe, where: str, read: Callable[[str], Any]) -> Any:
    """read(path) (load_run_at, _hf_source), an input it cannot read named by the recipe key that gave it."""
    try:
        return read(path)
    except (CheckpointError, ConfigError) as exc:
        keys = (["base_model"] if path == r.base else []) + [
            f"models[{i}].model" for i, m in enumerate(r.models) if m.path == path
        ]
        raise type(exc)(f"{where}: {' and '.join(keys)}: {exc}") from None


def _check_averaged(run_dir: Path) -> None:
    """--method average reads a run's checkpoints: a recipe file or a Hugging Face directory (one
    set of weights) was refused as "neither a run directory" or "0 valid checkpoints"."""
    if run_dir.is_file():
        raise ConfigError(
            f"'{run_dir}' is a file; --method average takes a run directory; a recipe file takes no --method"
        )
    if is_hf_dir(run_dir):
        raise ConfigError(
            f"'{run_dir}' is a Hugging Face model directory: one set of weights, no checkpoints to average; "
            "--method average takes a run directory (the --out of trimtab train)"
        )


def average(run_dir: str | Path, last: int, out: str | Path) -> Path:
    """Uniform average of a run's last `last` valid checkpoints (LAWA: Kaddour 2022, "Stop
    Wasting My Time!"; Sanyal et al. 2023 for LLM pretraining), but for step 0 and those saved
    while the run was not healthy (_to_average)."""
    run_dir = Path(run_dir)
    if last < 1:
        raise ConfigError(f"--last {last} must be >= 1")
    _check_averaged(run_dir)
    _check_out(Path(out))
    hf_source = _hf_source(run_dir, None)
    valid = _to_average(run_dir, last)  # first: a corrupt one is said as passed over for these steps, not the newest
    cfg, model, tok = load_run(run_dir)
    total: dict[str, torch.Tensor] = {}
    states = []
    for path in valid:
        weights, _, state = load_checkpoint(path, optimizer=False, verified=True)  # by _to_average
        weights = upgrade_weights(weights, cfg.model)
        states.append(state)
        _same_routing(path, state, valid[0], states[0])
        _check_finite(path, weights, f"--method average of {run_dir}")
        for name, tensor in weights.items():
            if name in total and total[name].shape != tensor.shape:
                raise CheckpointError(
                    f"{path}: tensor '{name}' has shape {list(tensor.shape)}, {list(total[name].shape)} before"
                )
            total[name] = total.get(name, 0) + tensor.double()
    merged = {name: (t / len(valid)).float() for name, t in total.items()}
    apply_structure(model, states[-1], valid[-1])  # the averaged checkpoints' experts, not a newer one's
    steps = [s["step"] for s in states]
    record = {"method": "average", "run": str(run_dir.resolve()), "steps": steps}  # resolved: the card's
    record["decisions"] = {record["run"]: _decisions_of(run_dir, until=steps[-1])}
    extra = {"merge": record, "tokens": tokens_seen(states[-1])}
    return _write(Path(out), cfg, tok, model, merged, extra, hf_source, "float32")


def _same_routing(path: Path, state: dict[str, Any], first: Path, first_state: dict[str, Any]) -> None:
    """Checkpoints average only where each MoE layer has the same experts (surgery changes them) and
    router temperature (the function: logits / T), and each Mixture-of-Depths layer the same target
    capacity (the share of tokens its predictor learned to pick; compared between runs too,
    _settings; averaged across a change, the output took the newest's in silence). The training
    knobs the orchestrator moves while healing (balance_coef, z_loss_coef, capacity_factor) do not
    count: a run whose balance coefficient it raised against a collapsing expert was refused as
    "surgery in between"."""
    read = {
        "MoE layers' expert count": lambda s: _moe_knob(s, "n_experts"),
        "MoE layers' router temperature": lambda s: _moe_knob(s, "router_temperature"),
        "Mixture-of-Depths layers' target capacity": lambda s: s.get("mod") or {},
    }
    for what, knob in read.items():
        ours, theirs = knob(state), knob(first_state)
        if ours != theirs:
            why = "surgery in between" if what.endswith("expert count") else "it changed in between"
            raise CheckpointError(
                f"{path}: its {what} ({_short(ours)}) differs from {first.name}'s ({_short(theirs)}; "
                f"{why}); lower --last to average only the checkpoints after the change"
            )


def _moe_knob(state: dict[str, Any], key: str) -> dict[str, Any]:
    """Each MoE layer's `key` in a checkpoint's state.json (older ones name the temperature "temperature")."""
    old = {v: k for k, v in Transformer.RENAMED_KNOBS.items()}.get(key, key)
    return {layer: s.get(key, s.get(old)) for layer, s in (state.get("moe") or {}).items()}


def _decisions_of(path: str | Path, until: int | None = None) -> dict[str, int] | None:
    """The orchestrator's decisions of an input run by action (up to step `until`: an average's last
    checkpoint), kept in the merge record for the card: the merged run directory has none of its
    own, and its card said "None recorded" of a model whose input had been rolled back and healed.
    None for an input without a decisions.jsonl (a Hugging Face model, a run without the orchestrator)."""
    if "://" in str(path) or not (Path(path) / DECISIONS_FILE).is_file():
        return None
    records = [r for r in read_decisions(path, abandoned=True) if until is None or r["step"] <= until]
    return dict(Counter(str(r.get("action", "?")) for r in records).most_common())


def _to_average(run_dir: Path, last: int) -> list[Path]:
    """The newest `last` checkpoints of `run_dir` fit to average: valid, saved while the run was
    healthy (state.json "good": a checkpoint the orchestrator did not call healthy is no state to
    keep), and past step 0 where the run has trained on (the weights before the first step, random
    or the model it started from, would be averaged into the trained ones). Those left out of the
    newest `last` are named; fewer than `last` fit is refused, saying why. Corrupt ones are said as
    the checkpoint loader says them (checkpoint.say_skipped: once, naming the file)."""
    found, corrupt = _verified(run_dir)
    why = {p: _unfit_to_average(p, found) for p in found}
    fit = [p for p in found if not why[p]]
    chosen = fit[-last:]
    # newest first, as the loader walks them
    say_skipped(corrupt[::-1], None, f"averaging {_steps(chosen)}" if len(chosen) == last else "not averaged")
    # named: those a plain pick of the newest `last` would have averaged in (all of them on a refusal)
    passed = [p for p in found[-last:] if why[p]] if len(chosen) == last else [p for p in found if why[p]]
    left_out = "; ".join(f"step {_step(p)} ({why[p]})" for p in passed)
    if len(chosen) < last:
        raise CheckpointError(
            f"{run_dir} has {len(fit)} checkpoint{'s' if len(fit) != 1 else ''} to average"
            f"{f' ({_steps(fit)})' if fit else ''}, fewer than --last {last}"
            f"{f'; left out: {left_out}' if left_out else ''}; lower --last, or train on to save more"
        )
    if left_out:
        log.warning("%s: left out of the average: %s; averaging %s", run_dir, left_out, _steps(chosen))
    return chosen


def _unfit_to_average(path: Path, found: list[Path]) -> str:
    """Why checkpoint `path` is not averaged ("" when it is)."""
    if _step(path) == 0 and len(found) > 1:
        return "the weights before the first step"
    if not saved_healthy(path):
        return 'saved while the run was not healthy: state.json "good": false'
    return ""


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def _steps(paths: list[Path]) -> str:
    return f"step{'s' if len(paths) > 1 else ''} {', '.join(str(_step(p)) for p in paths)}"


def _hf_source(path: str | Path, dtype: str | None) -> dict[str, Any] | None:
    """The record export reads to give the model back in its Hugging Face class, ids and dtype
    (hf_source.json): a Hugging Face input's, or that of a run trained from one (without it the
    merge of two fine-tunes of a Llama exported with no bos_token_id, generation_config or dtype
    of the original). `dtype`: the recipe's, the merged weights' (None: the run's record as is)."""
    if is_hf_dir(path):
        return source_record(path, DTYPES[dtype or "float32"])
    found = read_source(path, "restore it, or remove it to merge into trimtab's own mapping of the model")
    return {**found, "dtype": dtype} if found is not None and dtype else found


def _check_out(out: Path) -> None:
    """--out must be a new or empty directory: the merged run is renamed into place there."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out '{out}' is a file; choose a new directory for the merged model")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out '{out}' exists and is not empty; choose a new directory")
    if any(p.exists() and not p.is_dir() for p in out.parents):
        raise ConfigError(f"--out '{out}' lies under a file; choose a new directory for the merged model")
    if (run := _run_holding(out)) is not None:
        raise ConfigError(
            f"--out '{out}' lies in the checkpoints folder of the run {run} ({checkpoint_root(run)}): a model "
            "written there would be taken for one of its checkpoints (step_N: resumed from, averaged, rolled back "
            f"to) or clobber one; write it outside the run, e.g. --out {run.parent / (run.name + '-merged')}"
        )


def _run_holding(out: Path) -> Path | None:
    """The run directory whose checkpoints folder `out` is or lies in (its links followed), else None."""
    for folder in (out.resolve(), *out.resolve().parents):
        if folder == checkpoint_root(folder.parent) and (folder.parent / "config.yaml").is_file():
            return folder.parent
    return None


def _verified(run_dir: Path) -> tuple[list[Path], list[tuple[Path, CheckpointError]]]:
    """The checkpoints of `run_dir` that verify, and those that do not with their error (one
    written by a newer trimtab is not corrupt: raised, as the checkpoint loader does)."""
    found, corrupt = [], []
    for path in list_checkpoints(run_dir):
        try:
            verify(path)
            found.append(path)
        except NewerCheckpointError:
            raise
        except CheckpointError as exc:
            corrupt.append((path, exc))
    return found, corrupt


def _check_finite(path: str | Path, state: dict[str, torch.Tensor], where: str) -> None:
    """Refuse an input holding NaN or inf: every method mixes it into the output tensor (a linear merge with a
    Hugging Face file whose bytes were damaged past its header evaluated to perplexity nan), and the file
    formats carry no checksum of their own to catch it."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(
                f"{where}: {path}: tensor '{name}' holds {bad} non-finite value(s) of {tensor.numel()}: the input is "
                "damaged or was saved diverged; merge another checkpoint of it, or download or export it again"
            )


def _same_structure(models: dict[str, Transformer]) -> None:
    """Inputs must be one architecture: every tensor present with one shape, the same live MoE
    and MoD structure (refused naming the first difference)."""
    (first, a), *rest = models.items()
    sa = a.state_dict()
    for path, b in rest:
        sb = b.state_dict()
        for name in sorted(set(sa) | set(sb)):
            not_one = f"{first} and {path} are not one architecture: tensor '{name}'"
            if name not in sa or name not in sb:
                has, lacks = (path, first) if name not in sa else (first, path)
                raise ConfigError(f"{not_one} is in {has}, not in {lacks}; {SAME_BASE}")
            if sa[name].shape != sb[name].shape:
                shapes = f"{list(sa[name].shape)} in {first}, {list(sb[name].shape)} in {path}"
                raise ConfigError(f"{not_one} has shape {shapes}; {SAME_BASE}")


# The way out of a structure refusal: a dense run beside an MoE one, or a debug run beside a Llama, were
# refused as "tensor 'blocks.0.attn.qkv.weight': shape [192, 96] in runs/debug vs [64, 32] in hf/llama",
# naming neither what it meant nor what to merge instead.
SAME_BASE = (
    "merge only fine-tunes of one base model (each trained from it with --set train.init_from=BASE; "
    "MoE layers with the same expert counts)"
)


# What, besides the tensors (_same_structure: names, shapes, so expert counts), decides the function
# the weights compute or the ids a text becomes. Inputs that differ in any of it are refused: the
# output would silently take the first input's. Not compared, as it changes neither: a trimtab
# run's training settings (optimizer, schedule, data, seed, precision), names and dtypes, and of
# the model config max_seq_len (it only bounds the length: the rotary tables hold the same values,
# cut shorter), multiple_of (it only derives the widths, compared), init_std (initialisation only)
# and layer_pattern as written (compared expanded to one kind per layer, `layers`).
MODEL = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden",
    "norm_eps", "rope_theta", "tie_embeddings", "attn_bias", "qk_norm", "layers",
)  # fmt: skip
ROPE_SCALING = {  # the rope_scaling fields each type reads
    "none": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"),
}
# With MoE layers (renormalize: norm_topk_prob resolved, so auto and true agree for top_k > 1). Not
# compared: capacity_factor (tokens are dropped only in training), router_jitter (training noise),
# balance_coef, z_loss_coef, bias_update_rate (losses, training updates).
MOE = ("top_k", "renormalize", "expert_hidden", "n_shared_experts", "shared_hidden", "shared_gate")
# Also compared, live from the checkpoint (the orchestrator changes them, so the config may be
# stale): each MoE router's temperature; each Mixture-of-Depths layer's target capacity (the share
# of tokens a training forward processes, which its predictor learns to pick; warmup_steps and
# predictor_loss_coef are training settings). The tokenizer: its tokenizer.json (vocabulary,
# merges, added and special tokens, normalizer, pre-tokenizer, post-processor, decoder) but for
# truncation and padding (how a batch is cut, not a text's ids), and the start and end-of-text ids
# put around documents; not tokenizer_config.json's other fields (chat template, model_max_length):
# the output keeps the first input's.


def _same_function(inputs: dict[str, tuple[Transformer, TextTokenizer]]) -> None:
    """Refuse inputs whose weights compute different functions or whose tokenizers give other ids,
    naming both inputs, the first setting that differs and its two values."""
    (first, a), *rest = ((path, _settings(*m)) for path, m in inputs.items())
    for path, b in rest:
        for name in a:
            if found := _difference(name, a[name], b.get(name, ABSENT)):
                setting, x, y = found
                raise ConfigError(
                    f"{first} and {path} are not one architecture with one tokenizer: {setting} is {_short(x)} "
                    f"in {first}, {_short(y)} in {path}; merge only models that differ in their weights"
                )


def _settings(model: Transformer, tok: TextTokenizer) -> dict[str, Any]:
    """What of a model and its tokenizer _same_function compares (the table above)."""
    c = model.cfg.resolved()
    found = {f"model.{f}": getattr(c, f) for f in MODEL}
    found["model.rope_scaling"] = {f: getattr(c.rope_scaling, f) for f in ("type", *ROPE_SCALING[c.rope_scaling.type])}
    if model.moe_layers():
        found |= {f"model.moe.{f}": getattr(c.moe, f) for f in MOE}
        found["router_temperature"] = {i: s["router_temperature"] for i, s in model.moe_state().items()}
    if model.mod_layers():
        found["Mixture-of-Depths capacity"] = model.mod_state()
    tokenizer = tok.definition()  # what decides the ids, as loaded
    found["tokenizer"] = {k: v for k, v in tokenizer.items() if k not in ("version", "truncation", "padding")}
    return found | {"tokenizer.bos_id": tok.bos_id, "tokenizer.eos_id": tok.eos_id}


def _difference(name: str, x: Any, y: Any) -> tuple[str, Any, Any] | None:
    """The innermost entry where x and y (nested dicts and lists) differ: its name, its two values;
    None where they are equal."""
    while x != y and type(x) is type(y) and isinstance(x, (dict, list)):
        keys = range(max(len(x), len(y))) if isinstance(x, list) else [*x, *(k for k in y if k not in x)]
        k = next(k for k in keys if _at(x, k) != _at(y, k))
        name, x, y = f"{name}[{k!r}]", _at(x, k), _at(y, k)
    return (name, x, y) if x != y else None


class _Absent:
    def __repr__(self) -> str:
        return "absent"


ABSENT = _Absent()  # an entry one side lacks


def _at(x: dict | list, k: Any) -> Any:
    return x[k] if (k in x if isinstance(x, dict) else k < len(x)) else ABSENT


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _merge_group(
    r: Recipe, names: tuple[str, ...], states: dict[str, dict], model: Transformer
) -> dict[str, torch.Tensor]:
    """The merged tensors of one group (units.groups: one tensor, or an MoE layer's w1 and w3)."""
    first, keep = states[next(iter(states))], states[r.base or next(iter(states))]
    if not first[names[0]].is_floating_point():
        return {name: keep[name] for name in names}
    if names[0].endswith("expert_bias"):  # selection-only routing state: the base model's routing
        return {name: keep[name] for name in names}
    per_expert = bool(r.param("per_expert", False))
    units = {path: split(names, state, model.cfg, per_expert) for path, state in states.items()}
    key = "+".join(names)
    n = len(units[next(iter(units))])
    parts = [_merge_unit(r, key, k, {p: u[k] for p, u in units.items()}) for k in range(n)]
    return join(names, parts, model.cfg, per_expert)


def _merge_unit(r: Recipe, name: str, k: int, x: dict[str, torch.Tensor]) -> torch.Tensor:
    weights = {m.path: m.weight for m in r.models}
    if r.method == "linear":
        paths = [m.path for m in r.models]
        return methods.linear([x[p] for p in paths], [weights[p] for p in paths], r.param("normalize", True))
    base, others = x[r.base].float(), r.others()
    if r.method == "slerp":
        return methods.slerp(float(r.param("t", 0.5)), base, x[others[0].path])
    if r.method == "model_stock":
        return methods.model_stock(base, [x[m.path] for m in others], bool(r.param("filter_wise", False)))
    sparsify, consensus, normalize, rescale = TASK_ARITHMETIC[r.method]
    seed = int(hashlib.sha256(f"{r.param('seed', 0)}:{name}:{k}".encode()).hexdigest()[:15], 16)
    generator = torch.Generator().manual_seed(seed)  # DARE: reproducible, independent per unit
    deltas = []
    for m in others:
        delta = x[m.path].float() - base
        if sparsify == "magnitude":
            delta = methods.magnitude(delta, m.density, bool(r.param("rescale", rescale)))
        elif sparsify == "random":
            delta = methods.random_drop(delta, m.density, bool(r.param("rescale", rescale)), generator)
        deltas.append(delta)
    return methods.task_arithmetic(
        base,
        deltas,
        [m.weight for m in others],
        consensus=consensus,
        normalize=bool(r.param("normalize", normalize)),
        lambda_=float(r.param("lambda", 1.0)),
    )


def _write(
    out: Path,
    cfg: RunConfig,
    tok: TextTokenizer,
    model: Transformer,
    weights: dict[str, torch.Tensor],
    extra: dict[str, Any],
    hf_source: dict | None,
    dtype: str,
) -> Path:
    """The merged model as a run directory, written beside `out` and renamed into place."""
    _check_out(out)  # again: something may have been written there while the inputs merged
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        dump_config(derive(cfg, {"out": str(out)}), tmp / "config.yaml")
        tok.save(tmp / "tokenizer.json")
        if hf_source is not None:
            (tmp / SOURCE).write_text(json.dumps(hf_source, indent=1))
        weights = {k: v.to(DTYPES[dtype]).to(torch.float32) for k, v in weights.items()}
        structure = {"moe": model.moe_state(), "mod": model.mod_state()}
        save_checkpoint(tmp, 0, weights, {}, {**structure, "tokens": 0, **extra, "good": True}, keep=1)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
