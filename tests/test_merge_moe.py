"""trimtab merge on Mixture-of-Experts models (issue #30): mergekit 0.1.5 loads a Mixtral in
transformers 5's layout, every expert of a layer in two fused tensors (mlp.experts.gate_up_proj
[E, 2H, D], mlp.experts.down_proj [E, D, H]), and merges each fused tensor as one: slerp's angle,
TIES's top-k and sign election, Model Stock's cosine span every expert (and gate with up). trimtab
does the same by default; parameters.per_expert merges each expert's matrices on their own.

Inputs are tiny random Mixtrals saved by transformers (per-expert checkpoint names, which both
tools read into the fused layout). The mergekit comparison runs where mergekit is importable (it
is not a dev dependency: `pip install --no-deps mergekit==0.1.5 immutables peft sentencepiece`)."""

import warnings

import pytest
import torch
from safetensors.torch import load_file

from hf_helpers import llama_style_tokenizer
from trimtab import api
from trimtab.errors import ConfigError
from trimtab.hf.tensors import from_hf
from trimtab.merge import merge, methods, read_recipe

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (parity reference)")
pytestmark = pytest.mark.usefixtures("one_thread")
E, H, LAYERS = 4, 24, 2
MOE = "model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"


@pytest.fixture(scope="module")
def mixtrals(tmp_path_factory):
    """base and three models a, b, c around it, with larger changes in later experts (so a fused
    tensor's angle is not each expert's), saved with a tokenizer."""
    root = tmp_path_factory.mktemp("mixtrals")
    fast = llama_style_tokenizer()
    config = transformers.MixtralConfig(
        vocab_size=320,
        hidden_size=16,
        intermediate_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=E,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.MixtralForCausalLM(config)
        base = {k: v.clone() for k, v in model.state_dict().items()}
        for seed, name in enumerate(("base", "a", "b", "c")):
            g = torch.Generator().manual_seed(seed)
            scale = 0.0 if name == "base" else 0.02
            ramp = {k: (1 + torch.arange(v.shape[0])).view(-1, *[1] * (v.dim() - 1)) for k, v in base.items()}
            model.load_state_dict({k: v + scale * ramp[k] * torch.randn(v.shape, generator=g) for k, v in base.items()})
            model.save_pretrained(root / name)
            fast.save_pretrained(root / name)
    return root


def fused(tensors, i):
    """gate_up_proj [E, 2H, D] and down_proj [E, D, H] of layer i from per-expert HF tensors."""
    w = {name: [tensors[MOE.format(i=i, e=e, w=name)] for e in range(E)] for name in ("w1", "w2", "w3")}
    return torch.stack([torch.cat([g, u]) for g, u in zip(w["w1"], w["w3"])]), torch.stack(w["w2"])


def fused_of_run(state, i):
    """The same two tensors from a trimtab state (w1 / w3 [E, D, H], w2 [E, H, D])."""
    w1, w3, w2 = (state[f"blocks.{i}.ffn.{n}"] for n in ("w1", "w3", "w2"))
    return torch.cat([w1.mT, w3.mT], 1), w2.mT


def per_expert(fn, *tensors):
    """fn on each expert's gate, up (of a gate_up_proj) or down matrix alone."""
    if tensors[0].shape[1] == 2 * H:
        halves = [[fn(*(t[e, s] for t in tensors)) for e in range(E)] for s in (slice(None, H), slice(H, None))]
        return torch.stack([torch.cat([g, u]) for g, u in zip(*halves)])
    return torch.stack([fn(*(t[e] for t in tensors)) for e in range(E)])


def ties(base, a, b):
    deltas = [methods.magnitude(x - base, d, False) for x, d in ((a, 0.3), (b, 0.6))]
    return methods.task_arithmetic(base, deltas, [0.7, 0.5], consensus=True, normalize=True, lambda_=1.0)


def recipe(method, root, **parameters):
    base, a, b, c = (str(root / n) for n in ("base", "a", "b", "c"))
    models = {
        "slerp": [{"model": base}, {"model": a}],
        "ties": [
            {"model": a, "parameters": {"weight": 0.7, "density": 0.3}},
            {"model": b, "parameters": {"weight": 0.5, "density": 0.6}},
        ],
        "task_arithmetic": [{"model": a, "parameters": {"weight": 0.7}}, {"model": b, "parameters": {"weight": 0.4}}],
        "model_stock": [{"model": a}, {"model": b}, {"model": c}],
        "linear": [{"model": a, "parameters": {"weight": 1}}, {"model": b, "parameters": {"weight": 3}}],
    }[method]
    if method == "slerp":
        parameters = {"t": 0.3, **parameters}
    out = {"merge_method": method, "models": models, "parameters": parameters, "dtype": "float32"}
    return out if method == "linear" else {**out, "base_model": base}


CASES = {  # recipe parameters, the method on one unit (base first, then the others in recipe order)
    "slerp": ({}, lambda base, a: methods.slerp(0.3, base, a)),
    "ties": ({}, ties),
    "model_stock": ({}, lambda base, a, b, c: methods.model_stock(base, [a, b, c], False)),
    # per row of transformers' [out, in] matrices: a row lies within one expert, so both agree
    "model_stock-filter_wise": (
        {"filter_wise": True},
        lambda base, a, b, c: methods.model_stock(base, [a, b, c], True),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_fused_expert_tensor_merges_as_one_unit_by_default(case, mixtrals, tmp_path):
    """Each layer's experts merge as transformers 5's two fused tensors (mergekit 0.1.5's units);
    per_expert: true merges each expert's gate, up and down matrix apart, which gives other weights
    (but for filter_wise Model Stock, whose rows never span two experts)."""
    parameters, fn = CASES[case]
    method = case.split("-")[0]
    names = {"slerp": ["base", "a"], "ties": ["base", "a", "b"]}.get(method, ["base", "a", "b", "c"])
    inputs = [load_file(mixtrals / n / "model.safetensors") for n in names]
    merged = api.load_run(merge(recipe(method, mixtrals, **parameters), tmp_path / "fused"))[1].state_dict()
    split = recipe(method, mixtrals, **parameters, per_expert=True)
    apart = api.load_run(merge(split, tmp_path / "apart"))[1].state_dict()
    for i in range(LAYERS):
        for k, (ours, theirs) in enumerate(zip(fused_of_run(merged, i), fused_of_run(apart, i))):
            units = [fused(t, i)[k] for t in inputs]  # gate_up_proj (k 0), down_proj (k 1) of each input
            whole = fn(*units)
            assert torch.allclose(ours, whole, atol=1e-6), (i, k)
            # whole-tensor semantics: the fused tensor is one vector (flattened, concatenated)
            flat = fn(*(u.reshape(-1) for u in units)) if not parameters else whole
            assert torch.allclose(ours.reshape(-1), flat.reshape(-1), atol=1e-6)
            one_by_one = per_expert(fn, *units)
            assert torch.allclose(theirs, one_by_one, atol=1e-6), (i, k)
            if "filter_wise" in parameters:
                assert torch.allclose(ours, one_by_one, atol=1e-6)
            else:
                assert (ours - one_by_one).abs().max() > 1e-3, (i, k)  # the two really differ here


def test_per_expert_is_a_boolean_recipe_parameter():
    r = {"merge_method": "slerp", "base_model": "a", "models": [{"model": "b"}], "parameters": {"t": 0.5}}
    assert read_recipe({**r, "parameters": {"t": 0.5, "per_expert": True}}).param("per_expert", False) is True
    with pytest.raises(ConfigError, match="per_expert must be true or false"):
        read_recipe({**r, "parameters": {"t": 0.5, "per_expert": "yes"}})


@pytest.mark.parametrize("method", ["slerp", "ties", "task_arithmetic", "model_stock", "linear"])
def test_a_mixtral_merge_is_mergekits(method, mixtrals, tmp_path):
    """mergekit 0.1.5's own output on the same files, tensor for tensor (its file holds transformers
    5's names: mlp.experts.gate_up_proj / down_proj, mlp.gate)."""
    pytest.importorskip("mergekit", reason="mergekit 0.1.5 is the parity reference; not a dev dependency")
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    r = recipe(method, mixtrals)
    if method != "slerp":
        r.pop("parameters")
    options = MergeOptions(copy_tokenizer=False, lazy_unpickle=False, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_merge(MergeConfiguration.model_validate(r), str(tmp_path / "mergekit"), options=options)
    theirs_hf = load_file(tmp_path / "mergekit" / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj" in theirs_hf  # the fused unit it merged
    cfg, model, _ = api.load_run(merge(r, tmp_path / "trimtab"))
    ours = model.state_dict()
    theirs = dict(from_hf(lambda n: theirs_hf[n.replace("block_sparse_moe.", "mlp.")], cfg.model, "MixtralForCausalLM"))
    assert set(theirs) == set(ours) - {f"blocks.{i}.ffn.expert_bias" for i in range(LAYERS)}
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor, atol=2e-6, rtol=0), name
