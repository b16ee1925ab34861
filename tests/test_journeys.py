"""A user's model-in / model-out journeys end to end with real files: what transformers makes of
an export, beyond its logits."""

import dataclasses
import logging
import warnings

import pytest
import torch

from hf_helpers import write_run
from trimtab.config import load_config
from trimtab.errors import CheckpointError
from trimtab.hf import export_run
from trimtab.model import build_model

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (parity reference)")
pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "def f(x):\n    return x * 3\n"


def biased_model(tok):
    """A debug model with q/k/v biases: only Qwen2ForCausalLM computes it."""
    cfg = load_config(preset="debug").model
    cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size, max_seq_len=64, attn_bias=True)
    torch.manual_seed(0)
    return build_model(cfg).eval()


def test_a_qwen2_export_of_another_tokenizer_warns_that_autotokenizer_splits_otherwise(tokenizer, tmp_path, caplog):
    """transformers loads every qwen2 tokenizer as Qwen2Tokenizer, which rebuilds the
    pre-tokenizer as Qwen's: trimtab's own then tokenized otherwise there, and export said nothing."""
    with caplog.at_level(logging.WARNING, logger="trimtab.hf.export"):
        out = export_run(write_run(tmp_path / "run", biased_model(tokenizer), tokenizer), tmp_path / "hf")
    assert "Qwen2ForCausalLM" in (out / "config.json").read_text()
    assert "PreTrainedTokenizerFast.from_pretrained(DIR), not AutoTokenizer" in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = transformers.AutoTokenizer.from_pretrained(out)
        fast = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    ours = tokenizer.encode(TEXT)
    assert auto(TEXT, add_special_tokens=False)["input_ids"] != ours  # the reason for the warning
    assert fast(TEXT, add_special_tokens=False)["input_ids"] == ours  # the way out it names


def test_a_llama_export_warns_of_nothing(tokenizer, tmp_path, caplog):
    model = dataclasses.replace(biased_model(tokenizer).cfg, attn_bias=False)
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="trimtab.hf.export"):
        export_run(write_run(tmp_path / "run", build_model(model).eval(), tokenizer), tmp_path / "hf")
    assert "AutoTokenizer" not in caplog.text


def test_exporting_a_hugging_face_directory_says_it_is_one(tmp_path, tokenizer):
    """ "not a run directory (no config.yaml)" before, for a directory with a config.json."""
    run = write_run(tmp_path / "run", biased_model(tokenizer), tokenizer)
    out = export_run(run, tmp_path / "hf")
    with pytest.raises(CheckpointError, match=r"'.*hf' is a Hugging Face model directory already.*train.init_from"):
        export_run(out, tmp_path / "again")
