"""Importing MoE experts in transformers 5's fused layout, the one mergekit 0.1.5 writes: per layer
mlp.gate.weight (the router), mlp.experts.gate_up_proj [E, 2H, D] (each expert's gate rows, then
its up rows) and mlp.experts.down_proj [E, D, H]; Mixtral's block_sparse_moe renamed mlp
(transformers' conversion_mapping.py). The same model as the per-expert file, to the bit."""

import re
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_helpers import TOL, hf_load, max_diff
from trimtab.errors import CheckpointError
from trimtab.hf.importer import import_model

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (parity reference)")
pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = dict(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
E = 4
MODELS = {  # class -> (config, its per-expert MoE module, gate / up / down names)
    "mixtral": (
        lambda: transformers.MixtralConfig(**SMALL, intermediate_size=24, num_local_experts=E, num_experts_per_tok=2),
        "block_sparse_moe",
        ("w1", "w3", "w2"),
    ),
    "qwen2_moe": (
        lambda: transformers.Qwen2MoeConfig(
            **SMALL, intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=16,
            num_experts=E, num_experts_per_tok=2, mlp_only_layers=[0],
        ),
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
    ),
}  # fmt: skip


def saved(path, kind):
    """A tiny random transformers model saved into path (save_pretrained: per-expert names)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(MODELS[kind][0]()).eval()
        model.save_pretrained(path)
    return model


def fused(weights, kind, layers=None):
    """The per-expert tensors of `layers` (all MoE layers when None) fused as transformers 5's
    converter does (MergeModulelist(dim=0) then Concatenate(dim=1) of gate and up; down stacked),
    under mlp. (Mixtral's block_sparse_moe renamed); the rest as it is."""
    _, module, (gate, up, down) = MODELS[kind]
    out, moe_layers = dict(weights), {int(m[1]) for k in weights if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    for i in sorted(moe_layers if layers is None else layers):
        old, new = f"model.layers.{i}.{module}.", f"model.layers.{i}.mlp."
        if old + "experts.0." + gate + ".weight" not in out:
            continue  # a dense layer
        w = {n: torch.stack([out.pop(f"{old}experts.{e}.{n}.weight") for e in range(E)]) for n in (gate, up, down)}
        out[new + "experts.gate_up_proj"] = torch.cat([w[gate], w[up]], dim=1)
        out[new + "experts.down_proj"] = w[down]
        out[new + "gate.weight"] = out.pop(old + "gate.weight")
    return out


def write(path, weights, like):
    """A directory holding `weights` and the config.json (and the rest) of directory `like`."""
    path.mkdir()
    for file in like.iterdir():
        if file.name != "model.safetensors":
            (path / file.name).write_bytes(file.read_bytes())
    save_file(weights, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("kind", list(MODELS))
def test_fused_experts_import_as_transformers_reads_them_and_equal_the_per_expert_import(tmp_path, kind):
    theirs = saved(tmp_path / "per_expert", kind)
    per_expert = load_file(str(tmp_path / "per_expert" / "model.safetensors"))
    fused_weights = fused(per_expert, kind)
    memory = theirs.state_dict()  # transformers 5's own layout in memory: the fused one
    assert set(fused_weights) == set(memory) and all(torch.equal(memory[k], v) for k, v in fused_weights.items())
    write(tmp_path / "fused", fused_weights, tmp_path / "per_expert")
    ours, _ = import_model(tmp_path / "fused")
    assert max_diff(ours, theirs, SMALL["vocab_size"]) <= TOL
    assert max_diff(ours, hf_load(tmp_path / "fused"), SMALL["vocab_size"]) <= TOL  # transformers reads it so too
    reference, _ = import_model(tmp_path / "per_expert")
    mine, ref = ours.state_dict(), reference.state_dict()
    assert set(mine) == set(ref) and all(torch.equal(mine[k], ref[k]) for k in ref)


def test_gate_is_the_first_half_of_gate_up_proj(tmp_path):
    """Gate and up swapped computes another function (silu(up) * gate): the halves are not interchangeable."""
    theirs = saved(tmp_path / "per_expert", "mixtral")
    weights = fused(load_file(str(tmp_path / "per_expert" / "model.safetensors")), "mixtral")
    gate_up = weights["model.layers.0.mlp.experts.gate_up_proj"]
    weights["model.layers.0.mlp.experts.gate_up_proj"] = gate_up.roll(gate_up.shape[1] // 2, dims=1)
    ours, _ = import_model(write(tmp_path / "swapped", weights, tmp_path / "per_expert"))
    assert max_diff(ours, theirs, SMALL["vocab_size"]) > 1e-3


def test_a_mixtral_mixing_layouts_and_module_names_imports_as_transformers_reads_it(tmp_path):
    """Layer 0 fused under mlp., layer 1 per-expert renamed to mlp. (both read by transformers)."""
    theirs = saved(tmp_path / "per_expert", "mixtral")
    weights = fused(load_file(str(tmp_path / "per_expert" / "model.safetensors")), "mixtral", layers=[0])
    weights = {k.replace("layers.1.block_sparse_moe.", "layers.1.mlp."): v for k, v in weights.items()}
    ours, _ = import_model(write(tmp_path / "mixed", weights, tmp_path / "per_expert"))
    assert max_diff(ours, theirs, SMALL["vocab_size"]) <= TOL
    assert max_diff(ours, hf_load(tmp_path / "mixed"), SMALL["vocab_size"]) <= TOL


def test_a_fused_file_without_down_proj_names_the_missing_tensor(tmp_path):
    saved(tmp_path / "per_expert", "mixtral")
    weights = fused(load_file(str(tmp_path / "per_expert" / "model.safetensors")), "mixtral")
    del weights["model.layers.1.mlp.experts.down_proj"]
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.mlp.experts.down_proj' is missing"):
        import_model(write(tmp_path / "broken", weights, tmp_path / "per_expert"))
