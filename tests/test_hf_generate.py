"""`trimtab generate HF_DIR`: the prompt is tokenized as transformers' tokenizer(prompt) does it
(a start token where the tokenizer's post-processor adds one), so the greedy text is
transformers' own."""

import warnings

import pytest
import torch

from hf_helpers import llama_style_tokenizer, tiny_llama
from trimtab.cli import main
from trimtab.data import TextTokenizer
from trimtab.sampling import prompt_ids

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (parity reference)")
pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "def f3(x):\n"


def llama_dir(path, start_token):
    """A tiny random Llama and its byte-level BPE tokenizer (<s> / </s>); `start_token`: whether
    the tokenizer's post-processor puts <s> first, as Llama's and Mistral's do."""
    model = tiny_llama(bos_token_id=0, eos_token_id=1).eval()
    with torch.no_grad():  # confident logits: no near-ties in greedy decoding
        for p in model.parameters():
            p.mul_(4.0) if p.dim() == 2 else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path)
        llama_style_tokenizer(start_token).save_pretrained(path)
        return model, transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("start_token", [True, False])
def test_generate_on_a_hugging_face_directory_tokenizes_and_continues_as_transformers(start_token, tmp_path, capsys):
    model, hf_tok = llama_dir(tmp_path, start_token)
    ids = hf_tok(PROMPT).input_ids
    assert (ids[0] == hf_tok.bos_token_id) == start_token
    assert prompt_ids(TextTokenizer.load(tmp_path / "tokenizer.json"), PROMPT, 63) == ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    theirs = hf_tok.decode(out[0, len(ids) :].tolist())
    assert main(["generate", str(tmp_path), "--prompt", PROMPT, "--max-new-tokens", "8", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == PROMPT + theirs + "\n"


def test_a_long_prompt_keeps_its_start_token_and_its_end(tmp_path):
    llama_dir(tmp_path, start_token=True)
    tok = TextTokenizer.load(tmp_path / "tokenizer.json")
    ids = tok.encode(PROMPT * 20, specials=True)
    assert ids[0] == tok.bos_id
    assert prompt_ids(tok, PROMPT * 20, 10) == [tok.bos_id, *ids[-9:]]
    assert prompt_ids(tok, "", 10) == [tok.bos_id]
