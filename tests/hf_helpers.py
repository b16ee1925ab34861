"""Helpers of the Hugging Face interop tests: load with transformers, compare logits and greedy
generations, write a run directory holding a given model."""

import warnings

import pytest
import torch

from trimtab.checkpoint import save_checkpoint
from trimtab.config import RunConfig, dump_config
from trimtab.sampling import generate

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (parity reference)")
TOL = 1e-4  # max |logit difference| in fp32


def hf_load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def max_diff(ours, theirs, vocab, seed=0):
    x = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (ours(x) - theirs(x).logits).abs().max().item()


def greedy_same(ours, theirs, vocab, n=32):
    prompt = torch.randint(0, vocab, (1, 6), generator=torch.Generator().manual_seed(1)).tolist()[0]
    mine = generate(ours, prompt, n, temperature=0, top_k=0, top_p=1.0)
    theirs.generation_config.eos_token_id = None
    with torch.no_grad():
        out = theirs.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return mine == out[0, len(prompt) :].tolist()


def write_run(path, model, tok, step=0):
    """A run directory holding `model` as checkpoint `step` (what training would leave)."""
    cfg = RunConfig(model=model.cfg, out=str(path))
    cfg.data.seq_len = min(cfg.data.seq_len, model.cfg.max_seq_len)
    path.mkdir(parents=True)
    dump_config(cfg, path / "config.yaml")
    tok.save(path / "tokenizer.json")
    state = {"moe": model.moe_state(), "mod": model.mod_state(), "tokens": 0}
    save_checkpoint(path, step, model.state_dict(), {}, state, keep=1)
    return path


def tiny_llama(vocab_size=300, layers=2, **config):
    """A tiny random Llama built offline (32 wide, 4 heads over 2 key-value heads, 64 positions),
    seeded: the same weights each call."""
    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    settings = {**shape, "num_hidden_layers": layers, "max_position_embeddings": 64, **config}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=vocab_size, **settings))


def llama_style_tokenizer(start_token=False):
    """A 300-token byte-level BPE as transformers' fast tokenizer: <s> / </s>, no pad token;
    `start_token`: its post-processor puts <s> first, as Llama's and Mistral's do."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([f"def f{i}(x):\n    return x * {i}\n" for i in range(200)], trainer)
    if start_token:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
