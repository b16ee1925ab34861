"""The model card (README.md) of an exported model, written from the run directory's files:
config.yaml, the checkpoint's state.json, summary.json and decisions.jsonl."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch

from trimtab.config import RunConfig
from trimtab.model.catalog import family, human_count, meta_model
from trimtab.rundir import DECISIONS_FILE, SUMMARY, is_eval, read_decisions, read_json, read_metrics

MAX_LISTED = 12  # decisions listed one by one; the rest are counted


def model_card(run_dir: Path, cfg: RunConfig, state: dict[str, Any], arch: str, source: dict | None) -> str:
    total, active = _sizes(cfg, state)
    m = cfg.model
    summary = read_json(run_dir / SUMMARY) or {}
    lines = [
        "---",
        "library_name: transformers",
        "tags: [trimtab]",
        "---",
        f"# {run_dir.resolve().name}",
        "",
        f"Trained with [trimtab](https://github.com/trimtab/trimtab); exported as `{arch}`.",
        "",
        "## Model",
        f"- {family(m)} decoder, {m.n_layers} layers ({_pattern(m.layers)}), d_model {m.d_model}, "
        f"{m.n_heads} heads ({m.n_kv_heads} key/value), head dim {m.head_dim}, context {m.max_seq_len}",
        f"- parameters: {human_count(total)} ({total:,}), {human_count(active)} active per token",
        f"- vocabulary: {m.vocab_size:,}; RoPE theta {m.rope_theta:g}",
    ]
    if source:
        lines.append(f"- initialised from `{source['path']}` ({source['config']['architectures'][0]})")
    merged = state.get("merge") or {}
    inputs = merged.get("inputs")  # a recipe merge's: it trained on no token itself, its inputs did
    seen = "none by the merge itself; its inputs' below" if inputs else f"{tokens_seen(state):,}"
    lines += ["", "## Training", f"- steps: {state.get('step', 0):,}; tokens seen: {seen}"]
    lines += [f"- data: {_data(cfg, state)}"] if "merge" not in state else _merged(merged)
    lines += _validation(run_dir, summary, int(state.get("step", 0)))
    decided = merged.get("decisions") if not (run_dir / DECISIONS_FILE).is_file() else None
    lines += ["", "## Orchestrator decisions"]
    step = int(state.get("step", 0))
    lines += _decisions(run_dir, step) if decided is None else _inputs(decided, inputs or {})
    return "\n".join(lines) + "\n"


def _sizes(cfg: RunConfig, state: dict[str, Any]) -> tuple[int, int]:
    """Total and active parameters of the exported model: config.yaml's with each MoE layer's
    expert count as the checkpoint has it (surgery changes it; counted from config.yaml alone, a
    run whose layer gained an expert had a card short of that expert's parameters)."""
    model = meta_model(cfg)
    with torch.device("meta"):
        model.load_moe_state(state.get("moe") or {})
    return model.num_params(), model.num_params(active=True)


def _validation(run_dir: Path, summary: dict[str, Any], step: int) -> list[str]:
    """The validation loss of the exported checkpoint: summary.json's when the run's last evaluation
    was at its step, else metrics.jsonl's evaluation at that step (the kept trajectory). An earlier
    checkpoint's card (export --step) showed the run's final loss, another model's, as its own."""
    final, final_step = summary.get("val_loss"), summary.get("eval_step")
    if final is not None and final_step in (None, step):
        return [f"- final validation loss: {final:.4f} (perplexity {summary['val_ppl']:.2f})"]
    evals = [r for r in read_metrics(run_dir) if is_eval(r) and r.get("val_loss") is not None]
    here = [r for r in evals if r["step"] == step]
    before = [r for r in evals if r["step"] < step]
    if here:
        lines = [f"- validation loss at step {step:,}: {_loss(here[-1])}"]
    elif before:
        last = before[-1]
        lines = [f"- validation loss: not measured at step {step:,}; at step {last['step']:,}: {_loss(last)}"]
    else:
        lines = []
    if final is not None and final_step is not None and final_step > step:
        lines.append(f"- the run went on to step {final_step:,} (validation loss {final:.4f}); this is step {step:,}")
    return lines


def _loss(record: dict[str, Any]) -> str:
    return f"{record['val_loss']:.4f} (perplexity {record.get('val_ppl', float('nan')):.2f})"


def tokens_seen(state: dict[str, Any]) -> int:
    """Tokens trained on: a training checkpoint keeps them with its train state (read at the top
    level alone, every trained run's card said 0); a snapshot's and a merge's at the top level."""
    return int((state.get("train") or {}).get("tokens", state.get("tokens", 0)))


def _merged(record: dict[str, Any]) -> list[str]:
    """What a `trimtab merge` output is made of (its checkpoint's state "merge"): not trained on
    the data its config.yaml names, which is the first input's; a recipe's inputs where they are
    (merge.py _provenance; a merge before it kept the paths as the recipe spelt them) with the
    step and tokens seen of each: not summed, as fine-tunes of one base share its tokens."""
    if record.get("method") == "average":
        steps = ", ".join(map(str, record.get("steps", [])))
        run = record.get("run")
        return [f"- merged: the average of checkpoints {steps} of `{run}` (trimtab merge --method average)"]
    inputs = record.get("inputs") or {}
    models = ", ".join(f"`{_location(m.get('path'), inputs)}`" for m in record.get("models", []))
    base = f", base `{_location(record['base_model'], inputs)}`" if record.get("base_model") else ""
    lines = [f"- merged: {record.get('method')} of {models}{base} (trimtab merge)"]
    return lines + [f"- input `{found['location']}`: {_trained(found)}" for found in inputs.values()]


def _location(path: str, inputs: dict[str, dict[str, Any]]) -> str:
    return (inputs.get(path) or {}).get("location", path)


def _trained(found: dict[str, Any]) -> str:
    """An input's step and tokens seen, as merge.py _provenance kept them."""
    if found.get("step") is None:
        return "a Hugging Face model (its tokens seen are not recorded)"
    tokens = found.get("tokens")
    return f"checkpoint step {found['step']:,}, " + (
        f"{tokens:,} tokens seen" if tokens is not None else "tokens seen not read (a run in object storage)"
    )


def _inputs(decisions: dict[str, dict[str, int] | None], inputs: dict[str, dict[str, Any]]) -> list[str]:
    """A merge's: none of its own; each input run's, counted by action (merge.py _decisions_of)."""
    lines = ["None in the merge itself; in the runs merged:"]
    for typed, actions in decisions.items():
        path = _location(typed, inputs)
        if actions is None:
            lines.append(f"- `{path}`: none recorded (no decisions.jsonl: a Hugging Face model, or no orchestrator)")
        else:
            counts = ", ".join(f"{n} {a}" for a, n in sorted(actions.items(), key=lambda an: -an[1]))
            total = sum(actions.values())
            lines.append(
                f"- `{path}`: {f'{total} decisions: {counts}' if total else 'none, the run needed no intervention'}"
            )
    return lines


def _pattern(kinds: list[str]) -> str:
    counts = Counter(kinds)
    return ", ".join(f"{n} {kind}" for kind, n in counts.items())


def _data(cfg: RunConfig, state: dict[str, Any]) -> str:
    """The data and each phase's length as trained: pretraining's with what the run changed while
    training (withheld updates made up, the live planner: TrainState.length_delta)."""
    delta = int((state.get("train") or {}).get("length_delta", 0))
    changed = f": {cfg.train.max_steps} configured, {delta:+d} set while training" if delta else ""
    parts = [f"`{cfg.data.source}` ({cfg.train.max_steps + delta} steps{changed})"]
    if cfg.finetune.steps:
        parts.append(f"finetuned on `{cfg.finetune.data.source}` ({cfg.finetune.steps} steps)")
    return "; ".join(parts)


def _decisions(run_dir: Path, step: int) -> list[str]:
    """One line per decision (step, rule, action, outcome) up to the exported checkpoint's `step`,
    the first MAX_LISTED, then counts; those of sessions a resume abandoned too (they say why the
    run stopped). Those after `step` are counted apart: an earlier checkpoint (`--step`) does not
    hold them (its card listed an add_expert of step 1 beside step 0's 8 experts)."""
    if not (run_dir / DECISIONS_FILE).is_file():
        return ["None recorded."]
    everything = read_decisions(run_dir, abandoned=True)
    if not everything:
        return ["None: the run needed no intervention."]
    records = [r for r in everything if int(r.get("step", 0)) <= step]
    after = len(everything) - len(records)
    later = [f"{after} more after step {step} (not in this checkpoint), in decisions.jsonl of the run"] if after else []
    if not records:
        return [f"None up to step {step}.", *later]
    actions = Counter(r.get("action", "?") for r in records)
    lines = [f"{len(records)} decisions: " + ", ".join(f"{n} {a}" for a, n in actions.most_common()), ""]
    for r in records[:MAX_LISTED]:
        outcome = (r.get("outcome") or {}).get("result", "pending")
        lines.append(f"- step {r.get('step')}: {r.get('summary', r.get('rule'))} -> {r.get('action')} ({outcome})")
    if len(records) > MAX_LISTED:
        lines.append(f"- ... {len(records) - MAX_LISTED} more in decisions.jsonl of the run")
    return lines + (["", *later] if later else [])
