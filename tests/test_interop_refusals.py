"""Refusals found by soaking the Hugging Face in/out paths as a user runs them: a merge of models that
are not one architecture names both inputs and what to merge instead; an lm-eval task whose dataset
cannot be fetched (no network, HF_HUB_OFFLINE=1) is one line naming the way out, not a traceback."""

import pytest
import torch

from trimtab.checkpoint import save_checkpoint
from trimtab.cli import main
from trimtab.config import ModelConfig, RunConfig, dump_config
from trimtab.config.sparse import MoEConfig
from trimtab.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")
DENSE = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64, "vocab_size": 300}


def _run(path, tok, **settings):
    """A run directory holding an untrained model of DENSE with `settings` as checkpoint 0."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**DENSE, **settings}).resolved())
    cfg = RunConfig(model=model.cfg, out=str(path))
    cfg.data.seq_len = 64
    path.mkdir(parents=True)
    dump_config(cfg, path / "config.yaml")
    tok.save(path / "tokenizer.json")
    state = {"moe": model.moe_state(), "mod": model.mod_state(), "tokens": 0}
    save_checkpoint(path, 0, model.state_dict(), {}, state, keep=1)
    return path


@pytest.fixture
def tok(tokenizer):
    return tokenizer


@pytest.mark.parametrize(
    "other, found",
    [
        ({"d_model": 48}, "tensor 'blocks.0.attn.qkv.weight' has shape [64, 32] in {a}, [96, 48] in {b}"),
        (
            {"layer_pattern": ["dense", "moe"], "moe": MoEConfig(n_experts=4, top_k=2)},
            "tensor 'blocks.1.ffn.expert_bias' is in {b}, not in {a}",
        ),
    ],
    ids=["width", "moe"],
)
def test_a_merge_of_two_architectures_names_both_inputs_and_what_to_merge_instead(tmp_path, tok, capsys, other, found):
    """They were refused as "tensor 'blocks.0.attn.qkv.weight': shape [64, 32] in a vs [96, 48] in b"
    and "tensor ... is missing from a: the models are not one architecture", naming no way out."""
    a, b = _run(tmp_path / "a", tok), _run(tmp_path / "b", tok, **other)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"merge_method: linear\nmodels:\n  - model: {a}\n  - model: {b}\n")
    assert main(["merge", str(recipe), "--out", str(tmp_path / "m")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{a} and {b} are not one architecture: " + found.format(a=a, b=b) in err
    assert "merge only fine-tunes of one base model (each trained from it with --set train.init_from=BASE" in err
    assert not (tmp_path / "m").exists()


def test_a_task_whose_dataset_cannot_be_fetched_is_one_line_naming_the_way_out(tmp_path, tok, capsys):
    """What datasets raises for a Hub dataset offline (ConnectionError: "Couldn't reach 'Rowan/hellaswag' on
    the Hub (OfflineModeIsEnabled)") went out as a 72-line traceback, exit 1."""
    pytest.importorskip("lm_eval")
    run = _run(tmp_path / "run", tok)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "utils.py").write_text(
        "def load(**kwargs):\n"
        "    raise ConnectionError(\"Couldn't reach 'someone/remote_set' on the Hub (OfflineModeIsEnabled)\")\n"
    )
    (tasks / "remote_task.yaml").write_text(
        "task: remote_task\ncustom_dataset: !function utils.load\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    assert main(["eval", str(run), "--tasks", "remote_task", "--include-path", str(tasks), "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "--tasks remote_task: a task's dataset could not be fetched (Couldn't reach 'someone/remote_set'" in err
    assert "or use a task with local data: trimtab's own (trimtab_tiny, trimtab_tiny_gen, trimtab_tiny_ppl)" in err
