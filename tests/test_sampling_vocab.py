"""Generation never draws an id past the tokenizer's vocabulary: a model's head is often padded
past it (Qwen's to a multiple of 128, a trimtab run's model.vocab_size above the tokenizer's), and
an id there decodes to nothing."""

from __future__ import annotations

import warnings

import pytest
import torch

from trimtab.config import ModelConfig
from trimtab.model import build_model
from trimtab.sampling import decodable_limit, generate

pytestmark = pytest.mark.usefixtures("one_thread")
TOKENS, PADDED = 90, 128  # the tokenizer's vocabulary, the model's (padded to a multiple of 64)


def padded_dominant(model, tokens: int):
    """The head's rows past `tokens` made to win every step: a larger logit than any real token's."""
    with torch.no_grad():
        rows = model.lm_head.weight
        rows[tokens:] = rows[:tokens].abs().max() * 50 * torch.sign(torch.randn(rows.shape[1]))
    return model


@pytest.fixture
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=PADDED, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=48, tie_embeddings=False
    )
    return padded_dominant(build_model(cfg), TOKENS)


def test_the_padded_rows_win_unless_masked(model):
    """Unmasked, the padded rows are what is drawn (the test's premise); masked, never, greedy or
    sampled at any temperature, with or without top-k / top-p."""
    unmasked = generate(model, [1, 2, 3], 20, temperature=1.0, top_k=0, top_p=1.0)
    assert sum(t >= TOKENS for t in unmasked) > 10
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, {"temperature": 2.0}):
        for seed in range(3):
            out = generate(model, [1, 2, 3], 20, seed=seed, vocab=TOKENS, **kw)
            assert len(out) == 20 and max(out) < TOKENS, (kw, out)


def test_the_limit_applies_only_where_the_tokenizer_is_known_and_smaller():
    assert decodable_limit(PADDED, TOKENS) == TOKENS
    assert decodable_limit(PADDED, None) is None  # no tokenizer given: every row stays
    assert decodable_limit(PADDED, PADDED) is None  # nothing padded
    assert decodable_limit(PADDED, PADDED + 5) is None  # a tokenizer larger than the head: nothing to mask


def test_an_unpadded_model_generates_exactly_as_before(model):
    """vocab equal to the model's: the same draws as without it (no mask, no change of stream)."""
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    a = generate(model, [4, 5], 16, temperature=1.0, top_k=0, top_p=1.0, seed=7)
    assert a == generate(model, [4, 5], 16, temperature=1.0, top_k=0, top_p=1.0, seed=7, vocab=PADDED)


def test_lm_eval_generation_on_an_imported_padded_hugging_face_model_gives_text(tmp_path):
    """A Hugging Face Llama whose head has 320 rows over a 300-token tokenizer, the padded rows
    dominant: lm-eval's generate_until through the trimtab adapter returns text, not the empty
    string the padded ids decode to."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the optional [eval] extra")
    pytest.importorskip("transformers", reason="transformers is a dev dependency")
    from lm_eval.api.instance import Instance

    from hf_helpers import llama_style_tokenizer, tiny_llama
    from trimtab.evaluation.adapter import TrimtabLM
    from trimtab.hf import import_model, load_tokenizer

    theirs = tiny_llama(vocab_size=320, layers=1, bos_token_id=0, eos_token_id=1)
    padded_dominant(theirs, 300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs.save_pretrained(tmp_path)
        llama_style_tokenizer().save_pretrained(tmp_path)
    model, _ = import_model(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert (tok.vocab_size, model.cfg.vocab_size) == (300, 320)
    request = Instance("generate_until", {}, ("def f1(x):\n", {"until": [], "max_gen_toks": 8}), 0)
    [text] = TrimtabLM(model, tok, batch_size=1).generate_until([request], disable_tqdm=True)
    assert text != ""
    ids = tok.encode(text)
    assert ids and max(ids) < 300


def test_the_tokenizers_id_limit_covers_ids_past_its_size():
    """A tokenizer whose added token sits past a gap in its ids: the limit is past its highest id, so
    that token stays drawable where its count would cut it off."""
    from tokenizers import Tokenizer, models

    from trimtab.data.tokenizer import TextTokenizer

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<eos>": 7}, unk_token="a"))
    wrapped = TextTokenizer(tok, hf={"eos_token": "<eos>"})
    assert wrapped.vocab_size == 3 and wrapped.id_limit == 8


def test_generate_from_a_run_with_a_padded_head_draws_only_decodable_ids(tmp_path, monkeypatch):
    """`trimtab generate` (api.generate) on a run whose model.vocab_size is above its tokenizer's,
    the padded rows made to win: every id drawn decodes."""
    import trimtab
    from trimtab import api
    from trimtab.config import load_config

    sets = ["train.max_steps=1", "model.vocab_size=640", "log.progress=false", "log.tensorboard=false"]
    trimtab.train(load_config(preset="debug", overrides={"out": str(tmp_path)}, sets=sets))
    drawn, load_run, generate_ids = [], api.load_run, api.generate_ids
    monkeypatch.setattr(
        api, "load_run", lambda run: (lambda c, m, t: (c, padded_dominant(m, t.id_limit), t))(*load_run(run))
    )
    monkeypatch.setattr(api, "generate_ids", lambda *a, **kw: drawn.extend(generate_ids(*a, **kw)) or drawn)
    api.generate(tmp_path, "def f(x):", 12, temperature=1.0, top_k=0, top_p=1.0)
    limit = api.load_run(tmp_path)[2].id_limit
    assert limit == 512 and drawn and max(drawn) < limit
