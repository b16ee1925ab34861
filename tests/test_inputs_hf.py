"""A Hugging Face model directory damaged the way downloads and hand edits damage one: a
config.json that is JSON but not an object, and weights whose config.json is missing."""

import warnings

import pytest

from hf_helpers import llama_style_tokenizer, tiny_llama
from trimtab import api
from trimtab.cli import main
from trimtab.errors import ConfigError
from trimtab.hf.importer import read_config

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (parity reference)")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with its tokenizer, as save_pretrained writes them."""
    path = tmp_path_factory.mktemp("hf-model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_llama().save_pretrained(path)
    llama_style_tokenizer().save_pretrained(path)
    return path


def copy_of(model_dir, dest):
    dest.mkdir()
    for file in model_dir.iterdir():
        (dest / file.name).write_bytes(file.read_bytes())
    return dest


@pytest.mark.parametrize("content", ["[1, 2]", '"LlamaForCausalLM"', "null"])
def test_a_config_json_that_is_not_an_object_is_refused_naming_it_and_the_fix(tmp_path, model_dir, content, capsys):
    """It was an AttributeError traceback ('list' object has no attribute 'get')."""
    bad = copy_of(model_dir, tmp_path / "model")
    (bad / "config.json").write_text(content)
    with pytest.raises(ConfigError, match=r"config\.json: unreadable \(JSON, but a .*download it again"):
        read_config(bad)
    assert main(["generate", str(bad), "--prompt", "x", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "config.json: unreadable" in err and "Traceback" not in err


def test_a_cut_short_config_json_names_the_fix(tmp_path, model_dir):
    bad = copy_of(model_dir, tmp_path / "model")
    (bad / "config.json").write_bytes((model_dir / "config.json").read_bytes()[:60])
    with pytest.raises(ConfigError, match=r"config\.json: unreadable \(.*\); .*download it again with the model"):
        read_config(bad)


def test_weights_without_their_config_json_are_named_as_such(tmp_path, model_dir):
    """Read as a trimtab checkpoint, they failed on 'unreadable state.json', a file such a
    directory never has."""
    bad = copy_of(model_dir, tmp_path / "model")
    (bad / "config.json").unlink()
    text = tmp_path / "code.txt"
    text.write_text("\n\n".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200)))
    train = {"max_steps": 1, "eval_every": 0, "batch_tokens": 256, "micro_batch_tokens": 256, "init_from": str(bad)}
    with pytest.raises(ConfigError, match="holds safetensors weights but no config.json") as info:
        api.train(
            preset="debug",
            out=str(tmp_path / "run"),
            train=train,
            data={"source": str(text), "seq_len": 32},
            log={"progress": False, "tensorboard": False},
        )
    assert "state.json" in str(info.value) and "download its config.json too" in str(info.value)
