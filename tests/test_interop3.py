"""A merged model's card names its inputs where they are, with the tokens each had seen; an export's
tokenizer says the positions its config says; export and merge say a corrupt checkpoint as the
checkpoint loader does; a BPE learns from a bounded sample, in bounded pieces, whatever the file."""

import dataclasses
import json
import logging

import pytest
import torch

from trimtab.checkpoint import list_checkpoints, save_checkpoint
from trimtab.config import load_config, read_saved
from trimtab.hf import export_run
from trimtab.hf.card import model_card
from trimtab.merge import average, merge
from trimtab.model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(path, model, tokenizer, steps, tokens_per_step=1000):
    """A run directory (hf_helpers.write_run's, step 0) with checkpoints at `steps` besides."""
    from hf_helpers import write_run

    write_run(path, model, tokenizer)
    for step in steps:
        state = {"moe": {}, "mod": {}, "train": {"tokens": step * tokens_per_step}, "good": True}
        save_checkpoint(path, step, model.state_dict(), {}, state, keep=9)
    return path


def _model(tokenizer):
    return build_model(dataclasses.replace(load_config(preset="debug").model, vocab_size=tokenizer.vocab_size))


def test_a_recipe_merges_card_names_its_inputs_where_they_are_with_their_tokens_seen(tmp_path, tokenizer, monkeypatch):
    """A merge of `a` and `b` (paths relative to where it ran) exported a card saying "tokens
    seen: 0" and `a`, `b`: a reader of the card could tell neither where nor how trained."""
    model = _model(tokenizer)
    _run(tmp_path / "a", model, tokenizer, [3])
    _run(tmp_path / "b", model, tokenizer, [5], tokens_per_step=2000)
    monkeypatch.chdir(tmp_path)
    out = merge({"merge_method": "linear", "models": [{"model": "a"}, {"model": "./b/"}]}, "m")
    state = json.loads((list_checkpoints(out)[0] / "state.json").read_text())
    card = model_card(out, read_saved(out), state, "LlamaForCausalLM", None)
    a, b = (tmp_path / "a").resolve(), (tmp_path / "b").resolve()
    assert f"- merged: linear of `{a}`, `{b}` (trimtab merge)\n" in card, card
    assert f"- input `{a}`: checkpoint step 3, 3,000 tokens seen\n" in card
    assert f"- input `{b}`: checkpoint step 5, 10,000 tokens seen\n" in card
    assert "tokens seen: none by the merge itself" in card and "tokens seen: 0" not in card
    assert f"- `{a}`: none recorded" in card  # its decisions, under the same name


def test_an_exported_windowed_models_tokenizer_says_its_positions(tmp_path, tokenizer):
    """A Mistral with a 16-token window over 64 positions, whose tokenizer_config.json gives no
    model_max_length: the export said max_position_embeddings 64 but model_max_length 16, so
    transformers (AutoTokenizer reads tokenizer_config.json's) truncated and warned at 16 tokens
    of a model that reads 64. The Mistral is a debug model's Llama export, made one by its config."""
    from hf_helpers import write_run
    from trimtab import api
    from trimtab.hf.importer import SOURCE, source_record

    hf = export_run(write_run(tmp_path / "base", _model(tokenizer), tokenizer), tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 16}
    (hf / "config.json").write_text(json.dumps(config | mistral | {"max_position_embeddings": 64}))
    settings = json.loads((hf / "tokenizer_config.json").read_text())
    del settings["model_max_length"]
    (hf / "tokenizer_config.json").write_text(json.dumps(settings))
    _, model, tok = api.load_run(hf)
    assert model.cfg.max_seq_len == 16  # the window caps trimtab's context
    run = write_run(tmp_path / "run", model, tok)
    (run / SOURCE).write_text(json.dumps(source_record(hf, torch.float32)))
    out = export_run(run, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert (config["max_position_embeddings"], config["sliding_window"]) == (64, 16)
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 64


def _flip(path):
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # a flipped bit: same size, other checksum
    path.write_bytes(bytes(data))


def _said(caplog):
    return [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]


def test_export_and_average_say_a_corrupt_checkpoint_once_as_the_loader_does(tmp_path, tokenizer, caplog):
    """Export said "skipping corrupt checkpoint: FILE: ..." and not what it used instead; an
    average said the newest corrupt one twice (the loader's line, then its own) and an older one
    its own way. Now each once, in the loader's words: the checkpoint, the file, what is done."""
    model = _model(tokenizer)
    run = _run(tmp_path / "run", model, tokenizer, [2, 4, 6])
    _flip(run / "checkpoints" / "step_000006" / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        export_run(run, tmp_path / "hf")
    (said,) = _said(caplog)
    assert said.startswith(f"skipping corrupt checkpoint {run}/checkpoints/step_000006 (")
    assert "step_000006/model.safetensors: size or checksum differs" in said
    assert said.endswith(f"falling back to {run}/checkpoints/step_000004 (step 4)")
    run2 = _run(tmp_path / "run2", model, tokenizer, [2, 4, 6])
    _flip(run2 / "checkpoints" / "step_000006" / "model.safetensors")
    _flip(run2 / "checkpoints" / "step_000002" / "model.safetensors")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        average(run2, 1, tmp_path / "avg")
    said = _said(caplog)
    assert len(said) == 2, said  # step 6 by the loader (load_run), step 2 by the average: once each
    assert said[0].startswith(f"skipping corrupt checkpoint {run2}/checkpoints/step_000006 (")
    assert said[1].startswith(f"skipping corrupt checkpoint {run2}/checkpoints/step_000002 (")
    assert said[1].endswith("; averaging step 4")


def test_a_bpe_learns_from_a_bounded_sample_in_bounded_pieces(monkeypatch):
    """A one-line JSON file is one document: its text went to the BPE trainer as one string, which
    it pre-tokenizes whole (1.6 GB for 20 MB), and all of it, unbounded but by the caller. The
    pieces are cut before words, so the tokenizer learnt is the whole string's."""
    from trimtab.data import tokenizer as tokenizers_
    from trimtab.data.sources import Document

    words = [f"w{i % 97}x{i % 13}" for i in range(60_000)]
    text = '[{"text": "' + " ".join(words) + '"}]'  # ~480 KB, no line end
    doc = Document([(text, True)])
    pieces = list(tokenizers_._training_texts([doc]))
    assert "".join(pieces) == text and len(pieces) > 1
    assert max(map(len, pieces)) <= tokenizers_.TRAIN_PIECE_CHARS
    monkeypatch.setattr(tokenizers_, "TRAIN_SAMPLE_BYTES", 100_000, raising=False)
    sample = "".join(tokenizers_._training_texts([doc, doc]))
    assert len(sample.encode()) == 100_000 and text.startswith(sample)
    monkeypatch.undo()
    small = tokenizers_.train_tokenizer([Document([(text[:100_000], True)])], 300)
    monkeypatch.setattr(tokenizers_, "TRAIN_PIECE_CHARS", 10**9)
    whole = tokenizers_.train_tokenizer([Document([(text[:100_000], True)])], 300)
    assert small.definition()["model"] == whole.definition()["model"]


def test_the_garbage_screen_does_not_encode_a_sample_too_small_to_judge(tmp_path, tokenizer, monkeypatch):
    """A one-line JSON file is one document, fewer than the screen needs to find a scale: its 8 MB
    sample was encoded whole all the same (1.1 GB, 12 s), for no scale (null)."""
    from trimtab.data import TextTokenizer, prepare
    from trimtab.data.shards import Options

    path = tmp_path / "one.json"
    path.write_text(json.dumps([{"text": f"record {i} " * 20} for i in range(200)]))
    monkeypatch.setattr(TextTokenizer, "encode_documents", lambda *a: pytest.fail("encoded a sample with no scale"))
    manifest = {}
    prepare._measure_scale(manifest, tmp_path, [str(path)], tokenizer, Options(), "hint")
    # no scale; the sample's share of repeated text (junk.spare_repeats) is measured from its text, not encoded
    assert manifest["garbage"] is None and manifest["repeated"] == 0.0
    assert manifest["boilerplate"]["share"] == 0.0  # lines across documents (data/boilerplate.py): one document
