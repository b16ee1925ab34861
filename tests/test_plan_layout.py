"""The parallel layout `trimtab plan --gpu H100 --gpus N` proposes (plan/layout.py): it fits,
it is the fastest of what was tried, it runs (the settings validate and the mesh accepts them),
and what does not fit says why."""

import json
from dataclasses import replace

import pytest
import torch

from helpers import freeze_heap
from trimtab.cli import main
from trimtab.config import load_config
from trimtab.config.distributed import check_moe_split
from trimtab.distributed.mesh import Mesh
from trimtab.distributed.splits import check_tensor_parallel
from trimtab.model.catalog import preset_catalog
from trimtab.plan.layout import plan_layout
from trimtab.plan.layout_text import format_layout
from trimtab.plan.memory import USABLE_FRACTION, named_gpu
from trimtab.plan.traffic import BUS_EFFICIENCY

LARGE = [entry.name for entry in preset_catalog() if entry.total >= 1e9]


@pytest.mark.parametrize("preset", LARGE)
def test_every_large_preset_gets_a_layout_that_fits_and_runs_or_a_reason(preset):
    cfg = load_config(preset=preset)
    for gpus in (8, 64, 512):
        hw = named_gpu("H100", gpus)
        plan = plan_layout(cfg, hw)
        if plan.best is None:
            assert plan.reasons or plan.candidates, preset
            assert plan.gpus_needed is None or plan.gpus_needed > gpus
            continue
        b = plan.best
        assert b.pp * b.tp * b.dp == gpus
        assert b.memory_bytes <= hw.memory_bytes * USABLE_FRACTION
        assert b.micro_batch_tokens % cfg.data.seq_len == 0
        assert b.micro_batch_tokens * b.accumulation >= cfg.train.batch_tokens // b.dp
        assert all(b.step_s <= c.step_s for c in plan.candidates if c.fits)
        run = load_config(preset=preset, sets=b.settings())  # the proposal is a valid config ...
        Mesh.of(run.distributed, gpus)  # ... the mesh accepts at this world size ...
        model = replace(run.model, vocab_size=run.data.bpe_vocab_size)
        if b.tp > 1:  # ... and the model splits
            check_tensor_parallel(model, b.tp)
        check_moe_split(model, b.tp, b.ep)


def test_a_70b_dense_model_on_64_gpus_is_sharded_and_split_inside_nodes():
    plan = plan_layout(load_config(preset="dense-70b"), named_gpu("H100", 64))
    b = plan.best
    assert b.strategy == "fsdp" and b.tp in (1, 2, 4, 8)
    ddp = [c for c in plan.candidates if c.strategy == "ddp"]
    assert ddp == [] or not any(c.fits for c in ddp)  # 16 bytes x 70B replicated cannot fit
    assert {c.tp for c in plan.candidates} == {1, 2, 4, 8}


def test_tensor_parallel_traffic_is_the_analytical_volume():
    """4 collectives forward and 4 backward per layer and 4 for the embedding and final norm,
    each (tp-1)/tp of the [tokens, D] activations at 2 bytes (bf16), over NVLink at
    BUS_EFFICIENCY."""
    cfg = load_config(preset="dense-7b")
    plan = plan_layout(cfg, named_gpu("H100", 8))
    eager = next(c for c in plan.candidates if c.tp == 8 and c.checkpointing == "off")
    m = cfg.model
    per_collective = (8 - 1) / 8 * cfg.train.batch_tokens * m.d_model * 2 / (450e9 * BUS_EFFICIENCY)
    assert eager.tp_comm_s == pytest.approx(per_collective * (m.n_layers * 8 + 4))
    for mode in ("selective", "full"):  # a block's re-run gathers and scatters again, all but the last
        recompute = next(c for c in plan.candidates if c.tp == 8 and c.checkpointing == mode)
        assert recompute.tp_comm_s == pytest.approx(per_collective * (m.n_layers * 11 + 4))


def test_a_model_that_fits_nowhere_says_what_would_split_it(tmp_path, capsys):
    # 16 bytes of state per parameter: 316B parameters over 64 GPUs is 74 GiB each before any activation
    plan = plan_layout(load_config(preset="moe-300b"), named_gpu("H100", 64))
    assert plan.best is None and plan.gpus_needed == 128 and not plan.reasons
    main(["plan", "--preset", "hybrid-300b", "--gpu", "H100", "--gpus", "64", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "nothing fits: about 128 GPUs would hold it" in out


def test_expert_parallelism_is_proposed_where_it_wins():
    """moe-7b on 64 GPUs: every ep size that divides the replicas and the experts is tried, with
    its all-to-all cost and a smaller gathered block."""
    cfg = load_config(preset="moe-7b")
    plan = plan_layout(cfg, named_gpu("H100", 64))
    by = {(c.tp, c.ep, c.checkpointing): c for c in plan.candidates if c.pp == 1}
    assert {c.ep for c in plan.candidates} >= {1, 2, 4, 8}
    one, eight = by[(1, 1, "off")], by[(1, 8, "off")]
    m = cfg.model
    rows = cfg.train.batch_tokens // 64 * m.moe.top_k * m.d_model * 2  # a replica's routed rows, bf16
    moe_layers = sum("moe" in kind for kind in m.layers)
    volume = 7 / 8 * rows * moe_layers * 4  # dispatch + combine, forward and backward
    assert eight.ep_comm_s == pytest.approx(volume / (450e9 * BUS_EFFICIENCY)) and one.ep_comm_s == 0
    four = by[(1, 4, "off")]  # every weight is FSDP-sharded 64 ways (experts: 8 ways x 8 copies) ...
    assert eight.strategy == four.strategy == "fsdp" and four.state_bytes == eight.state_bytes
    assert four.buffer_bytes > eight.buffer_bytes  # ... and a GPU gathers 1 / ep of a block's experts
    assert "distributed.ep=8" in eight.settings() and "distributed.ep=1" not in " ".join(one.settings())
    text = "\n".join(format_layout(plan, "trimtab train --preset moe-7b"))
    assert "expert parallel: ep=" in text and "  ep  strategy" in text
    # hybrid-300b on 256 GPUs: 96 experts a block; only splitting them makes the state fit
    best = plan_layout(load_config(preset="hybrid-300b"), named_gpu("H100", 256)).best
    assert best.ep > 1 and best.ep_comm_s > 0 and f"distributed.ep={best.ep}" in best.settings()


def test_plan_command_prints_and_saves_the_layout(tmp_path, capsys):
    args = ["plan", "--preset", "dense-7b", "--gpu", "H100", "--gpus", "16", "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Parallel layout on 16 x H100" in out
    assert "torchrun --nnodes 2 --nproc_per_node 8 -m trimtab train --preset dense-7b" in out
    saved = json.loads((tmp_path / "plan.json").read_text())["layout"]
    best = saved["best"]
    assert saved["gpus"] == 16 and best["pp"] * best["tp"] * best["dp"] == 16
    assert len(saved["candidates"]) >= 4


def test_doctor_shows_the_layout_of_the_gpus_it_runs_on(monkeypatch, capsys):
    """On a machine with 8 H100s (faked: the GPU queries answer as such a machine would)."""
    from trimtab import doctor

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr("trimtab.plan.memory.detect_hardware", lambda **kw: named_gpu("H100", kw["devices"]))
    facts = doctor._layout(load_config(preset="dense-7b"), torch.device("cuda"))
    assert facts["gpus"] == 8 and facts["best"]["tp"] * facts["best"]["dp"] == 8
    assert any("Parallel layout on 8 x H100" in line for line in facts["text"])
    assert doctor._layout(load_config(preset="debug"), torch.device("cpu")) is None


def test_a_batch_too_small_for_every_replica_moves_gpus_into_tensor_parallelism():
    """small: 8,192 tokens a step are 32 rows; 512 GPUs cannot be 512 replicas, nor 128 with its
    4 layers as pipeline stages, but pp 4 x tp 4 leaves 32 (tests/test_presets2_plan.py: pp alone)."""
    plan = plan_layout(load_config(preset="small"), named_gpu("H100", 512))
    assert any(r.startswith("tp=1: 512 replicas would share train.batch_tokens") for r in plan.reasons)
    assert plan.best is not None and plan.best.tp >= 2 and plan.best.dp <= 32


def test_pipeline_stages_are_priced_by_their_bubble_and_sends():
    """dense-70b on 128 H100s: every stage count is tried; a layout with stages pays the 1F1B
    bubble ((pp - 1) / m of the compute) and each micro-batch's activations forward and
    gradients back over the network, and its settings launch it."""
    cfg = load_config(preset="dense-70b")
    plan = plan_layout(cfg, named_gpu("H100", 128))
    assert {c.pp for c in plan.candidates} == {1, 2, 4, 8, 16}
    for c in plan.candidates:
        assert c.bubble_s == pytest.approx(c.compute_s * (c.pp - 1) / max(c.accumulation, 1))
        sends = 2 * cfg.train.batch_tokens / c.dp * cfg.model.d_model * 2 / c.tp if c.pp > 1 else 0
        assert c.pp_comm_s == pytest.approx(sends / (50e9 * BUS_EFFICIENCY))
    staged = next(c for c in plan.candidates if c.pp == 4 and c.fits)
    assert "distributed.pp=4" in staged.settings()
    Mesh.of(load_config(preset="dense-70b", sets=staged.settings()).distributed, 128)
    assert "pipeline: pp=" in "\n".join(format_layout(plan, "trimtab train --preset dense-70b"))


@pytest.fixture
def fake_world():
    """A process group of `world` ranks inside this one process (torch's fake backend: no
    collective runs), for splitting a model as rank 0 of a mesh would."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("preset", "tp", "ep"), [("debug-moe", 2, 1), ("debug-moe", 2, 2), ("debug-mod", 2, 1), ("debug-hybrid", 2, 1)]
)
def test_the_planners_rank_parameters_are_what_tensor_parallelism_leaves_a_rank(fake_world, preset, tp, ep):
    """The norms, MoE routers and Mixture-of-Depths routers stay whole on every tensor-parallel
    rank, the routed experts split over tp x ep: the planner counts what the split model holds."""
    from torch.distributed.tensor import DTensor

    from trimtab.distributed.expert import apply_moe_parallel
    from trimtab.distributed.tensor import apply_tensor_parallel
    from trimtab.model.transformer import build_model
    from trimtab.plan.shape import rank_params

    cfg = load_config(preset=preset, sets=[f"model.vocab_size={load_config(preset=preset).data.bpe_vocab_size}"])
    fake_world(tp * ep)
    mesh = Mesh(dp=ep, tp=tp, ep=ep).build(torch.device("cpu"))
    model = build_model(cfg.model)
    apply_tensor_parallel(model, mesh["tp"])
    apply_moe_parallel(model, mesh)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    assert rank_params(cfg, tp, ep) == local
    assert rank_params(cfg) == sum(p.numel() for p in build_model(cfg.model).parameters())
    if ep == 1:  # one replica: 16 bytes a parameter the rank holds, and autocast's bf16 copies of the blocks'
        one = next(c for c in plan_layout(cfg, named_gpu("H100", tp)).candidates if (c.tp, c.pp) == (tp, 1))
        assert 16 * local < one.state_bytes < 18 * local


@pytest.mark.parametrize("preset", ["debug-mod", "debug-hybrid"])
@pytest.mark.parametrize("checkpointing", ["off", "selective"])
def test_a_mixture_of_depths_block_under_tp_keeps_its_heads_and_hidden_units_split(fake_world, preset, checkpointing):
    """A Mixture-of-Depths block runs on the whole sequence on every tensor-parallel rank, but
    its heads and hidden units are split like any block's: what rank 0 of TP=2 leaves for the
    backward (measured in one process; the fake collectives' buffers read ~2% high on the debug
    preset) is what plan/memory.py counts, where counting the block whole read 5-19% high."""
    from torch.distributed.tensor.parallel import loss_parallel

    from trimtab.distributed.tensor import apply_tensor_parallel
    from trimtab.model.recompute import measure_kept_bytes
    from trimtab.model.transformer import build_model
    from trimtab.plan.memory import kept_bytes_per_rank
    from trimtab.training.loss import cross_entropy_sum

    sets = ["model.vocab_size=512", "data.seq_len=64", "model.d_model=256", "model.n_heads=8", "model.n_kv_heads=2"]
    freeze_heap()  # measure_kept_bytes collects garbage 4 times
    cfg = load_config(preset=preset, sets=[*sets, "model.mod.warmup_steps=0"])
    fake_world(2)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.set_activation_checkpointing(checkpointing)
    mesh = Mesh(dp=1, tp=2).build(torch.device("cpu"))
    apply_tensor_parallel(model, mesh["tp"])
    if model.moe_layers():
        from trimtab.distributed.expert import apply_moe_parallel

        apply_moe_parallel(model, mesh)

    def loss(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return cross_entropy_sum(model.hidden(tokens), model.lm_head.weight, tokens)

    with loss_parallel():  # the vocabulary-parallel loss, forward and backward
        measured = measure_kept_bytes(model, loss, lambda rows: torch.randint(0, 512, (rows, 64)))
    estimate, _ = kept_bytes_per_rank(cfg, 2, checkpointing, 2, fused_norm=False)
    assert estimate == pytest.approx(measured, rel=0.035), (measured, estimate)
