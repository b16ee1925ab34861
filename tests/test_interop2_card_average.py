"""What an export's model card and a checkpoint average say and hold after the orchestrator acted:
expert surgery, a rollback, an earlier checkpoint exported, a balance coefficient raised."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from trimtab.checkpoint import list_checkpoints, save_checkpoint
from trimtab.config import load_config, read_saved
from trimtab.errors import CheckpointError
from trimtab.hf.card import model_card
from trimtab.merge import average, merge
from trimtab.model import build_model
from trimtab.model.catalog import meta_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _moe_state(cfg, **changes):
    """debug-moe's live MoE state with `changes` ({layer: {knob: value}}) applied."""
    state = meta_model(cfg).moe_state()
    for layer, knobs in changes.items():
        state[layer] = {**state[layer], **knobs}
    return state


def test_the_card_counts_the_experts_surgery_added(tmp_path):
    """A debug-moe run whose layer 1 gained an expert (`trimtab ctl RUN add-expert 1`) exported
    with a card of 899,424 parameters, the config's, while the model had 936,384."""
    cfg = load_config(preset="debug-moe")
    model = build_model(dataclasses.replace(cfg.model, vocab_size=cfg.data.bpe_vocab_size))
    dict(model.moe_layers())[1].add_expert(0)
    state = {"step": 50, "moe": _moe_state(cfg, **{"1": {"n_experts": 9}})}
    card = model_card(tmp_path, cfg, state, "TrimtabForCausalLM", None)
    assert f"({model.num_params():,}), " in card, card
    assert f"({meta_model(cfg).num_params():,})" not in card


def _run_with_evals(run_dir):
    run_dir.mkdir()
    lines = [
        {"step": 50, "phase": "pretrain", "loss": 4.7, "lr": 1e-3},
        {"step": 50, "phase": "pretrain", "val_loss": 4.6601, "val_ppl": 105.65},
        {"step": 60, "phase": "pretrain", "val_loss": 9.0, "val_ppl": 8103.08, "abandoned": True},  # rolled back
        {"step": 81, "phase": "pretrain", "val_loss": 4.4670, "val_ppl": 87.10},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run_dir / "summary.json").write_text(json.dumps({"val_loss": 4.4670, "val_ppl": 87.10, "eval_step": 81}))
    return run_dir


@pytest.mark.parametrize(
    ("step", "said"),
    [
        (81, "- final validation loss: 4.4670 (perplexity 87.10)\n"),
        (50, "- validation loss at step 50: 4.6601 (perplexity 105.65)\n"),
        (60, "- validation loss: not measured at step 60; at step 50: 4.6601 (perplexity 105.65)\n"),
    ],
)
def test_the_card_of_an_earlier_checkpoint_gives_its_own_validation_loss(tmp_path, step, said):
    """`trimtab export RUN --step 60` of a run that went on to step 81 wrote the run's final
    validation loss (step 81's model) into step 60's card as its own."""
    cfg = load_config(preset="debug")
    card = model_card(_run_with_evals(tmp_path / "run"), cfg, {"step": step}, "LlamaForCausalLM", None)
    assert said in card, card
    assert ("final validation loss" in card) == (step == 81)
    assert ("the run went on to step 81 (validation loss 4.4670)" in card) == (step != 81)
    # 80 steps configured, one withheld update made up: the data line said "(80 steps)" of a model trained 81
    made_up = model_card(tmp_path / "run", cfg, {"step": 81, "train": {"length_delta": 1}}, "LlamaForCausalLM", None)
    assert f"({cfg.train.max_steps + 1} steps: {cfg.train.max_steps} configured, +1 set while training)" in made_up


def _moe_run(tmp_path, tokenizer):
    """A debug-moe run directory (hf_helpers.write_run: step 0) and its model."""
    from hf_helpers import write_run

    cfg = load_config(preset="debug-moe")
    model = build_model(dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
    return write_run(tmp_path / "run", model, tokenizer), model, cfg


def test_averaging_checkpoints_across_a_raised_balance_coefficient(tmp_path, tokenizer):
    """The orchestrator raises a collapsing MoE layer's balance coefficient while healing: averaging
    checkpoints across it was refused as "surgery in between"; a router temperature changed between
    them (the function, logits / T) still is, named."""
    run, model, cfg = _moe_run(tmp_path, tokenizer)
    weights = model.state_dict()
    for step, knobs in ((2, {}), (4, {"balance_coef": 0.04}), (6, {"router_temperature": 0.5})):
        state = {"moe": _moe_state(cfg, **{"1": knobs}), "mod": {}, "tokens": step, "good": True}
        save_checkpoint(run, step, weights, {}, state, keep=9)
        if step == 4:
            out = average(run, 2, tmp_path / "avg")
            assert json.loads((list_checkpoints(out)[0] / "state.json").read_text())["merge"]["steps"] == [2, 4]
    with pytest.raises(CheckpointError, match=r"step_000006: its MoE layers' router temperature .* differs from"):
        average(run, 2, tmp_path / "avg2")


def test_an_average_keeps_the_experts_of_the_checkpoints_it_averaged(tmp_path, tokenizer):
    """A newest checkpoint saved unhealthy after surgery is left out of the average, but the output
    took its expert count (the model load_run read) with the averaged weights of the old count: a
    merged run that no longer loaded."""
    run, model, cfg = _moe_run(tmp_path, tokenizer)
    state = {"moe": model.moe_state(), "mod": {}, "tokens": 2, "good": True}
    for step in (2, 4):
        save_checkpoint(run, step, model.state_dict(), {}, {**state, "tokens": step}, keep=9)
    dict(model.moe_layers())[1].add_expert(0)  # surgery, then a checkpoint saved while not healthy
    save_checkpoint(run, 6, model.state_dict(), {}, {**state, "moe": model.moe_state(), "good": False}, keep=9)
    out = average(run, 2, tmp_path / "avg")
    saved = list_checkpoints(out)[0]
    assert json.loads((saved / "state.json").read_text())["moe"]["1"]["n_experts"] == 8
    assert load_file(saved / "model.safetensors")["blocks.1.ffn.w1"].shape[0] == 8
    from trimtab.api import load_run

    _, merged, _ = load_run(out)
    assert torch.isfinite(merged(torch.tensor([[1, 2, 3]]))).all()


def test_a_merged_models_card_says_what_its_input_runs_healed(tmp_path, tokenizer):
    """A merge of a run the orchestrator rolled back with another: the exported card said "None
    recorded." under its decisions; it now counts each input run's (the merge has none)."""
    from hf_helpers import write_run

    cfg = load_config(preset="debug")
    model = build_model(dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
    healed, plain = write_run(tmp_path / "healed", model, tokenizer), write_run(tmp_path / "plain", model, tokenizer)
    decisions = [{"id": 1, "step": 41, "rule": "spike", "action": "skip_step"}]
    decisions.append({"id": 2, "step": 42, "rule": "spike", "action": "rollback"})
    (healed / "decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decisions))
    recipe = {"merge_method": "linear", "models": [{"model": str(healed)}, {"model": str(plain)}]}
    out = merge(recipe, tmp_path / "merged")
    state = json.loads((list_checkpoints(out)[0] / "state.json").read_text())
    card = model_card(out, read_saved(out), state, "LlamaForCausalLM", None)
    assert f"- `{healed}`: 2 decisions: 1 rollback, 1 skip_step\n" in card, card
    assert f"- `{plain}`: none recorded (no decisions.jsonl" in card
    assert "None recorded." not in card


def test_the_card_of_an_earlier_checkpoint_lists_only_its_own_decisions(tmp_path):
    """`trimtab export RUN --step 0` of a debug-moe run whose layer 1 gained an expert at step 1
    listed that add_expert beside step 0's 8 experts; decisions after the checkpoint are counted apart."""
    cfg = load_config(preset="debug-moe")
    decisions = [{"id": 1, "step": 1, "rule": "manual", "action": "add_expert", "summary": "add_expert 1"}]
    decisions.append({"id": 2, "step": 30, "rule": "spike", "action": "skip_step", "summary": "loss 7 > 5"})
    (tmp_path / "decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decisions))
    early = model_card(tmp_path, cfg, {"step": 0, "moe": _moe_state(cfg)}, "Qwen2MoeForCausalLM", None)
    assert "add_expert" not in early, early
    assert "None up to step 0.\n2 more after step 0 (not in this checkpoint)" in early, early
    middle = model_card(tmp_path, cfg, {"step": 20, "moe": _moe_state(cfg)}, "TrimtabForCausalLM", None)
    assert "1 decisions: 1 add_expert" in middle and "- step 30" not in middle, middle
    assert "1 more after step 20 (not in this checkpoint)" in middle
    final = model_card(tmp_path, cfg, {"step": 40, "moe": _moe_state(cfg)}, "TrimtabForCausalLM", None)
    assert "2 decisions: 1 add_expert, 1 skip_step" in final and "after step" not in final, final
