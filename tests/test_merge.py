"""trimtab merge: mergekit's methods checked on small tensors against values computed by hand,
recipes read and refused as mergekit's format says, and merges of real runs that train,
generate and export; checkpoint averaging (LAWA)."""

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file

from trimtab import api
from trimtab.checkpoint import list_checkpoints
from trimtab.cli import main
from trimtab.errors import CheckpointError, ConfigError
from trimtab.merge import average, merge, methods, read_recipe
from trimtab.model.layers import split_qkv

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = {"log": {"progress": False, "tensorboard": False}, "data": {"max_bytes": 150000}}
T = torch.tensor
OPPOSED = (("a", 1), ("b", -1))  # weights that sum to 0


# ---- the methods, by hand ---------------------------------------------------------------------


def test_linear_weights_and_normalises():
    x = [T([1.0, 2.0]), T([3.0, 6.0])]
    assert torch.allclose(methods.linear(x, [1, 3], normalize=True), T([2.5, 5.0]))
    assert torch.allclose(methods.linear(x, [1, 3], normalize=False), T([10.0, 20.0]))


def test_slerp_follows_the_great_circle_and_lerps_colinear_vectors():
    half = methods.slerp(0.5, T([1.0, 0.0]), T([0.0, 1.0]))
    assert torch.allclose(half, T([math.sqrt(0.5), math.sqrt(0.5)]))
    assert torch.allclose(methods.slerp(0.0, T([3.0, 0.0]), T([0.0, 1.0])), T([3.0, 0.0]))
    assert torch.allclose(methods.slerp(0.25, T([2.0, 0.0]), T([4.0, 0.0])), T([2.5, 0.0]))  # colinear: lerp


def test_task_arithmetic_adds_weighted_task_vectors():
    base = T([1.0, 1.0, 1.0])
    deltas = [T([1.0, -1.0, 0.0]), T([0.0, 2.0, 0.0])]
    out = methods.task_arithmetic(base, deltas, [1.0, 0.5], consensus=False, normalize=False, lambda_=1.0)
    assert torch.allclose(out, T([2.0, 1.0, 1.0]))
    out = methods.task_arithmetic(base, deltas, [1.0, 0.5], consensus=False, normalize=False, lambda_=2.0)
    assert torch.allclose(out, T([3.0, 1.0, 1.0]))
    out = methods.task_arithmetic(base, deltas, [1.0, 0.5], consensus=False, normalize=True, lambda_=1.0)
    assert torch.allclose(out, base + T([1.0, 0.0, 0.0]) / 1.5)


def test_ties_trims_elects_a_sign_and_mixes_only_agreeing_entries():
    d1 = methods.magnitude(T([3.0, -1.0, 0.5]), 2 / 3, rescale=False)  # keeps the two largest
    d2 = methods.magnitude(T([-2.0, 0.2, 1.0]), 2 / 3, rescale=False)
    assert torch.equal(d1, T([3.0, -1.0, 0.0])) and torch.equal(d2, T([-2.0, 0.0, 1.0]))
    # elected signs (sum): +, -, +. Entry 0: only d1 agrees; 1: d1; 2: d2. Divided by agreeing weights (1).
    out = methods.task_arithmetic(T([0.0, 0.0, 0.0]), [d1, d2], [1.0, 1.0], consensus=True, normalize=True, lambda_=1)
    assert torch.allclose(out, T([3.0, -1.0, 1.0]))


def test_dare_drops_at_random_and_rescales_to_the_l1_norm_reproducibly():
    delta = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    kept = methods.random_drop(delta, 0.3, rescale=True, generator=torch.Generator().manual_seed(1))
    assert (kept != 0).float().mean().item() == pytest.approx(0.3, abs=0.02)
    assert kept.abs().sum().item() == pytest.approx(delta.abs().sum().item(), rel=1e-5)
    again = methods.random_drop(delta, 0.3, rescale=True, generator=torch.Generator().manual_seed(1))
    assert torch.equal(kept, again)
    plain = methods.random_drop(delta, 0.3, rescale=False, generator=torch.Generator().manual_seed(1))
    assert torch.equal(plain, delta * (kept != 0))


def test_model_stock_interpolates_by_the_angle_of_the_task_vectors():
    base = T([0.0, 0.0])
    assert torch.allclose(methods.model_stock(base, [T([1.0, 0.0]), T([0.0, 1.0])], False), base)  # cos 0: t 0
    assert torch.allclose(methods.model_stock(base, [T([1.0, 1.0]), T([1.0, 1.0])], False), T([1.0, 1.0]))  # t 1
    cos = 1 / math.sqrt(2)
    t = 2 * cos / (1 + cos)
    got = methods.model_stock(base, [T([1.0, 0.0]), T([1.0, 1.0])], False)
    assert torch.allclose(got, t * T([1.0, 0.5]))


def test_magnitude_keeps_at_least_one_entry_and_model_stock_keeps_the_base_where_t_is_undefined():
    """mergekit's edges: int(density * n) of 0 keeps the largest entry; opposed task vectors
    (1 + (N - 1) cos = 0) give the base, not inf."""
    assert torch.equal(methods.magnitude(T([1.0, -3.0, 2.0]), 0.1, rescale=False), T([0.0, -3.0, 0.0]))
    base = T([1.0, 1.0])
    assert torch.equal(methods.model_stock(base, [T([2.0, 1.0]), T([0.0, 1.0])], False), base)


# ---- recipes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ({"merge_method": "frankenmerge", "models": [{"model": "a"}]}, "is not one of"),
        ({"merge_method": "tie", "models": [{"model": "a"}]}, "did you mean 'ties'"),
        ({"merge_methd": "ties", "models": [{"model": "a"}]}, "unknown key 'merge_methd'; did you mean 'merge_method'"),
        ({"models": [{"model": "a"}]}, "no merge_method; add one of linear"),
        ({"merge_method": "ties", "models": [{"model": "a"}]}, "needs 'base_model'"),
        ({"merge_method": "slerp", "base_model": "a", "models": [{"model": "b"}]}, "needs parameters.t"),
        ({"merge_method": "linear", "slices": []}, "'slices'"),
        ({"merge_method": "linear", "models": [{"model": "a", "parameters": {"weight": [0.1, 0.9]}}]}, "per-layer"),
        (
            {"merge_method": "ties", "base_model": "a", "models": [{"model": "b", "parameters": {"density": 0}}]},
            "(0, 1]",
        ),
        ({"merge_method": "model_stock", "base_model": "a", "models": [{"model": "b"}]}, "at least two"),
        ({"merge_method": "linear", "models": [{"model": "a", "parameters": {"wieght": 1}}]}, "unknown parameter"),
        (  # it wrote an all-NaN model, and said it merged
            {"merge_method": "linear", "models": [{"model": m, "parameters": {"weight": w}} for m, w in OPPOSED]},
            "weights sum to 0, and linear with normalize (the default) divides by their sum",
        ),
        ({"merge_method": "linear", "models": [{"model": "a", "parameters": {"weight": math.inf}}]}, "finite number"),
    ],
)
def test_a_bad_recipe_is_refused_naming_the_key(recipe, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        read_recipe(recipe)


def test_method_wide_parameters_of_the_wrong_type_are_refused_before_any_model_loads():
    """t: half crashed in float() once every input had loaded; normalize: "false" merged as true."""
    slerp = {"merge_method": "slerp", "base_model": "a", "models": [{"model": "b"}]}
    ties = {"merge_method": "ties", "base_model": "a", "models": [{"model": "b"}]}
    for recipe, bad in [
        (slerp, {"t": "half"}),
        (ties, {"lambda": "x"}),
        (ties, {"lambda": math.nan}),
        (ties, {"seed": "abc"}),
        (ties, {"seed": 1.5}),
        (ties, {"seed": math.inf}),
        (ties, {"normalize": "false"}),
        (ties, {"rescale": 1}),
    ]:
        [(name, value)] = bad.items()
        with pytest.raises(ConfigError, match=rf"parameters\.{name} must be .*, not {re.escape(repr(value))}$"):
            read_recipe({**recipe, "parameters": {"t": 0.5, **bad}})
    assert read_recipe({**ties, "parameters": {"lambda": 1, "seed": 3, "normalize": False}}).param("lambda", 0) == 1


def test_the_base_listed_under_models_spelt_otherwise_is_the_base(tmp_path, monkeypatch):
    """`runs/base/` or `./runs/base` under models, `runs/base` as base_model: compared as strings, the
    base was merged as one more model (model_stock's ratio silently changed; slerp refused)."""
    monkeypatch.chdir(tmp_path)
    others = [{"model": "ft1"}, {"model": "ft2"}]
    stock = read_recipe({"merge_method": "model_stock", "base_model": "base", "models": [{"model": "base/"}, *others]})
    assert [m.path for m in stock.others()] == ["ft1", "ft2"]
    slerp = {"merge_method": "slerp", "base_model": "base", "parameters": {"t": 0.5}}
    assert [m.path for m in read_recipe({**slerp, "models": [{"model": "./base"}, *others[:1]]}).others()] == ["ft1"]
    base = str(tmp_path / "base")
    linear = read_recipe({"merge_method": "linear", "base_model": base, "models": [{"model": "base"}]})
    assert [m.path for m in linear.models] == [base]


def test_an_empty_recipe_file_or_a_run_directory_is_refused_naming_it(tmp_path):
    empty = tmp_path / "recipe.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError) as exc:
        read_recipe(empty)
    assert f"{empty}: the recipe is empty" in str(exc.value) and "merge_method None" not in str(exc.value)
    with pytest.raises(ConfigError, match="is a directory, not a recipe file; .* add --method average"):
        read_recipe(tmp_path)
    with pytest.raises(ConfigError, match="recipe file '.*nosuch.yaml' does not exist"):
        read_recipe(tmp_path / "nosuch.yaml")


def test_a_model_path_that_is_no_model_is_refused_naming_the_recipe_and_its_key(tmp_path, capsys):
    """The path alone was named before: in a recipe of several models, which entry was left to find."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"merge_method: ties\nbase_model: {tmp_path / 'base'}\nmodels:\n  - model: {tmp_path / 'gone'}\n")
    (tmp_path / "base").mkdir()
    with pytest.raises(CheckpointError, match=rf"^{recipe}: base_model: '{tmp_path / 'base'}' is neither a run"):
        merge(recipe, tmp_path / "out")
    assert main(["merge", str(recipe), "--out", str(tmp_path / "out")]) == 2
    assert f"{recipe}: base_model: " in capsys.readouterr().err


def test_a_damaged_generation_config_is_refused_naming_it_before_any_input_loads(tmp_path):
    """A generation_config.json cut short by an interrupted download: a JSONDecodeError traceback
    once the whole merge was done (and from train.init_from), where config.json's was named."""
    from trimtab.hf.importer import source_record

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")  # no weights: loading it would fail otherwise
    (hf_dir / "generation_config.json").write_text('{"bos_token_id": 1, "eos')
    recipe = {"merge_method": "linear", "models": [{"model": str(hf_dir)}, {"model": str(tmp_path / "b")}]}
    said = rf"{hf_dir / 'generation_config.json'}: unreadable \(.*\); it is damaged or incomplete.*download it again"
    with pytest.raises(ConfigError, match=rf"^the recipe: models\[0\].model: {said}"):
        merge(recipe, tmp_path / "out")
    with pytest.raises(ConfigError, match=said):
        source_record(hf_dir, torch.float32)


def test_averaging_a_recipe_file_or_a_hugging_face_directory_says_what_it_is(tmp_path):
    """ "neither a run directory" and "0 valid checkpoints" before, after importing the whole model."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("merge_method: linear\n")
    with pytest.raises(ConfigError, match="is a file; --method average takes a run directory; a recipe file takes no"):
        average(recipe, 2, tmp_path / "out")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    with pytest.raises(
        ConfigError, match="'.*hf' is a Hugging Face model directory: one set of weights, no checkpoints"
    ):
        average(hf_dir, 2, tmp_path / "out")


def test_an_out_that_is_a_file_or_not_empty_is_refused_before_the_inputs_load(tmp_path):
    """Refused only after the whole merge (a NotADirectoryError traceback for a file)."""
    recipe = {"merge_method": "linear", "models": [{"model": str(tmp_path / "nosuch")}]}  # loading it would fail
    (tmp_path / "a.txt").write_text("notes")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    for out, said in (("a.txt", "is a file"), ("a.txt/m", "lies under a file"), ("full", "exists and is not empty")):
        with pytest.raises(ConfigError, match=f"^--out '.*{out}' {said}"):
            merge(recipe, tmp_path / out)
        with pytest.raises(ConfigError, match=f"^--out '.*{out}' {said}"):
            average(tmp_path / "nosuch", 1, tmp_path / out)


def test_an_out_in_a_runs_checkpoints_folder_is_refused_naming_the_run_and_a_fix(tmp_path):
    """`--out RUN/checkpoints/x` was accepted: a merged model there could be read as a checkpoint of
    that run (resumed from, averaged: step_N) or clobber one."""
    recipe = {"merge_method": "linear", "models": [{"model": str(tmp_path / "nosuch")}]}  # loading it would fail
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "config.yaml").write_text("preset: debug\n")
    for out in ("checkpoints/x", "checkpoints/step_000009", "checkpoints/step_000002/m"):
        where, at = re.escape(str(run / out)), re.escape(str(run))
        said = f"^--out '{where}' lies in the checkpoints folder of the run {at} .* e.g. --out {at}-merged$"
        with pytest.raises(ConfigError, match=said):
            merge(recipe, run / out)
        with pytest.raises(ConfigError, match=said):
            average(run, 1, run / out)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]


# ---- real runs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 3-step `debug` base and two 2-step finetunes of it (other seeds, other data order)."""
    root = tmp_path_factory.mktemp("merge")
    api.train(preset="debug", out=str(root / "base"), train={"max_steps": 3, "eval_every": 0}, **FAST)
    for name, seed in (("ft1", 1), ("ft2", 2)):
        train = {"max_steps": 2, "eval_every": 0, "seed": seed, "init_from": str(root / "base")}
        api.train(preset="debug", out=str(root / name), train=train, **FAST)
    return root


def weights_of(run):
    return api.load_run(run)[1].state_dict()


def test_a_linear_merge_is_a_run_that_generates_trains_and_exports(runs, tmp_path):
    recipe = {
        "merge_method": "linear",
        "models": [{"model": str(runs / "ft1"), "parameters": {"weight": 1}}, {"model": str(runs / "ft2")}],
    }
    out = merge(recipe, tmp_path / "merged")
    a, b, m = weights_of(runs / "ft1"), weights_of(runs / "ft2"), weights_of(out)
    for name in m:
        assert torch.allclose(m[name], (a[name] + b[name]) / 2, atol=1e-7), name
    assert api.generate(out, "def ", 8, temperature=0)  # generates
    ft = api.train(
        preset="debug",
        out=str(tmp_path / "ft3"),
        train={"max_steps": 2, "eval_every": 0, "init_from": str(out)},
        **FAST,
    )
    assert ft["step"] == 2
    assert main(["export", str(out), "--out", str(tmp_path / "hf")]) == 0


def test_ties_splits_q_k_v_as_mergekit_sees_them(runs, tmp_path):
    recipe = {
        "merge_method": "ties",
        "base_model": str(runs / "base"),
        "models": [
            {"model": str(runs / "ft1"), "parameters": {"weight": 0.7, "density": 0.5}},
            {"model": str(runs / "ft2"), "parameters": {"weight": 0.3, "density": 0.5}},
        ],
    }
    m = weights_of(merge(recipe, tmp_path / "ties"))
    base, a, b = weights_of(runs / "base"), weights_of(runs / "ft1"), weights_of(runs / "ft2")
    name = "blocks.0.attn.qkv.weight"
    cfg = api.load_run(runs / "base")[0].model
    parts = [split_qkv(w[name], cfg.n_heads, cfg.n_kv_heads) for w in (m, base, a, b)]
    for p_m, p_base, p_a, p_b in zip(*parts):  # q, k, v: each its own unit
        expect = methods.task_arithmetic(
            p_base,
            [methods.magnitude(x - p_base, 0.5, False) for x in (p_a, p_b)],
            [0.7, 0.3],
            consensus=True,
            normalize=True,
            lambda_=1.0,
        )
        assert torch.allclose(p_m, expect)


def test_moe_experts_merge_as_transformers_fuses_them_and_mismatches_are_refused(runs, tmp_path):
    """A layer's experts are one unit (gate and up together, down apart: transformers 5's
    gate_up_proj and down_proj, as mergekit 0.1.5 merges them); per_expert merges each apart."""
    root = tmp_path
    api.train(preset="debug-moe", out=str(root / "m1"), train={"max_steps": 2, "eval_every": 0}, **FAST)
    api.train(preset="debug-moe", out=str(root / "m2"), train={"max_steps": 2, "eval_every": 0, "seed": 5}, **FAST)
    recipe = {"merge_method": "slerp", "base_model": str(root / "m1"), "models": [{"model": str(root / "m2")}]}
    out = merge({**recipe, "parameters": {"t": 0.3}}, root / "slerp")
    apart = merge({**recipe, "parameters": {"t": 0.3, "per_expert": True}}, root / "apart")
    a, b, m, p = weights_of(root / "m1"), weights_of(root / "m2"), weights_of(out), weights_of(apart)
    [i] = [n.split(".")[1] for n in m if n.endswith("ffn.w1")][:1]
    w1, w3, w2 = (f"blocks.{i}.ffn.{n}" for n in ("w1", "w3", "w2"))
    gate_up = [torch.cat([x[w1].mT, x[w3].mT], 1) for x in (a, b, m)]  # [E, 2H, D]
    assert torch.allclose(gate_up[2], methods.slerp(0.3, gate_up[0], gate_up[1]), atol=1e-6)
    assert torch.allclose(m[w2].mT, methods.slerp(0.3, a[w2].mT, b[w2].mT), atol=1e-6)
    for name in (w1, w3, w2):
        for e in range(a[name].shape[0]):
            assert torch.allclose(p[name][e], methods.slerp(0.3, a[name][e], b[name][e]), atol=1e-6)
    bad = {"merge_method": "linear", "models": [{"model": str(runs / "ft1")}, {"model": str(root / "m1")}]}
    with pytest.raises(ConfigError, match=r"tensor 'blocks\.\d\.ffn\.\w+'"):
        merge(bad, root / "bad")


def test_averaging_the_last_checkpoints_is_their_mean(tmp_path):
    run = tmp_path / "run"
    train = {"max_steps": 6, "eval_every": 0}
    api.train(preset="debug", out=str(run), train=train, checkpoint={"every": 2, "keep": 4}, **FAST)
    last = list_checkpoints(run)[-3:]
    assert [p.name for p in last] == ["step_000002", "step_000004", "step_000006"]
    out = average(run, 3, tmp_path / "avg")
    got = load_file(list_checkpoints(out)[0] / "model.safetensors")
    tensors = [load_file(p / "model.safetensors") for p in last]
    for name, value in got.items():
        assert torch.allclose(value, sum(t[name] for t in tensors) / 3, atol=1e-7), name
    state = json.loads((list_checkpoints(out)[0] / "state.json").read_text())  # the newest one's tokens (it recorded 0)
    assert state["tokens"] == json.loads((last[-1] / "state.json").read_text())["train"]["tokens"] > 0
    with pytest.raises(CheckpointError, match="fewer than --last 9"):
        average(run, 9, tmp_path / "avg9")


def test_averaging_leaves_out_step_0_and_checkpoints_saved_unhealthy_and_names_them(tokenizer, tmp_path, caplog):
    """`--last 2` of a run with checkpoints at steps 0 and 20 averaged the random initialisation
    in; one the orchestrator did not call healthy (state.json "good": false) was averaged too."""
    import dataclasses
    import logging

    from hf_helpers import write_run
    from trimtab.checkpoint import save_checkpoint
    from trimtab.config import load_config
    from trimtab.model import build_model

    model = build_model(dataclasses.replace(load_config(preset="debug").model, vocab_size=tokenizer.vocab_size))
    run = write_run(tmp_path / "run", model, tokenizer)  # step 0
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for step, good in ((2, True), (4, False), (6, True)):
        weights = {k: v + 1 for k, v in weights.items()}
        save_checkpoint(run, step, weights, {}, {"moe": {}, "mod": {}, "tokens": step, "good": good}, keep=9)
    with caplog.at_level(logging.WARNING):
        out = average(run, 2, tmp_path / "avg")
    assert "left out of the average: step 4 (saved while the run was not healthy" in caplog.text
    assert json.loads((list_checkpoints(out)[0] / "state.json").read_text())["merge"]["steps"] == [2, 6]
    name = "norm.weight"
    assert torch.allclose(load_file(list_checkpoints(out)[0] / "model.safetensors")[name], model.state_dict()[name] + 2)
    with pytest.raises(
        CheckpointError,
        match=r"has 2 checkpoints to average \(steps 2, 6\), fewer than --last 3; "
        r"left out: step 0 \(the weights before the first step\); step 4 ",
    ):
        average(run, 3, tmp_path / "avg3")


def test_training_into_a_merged_directory_points_to_init_from(runs, tmp_path, capsys):
    recipe = {"merge_method": "linear", "models": [{"model": str(runs / "ft1")}, {"model": str(runs / "ft2")}]}
    out = merge(recipe, tmp_path / "merged")
    flags = ["--set", "log.progress=false", "--set", "data.max_bytes=150000"]
    assert main(["train", "--preset", "debug", "--out", str(out), "--max-steps", "4", *flags]) == 2
    assert f"train.init_from={out}" in capsys.readouterr().err


def test_the_hint_to_train_on_a_merged_model_names_a_run_directory_of_its_own(tmp_path, capsys, monkeypatch):
    """Issue #30: without --out the hinted command trained into runs/<preset>, a finished run; and
    without the merged run's config.yaml, into the default preset's model, which its weights do
    not fit. --last belongs to --method average: with a recipe it is refused, not ignored."""
    import trimtab.merge

    out = tmp_path / "merged"
    monkeypatch.setattr(trimtab.merge, "merge", lambda source, dest: dest)
    assert main(["merge", "recipe.yaml", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    hint = f"trimtab train {out / 'config.yaml'} --set train.init_from={out} --out {tmp_path / 'merged-train'};"
    assert hint in printed, printed
    assert main(["merge", "recipe.yaml", "--out", str(out), "--last", "2"]) == 2
    assert "--last is for --method average" in capsys.readouterr().err


def test_merging_or_averaging_runs_of_a_hugging_face_model_keeps_its_class_ids_and_dtype(tokenizer, tmp_path):
    """Only a Hugging Face directory input passed on its record (hf_source.json): two fine-tunes of
    a bf16 Llama merged, or one's checkpoints averaged, exported with no bos_token_id, trimtab's
    generation_config and fp32."""
    import dataclasses

    from hf_helpers import write_run
    from trimtab.config import load_config
    from trimtab.hf import export_run
    from trimtab.model import build_model

    model = build_model(dataclasses.replace(load_config(preset="debug").model, vocab_size=tokenizer.vocab_size))
    ids = {"bos_token_id": 0, "eos_token_id": 1}
    config = {"architectures": ["LlamaForCausalLM"], **ids}
    record = {"path": "/models/llama", "config": config, "dtype": "bfloat16", "generation_config": ids}
    for name in ("ft1", "ft2"):  # as `train.init_from: a bf16 Llama directory` leaves them
        (write_run(tmp_path / name, model, tokenizer) / "hf_source.json").write_text(json.dumps(record))
    recipe = {"merge_method": "linear", "models": [{"model": str(tmp_path / n)} for n in ("ft1", "ft2")]}
    averaged = average(tmp_path / "ft1", 1, tmp_path / "a")  # the run's dtype; a recipe's is its own (float32)
    for merged, dtype in ((merge(recipe, tmp_path / "m"), "float32"), (averaged, "bfloat16")):
        out = export_run(merged, tmp_path / f"{merged.name}-hf")
        config = json.loads((out / "config.json").read_text())
        assert (config["architectures"], config["bos_token_id"], config["dtype"]) == (["LlamaForCausalLM"], 0, dtype)
        assert json.loads((out / "generation_config.json").read_text()) == ids
        card = (out / "README.md").read_text()  # what it is made of, not the first input's data
        assert "- merged: linear of `" in card or "- merged: the average of checkpoints 0 of `" in card


def test_an_input_holding_nan_is_refused_naming_it_and_its_tensor(runs, tmp_path, monkeypatch):
    """A Hugging Face file damaged past its header loads (no checksum): its NaN made a merge of perplexity nan."""
    import importlib

    module = importlib.import_module("trimtab.merge.merge")
    read, damaged = module.load_run_at, str(runs / "ft2")

    def load_damaged(path):
        cfg, model, tok, step = read(path)
        if path == damaged:
            with torch.no_grad():
                model.state_dict()["tok_emb.weight"][0, :3] = float("nan")
        return cfg, model, tok, step

    monkeypatch.setattr(module, "load_run_at", load_damaged)
    recipe = {"merge_method": "linear", "models": [{"model": str(runs / "ft1")}, {"model": damaged}]}
    with pytest.raises(CheckpointError, match=rf"{re.escape(damaged)}: tensor 'tok_emb.weight' holds 3 non-finite"):
        merge(recipe, tmp_path / "merged")
    assert not (tmp_path / "merged" / "config.yaml").exists()
