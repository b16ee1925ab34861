"""Bad input around a Hugging Face model directory: a damaged weights file or index, a model
without its tokenizer, another tokenizer given beside it, a vocabulary smaller than its
tokenizer's; and the tokenizer fingerprint, which counts only what decides the rows."""

import hashlib
import json
import re
import warnings

import pytest

from hf_helpers import llama_style_tokenizer, tiny_llama
from trimtab import api
from trimtab.cli import main
from trimtab.data.prepare import prepare
from trimtab.data.tokenizer import TextTokenizer
from trimtab.errors import CheckpointError, ConfigError, DataError
from trimtab.hf import export_run
from trimtab.hf.importer import import_model

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (parity reference)")
pytestmark = pytest.mark.usefixtures("one_thread")
TRAIN = {"max_steps": 1, "eval_every": 0, "batch_tokens": 256, "micro_batch_tokens": 256}
LOG = {"progress": False, "tensorboard": False}


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    """A Llama-style tokenizer (300 tokens, <s> / </s>) as transformers saves it."""
    path = tmp_path_factory.mktemp("hf-tok")
    llama_style_tokenizer().save_pretrained(path)
    return path


def llama(path, tok_dir, vocab_size=300, **save):
    """A tiny random Llama saved into path with the tokenizer of tok_dir; returns path."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_llama(vocab_size).save_pretrained(path, **save)
    for file in tok_dir.iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    return path


def corpus(tmp_path):
    path = tmp_path / "code.txt"
    path.write_text("\n\n".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(300)))
    return path


def finetune(tmp_path, model_dir, name="run", **data):
    data = {"source": str(corpus(tmp_path)), "seq_len": 32, **data}
    train = {**TRAIN, "init_from": str(model_dir)}
    return api.train(preset="debug", out=str(tmp_path / name), train=train, data=data, log=LOG)


# ---- damaged weights ------------------------------------------------------------------------


def truncate(file, size):
    file.write_bytes(file.read_bytes()[:size])


DAMAGE = {
    "truncated": ("model.safetensors", lambda d: truncate(d / "model.safetensors", 20000), "not a readable"),
    "garbage": ("model.safetensors", lambda d: (d / "model.safetensors").write_bytes(b"\x07" * 4096), "not a readable"),
    "truncated shard": (
        "model-00002-of-00003.safetensors",
        lambda d: truncate(d / "model-00002-of-00003.safetensors", 100),
        "not a readable",
    ),
    "index not JSON": (
        "model.safetensors.index.json",
        lambda d: (d / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {'),
        "not a valid safetensors index",
    ),
    "index without weight_map": (
        "model.safetensors.index.json",
        lambda d: (d / "model.safetensors.index.json").write_text('{"metadata": {}}'),
        "no 'weight_map'",
    ),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_weights_file_is_refused_naming_it_and_the_fix(kind, tmp_path, hf_tok, capsys):
    """A safetensors file cut short by an interrupted download, or not safetensors at all, and a
    garbled shard index: a raw SafetensorError / JSONDecodeError / KeyError traceback before."""
    file, damage, what = DAMAGE[kind]
    sharded = file != "model.safetensors"
    model_dir = llama(tmp_path / "hf", hf_tok, **({"max_shard_size": "60KB"} if sharded else {}))
    if sharded:
        assert json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
        assert len(list(model_dir.glob("model-*-of-00003.safetensors"))) == 3
    damage(model_dir)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(model_dir / file))}: .*{what}.*download it again"):
        import_model(model_dir)
    assert main(["generate", str(model_dir), "--prompt", "def", "--max-new-tokens", "2"]) == 2
    assert f"{model_dir / file}: " in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=str(model_dir / file)):
        finetune(tmp_path, model_dir)


# ---- the model's tokenizer ------------------------------------------------------------------


def test_finetuning_a_model_directory_without_its_tokenizer_is_refused(tmp_path, hf_tok):
    """A BPE trained on the data instead would read the pretrained embeddings under other ids,
    silently; generate and eval already refused such a directory."""
    model_dir = llama(tmp_path / "hf", hf_tok)
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=rf"'{model_dir}' has no tokenizer.json.*save_pretrained\('{model_dir}'\)"):
        finetune(tmp_path, model_dir)
    assert not (tmp_path / "run").exists()
    (model_dir / "tokenizer.json").write_bytes((hf_tok / "tokenizer.json").read_bytes())
    assert finetune(tmp_path, model_dir)["step"] == 1


def test_data_tokenizer_other_than_the_models_is_refused_naming_both(tmp_path, hf_tok, tokenizer):
    """data.tokenizer beside train.init_from must tokenize as the model's own does; its copy
    with a re-saved tokenizer_config.json (another model_max_length, class) does."""
    model_dir = llama(tmp_path / "hf", hf_tok)
    other = tmp_path / "other" / "tokenizer.json"
    tokenizer.save(other)
    with pytest.raises(ConfigError, match=r"'data.tokenizer' \(.*other/tokenizer.json\) is not the tokenizer") as exc:
        finetune(tmp_path, model_dir, tokenizer=str(other))
    assert str(model_dir / "tokenizer.json") in str(exc.value) and "the vocabularies differ" in str(exc.value)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "tokenizer.json").write_bytes((hf_tok / "tokenizer.json").read_bytes())
    settings = json.loads((hf_tok / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps(settings | {"model_max_length": 64, "tokenizer_class": "X"}))
    assert finetune(tmp_path, model_dir, tokenizer=str(copy / "tokenizer.json"))["step"] == 1


def test_a_model_vocabulary_smaller_than_its_tokenizers_names_the_fix_for_an_import(tmp_path, hf_tok):
    """model.vocab_size does not apply to an import (its config.json is the model)."""
    model_dir = llama(tmp_path / "hf", hf_tok, vocab_size=280)
    with pytest.raises(
        ConfigError,
        match=r"train.init_from: the model at .* has vocab_size 280 in its config.json.*resize_token_embeddings\(300\)",
    ) as exc:
        finetune(tmp_path, model_dir)
    assert "set it to 0" not in str(exc.value)
    # `trimtab eval` of it: the same words, not torch's "IndexError: index out of range in self" at its first forward
    with pytest.raises(ConfigError, match=r"the model at .* has vocab_size 280 .*resize_token_embeddings\(300\)"):
        api.load_run_at(model_dir)


# ---- the tokenizer fingerprint --------------------------------------------------------------


def test_the_fingerprint_counts_what_decides_the_rows_and_keeps_trimtabs_own(tmp_path, tokenizer):
    """trimtab's own tokenizer keeps the fingerprint data prepared before recorded; the same
    tokenizer.json with its settings beside (an export) has it too, whatever else
    tokenizer_config.json says; another end-of-text token changes it, and is named."""
    own = tmp_path / "own" / "tokenizer.json"
    tokenizer.save(own)
    loaded = TextTokenizer.load(own)
    assert loaded.fingerprint == hashlib.sha256(loaded._tok.to_str().encode()).hexdigest()  # as recorded before
    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / "tokenizer.json").write_bytes(own.read_bytes())
    settings = {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "bos_token": None}
    (exported / "tokenizer_config.json").write_text(json.dumps(settings | {"model_max_length": 128}))
    assert TextTokenizer.load(exported / "tokenizer.json").fingerprint == loaded.fingerprint
    (exported / "tokenizer_config.json").write_text(json.dumps(settings | {"eos_token": "<|end|>"}))
    other = TextTokenizer.load(exported / "tokenizer.json")
    assert other.fingerprint != loaded.fingerprint
    assert loaded.difference(other) == f"the end-of-text id differs ({loaded.eos_id} vs {other.eos_id})"
    assert loaded.difference(TextTokenizer.load(own)) == ""


def test_rows_prepared_under_a_hugging_face_tokenizers_old_fingerprint_are_still_its(hf_tok):
    """Before, all of tokenizer_config.json counted: a dataset prepared then recorded that digest."""
    tok = TextTokenizer.load(hf_tok / "tokenizer.json")
    before = hashlib.sha256((tok._tok.to_str() + json.dumps(tok.hf, sort_keys=True)).encode()).hexdigest()
    assert before != tok.fingerprint and tok.made(before) and tok.made(tok.fingerprint)
    assert not tok.made(hashlib.sha256(b"another").hexdigest())


def test_an_exported_run_finetunes_on_the_data_it_was_prepared_with(tmp_path, tokenizer):
    """Export writes the run's tokenizer.json as is, with a tokenizer_config.json (model_max_length,
    its class) beside: refused before as "prepared with another tokenizer"."""
    own = tmp_path / "tok" / "tokenizer.json"
    tokenizer.save(own)
    prepared = tmp_path / "prepared"
    prepare([str(corpus(tmp_path))], prepared, tokenizer=str(own), workers=1)
    data = {"source": str(prepared), "seq_len": 32}
    api.train(preset="debug", out=str(tmp_path / "first"), train=dict(TRAIN, max_steps=2), data=data, log=LOG)
    exported = export_run(tmp_path / "first", tmp_path / "exported")
    assert (exported / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()
    assert "model_max_length" in json.loads((exported / "tokenizer_config.json").read_text())
    train = {**TRAIN, "init_from": str(exported)}
    assert api.train(preset="debug", out=str(tmp_path / "again"), train=train, data=data, log=LOG)["step"] == 1


# ---- a hand-edited config.json or index -----------------------------------------------------


def edit_json(file, change):
    data = json.loads(file.read_text())
    change(data)
    file.write_text(json.dumps(data))


BAD_FIELDS = {
    "a word": ({"num_hidden_layers": "two"}, r"field 'num_hidden_layers' is 'two'; it must be a whole number"),
    "a boolean": ({"rms_norm_eps": True}, r"field 'rms_norm_eps' is True; it must be a number"),
    "negative": ({"vocab_size": -1}, r"field 'vocab_size' is -1; it must be at least 1"),
    "zero heads": ({"num_attention_heads": 0}, r"field 'num_attention_heads' is 0; it must be at least 1"),
    "kv heads": ({"num_key_value_heads": 3}, r"field 'num_key_value_heads' must divide num_attention_heads"),
}


@pytest.mark.parametrize("kind", list(BAD_FIELDS))
def test_a_config_field_of_the_wrong_type_or_value_is_refused_naming_it(kind, tmp_path, hf_tok):
    """A TypeError or ValueError traceback before, or an error in trimtab's own key names
    ('model.n_kv_heads') that named neither config.json nor its field."""
    change, message = BAD_FIELDS[kind]
    model_dir = llama(tmp_path / "hf", hf_tok)
    edit_json(model_dir / "config.json", lambda d: d.update(change))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(model_dir / 'config.json'))}: {message}"):
        import_model(model_dir)


def test_a_size_config_json_omits_is_named_beside_the_shape_it_gave(tmp_path, hf_tok):
    """The class default (4096) silently replaced it: the shape error alone did not say why."""
    model_dir = llama(tmp_path / "hf", hf_tok)
    edit_json(model_dir / "config.json", lambda d: d.pop("hidden_size"))
    with pytest.raises(CheckpointError, match=r"no 'hidden_size' \(4096\), so LlamaForCausalLM's default was taken"):
        import_model(model_dir)


def test_a_shard_index_that_does_not_match_its_shards_is_named(tmp_path, hf_tok):
    """An index missing a shard's tensors blamed config.json; one pointing a tensor at the wrong
    shard raised a raw SafetensorError traceback."""
    model_dir = llama(tmp_path / "hf", hf_tok, max_shard_size="60KB")
    index = model_dir / "model.safetensors.index.json"
    good = index.read_text()
    last = sorted(set(json.loads(good)["weight_map"].values()))[-1]
    edit_json(index, lambda d: d.update(weight_map={k: v for k, v in d["weight_map"].items() if v != last}))
    with pytest.raises(CheckpointError, match=rf"index.json does not list the tensors of {last}.*download the index"):
        import_model(model_dir)
    index.write_text(good)
    first = sorted(set(json.loads(good)["weight_map"].values()))[0]
    edit_json(index, lambda d: d["weight_map"].update({"lm_head.weight": first}))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(index))}: lists tensor 'lm_head.weight' in {first}"):
        import_model(model_dir)


def test_a_damaged_tokenizer_of_a_model_directory_names_the_fix_for_a_download(tmp_path, hf_tok, capsys):
    """The fix offered was a run's: "the copy in checkpoint.dir's store if the run has one"."""
    model_dir = llama(tmp_path / "hf", hf_tok)
    (model_dir / "tokenizer.json").write_text("not json {")
    assert main(["generate", str(model_dir), "--prompt", "def", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json' is corrupt or unreadable" in err and "download it again with the model" in err
    assert "checkpoint.dir" not in err
    with pytest.raises(DataError, match="train.init_from.s tokenizer.*download it again with the model"):
        finetune(tmp_path, model_dir)  # the fix offered was a run's: "restore it (that run's tokenizer.json)"
