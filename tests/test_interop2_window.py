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
