"""An imported Mistral whose sliding window capped trimtab's context goes back out with its window
and its positions (hf/architectures.py window_back)."""

import json
import warnings

import pytest
import torch

from trimtab import api
from trimtab.hf import export_run
from trimtab.hf.importer import SOURCE, source_record

pytestmark = pytest.mark.usefixtures("one_thread")


def test_an_imported_mistral_exports_with_its_sliding_window(tmp_path):
    """A Mistral with a 16-token window over 64 positions imports as a 16-token context (the same
    function there); its export said max_position_embeddings 16 and no window, so transformers
    attended over all of a 40-token input, which the model it came from does not."""
    from hf_helpers import hf_load, llama_style_tokenizer, transformers, write_run

    settings = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    config = transformers.MistralConfig(
        vocab_size=300, num_hidden_layers=2, max_position_embeddings=64, sliding_window=16, **settings
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.MistralForCausalLM(config).eval()
        theirs.save_pretrained(tmp_path / "hf")
    llama_style_tokenizer().save_pretrained(tmp_path / "hf")
    cfg, model, tok = api.load_run(tmp_path / "hf")
    assert cfg.model.max_seq_len == 16
    run = write_run(tmp_path / "run", model, tok)  # the run train.init_from starts (step 0)
    (run / SOURCE).write_text(json.dumps(source_record(tmp_path / "hf", torch.float32)))
    out = export_run(run, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert (config["sliding_window"], config["max_position_embeddings"]) == (16, 64)
    x = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf_load(out)(x).logits - theirs(x).logits).abs().max().item() <= 1e-4


def test_a_window_wider_than_the_context_goes_back_out_as_it_came(tmp_path, tokenizer):
    """A Mistral whose sliding_window (4096) is wider than its positions (128) never windows there, and
    imports as full attention; its export said sliding_window null: the round trip lost the model's own
    value. Kept now (over 128 positions it changes nothing). The Mistral is a debug model's Llama export,
    made one by its config."""
    import dataclasses

    from hf_helpers import write_run
    from trimtab.config import load_config
    from trimtab.model import build_model

    model = build_model(dataclasses.replace(load_config(preset="debug").model, vocab_size=tokenizer.vocab_size))
    hf = export_run(write_run(tmp_path / "base", model, tokenizer), tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096}
    (hf / "config.json").write_text(json.dumps(config | mistral))
    _, model, tok = api.load_run(hf)
    assert model.cfg.max_seq_len == config["max_position_embeddings"] == 128  # the window caps nothing
    run = write_run(tmp_path / "run", model, tok)
    (run / SOURCE).write_text(json.dumps(source_record(hf, torch.float32)))
    out = json.loads((export_run(run, tmp_path / "out") / "config.json").read_text())
    assert (out["sliding_window"], out["max_position_embeddings"]) == (4096, 128)
