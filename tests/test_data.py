"""Data pipeline: reading, tokenizer, rows / splits, batch loader."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trimtab.config import DataConfig
from trimtab.data import (
    IGNORE_INDEX,
    SPECIAL_TOKENS,
    BatchLoader,
    Document,
    Rows,
    TextTokenizer,
    build_splits,
    eval_batches,
    get_tokenizer,
    read_documents,
    tokenize_documents,
)
from trimtab.data import tokenizer as tokenizer_module
from trimtab.data.sources import builtin_files
from trimtab.errors import DataError

CODE = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n"
UNICODE = "héllo wörld ✓ 漢字 🙂\n\ttabbed\r\n  two spaces  \n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(path: Path, records: list) -> Path:
    return write(path, "\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")


def chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> TextTokenizer:
    docs = [Document([(CODE * 3 + UNICODE + f"value_{i} = {i * 7}\n", True)]) for i in range(40)]
    return get_tokenizer(DataConfig(bpe_vocab_size=400), docs, tmp_path_factory.mktemp("tok"))


# ------------------------------------------------------------------------------------------ reading


def test_builtin_corpus_is_capped_deterministic_and_mixed():
    cfg = DataConfig(max_bytes=300_000)
    docs, skipped = read_documents(cfg)
    again, _ = read_documents(cfg)
    assert docs == again and skipped == 0
    size = sum(len(d.text.encode()) for d in docs)
    assert 250_000 < size <= 300_000 and len(docs) >= 3
    assert all(len(d.segments) == 1 and d.segments[0][1] for d in docs)
    root, files = builtin_files()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert not any("site-packages" in name for name in rel)
    assert rel != sorted(rel)  # hashed order interleaves the tree
    assert len({name.split("/")[0] for name in rel[:50]}) > 5


def test_text_directory_sorted_recursive_skips_binary_and_hidden(tmp_path):
    write(tmp_path / "b.md", "# title\n")
    write(tmp_path / "a" / "z.py", CODE)
    write(tmp_path / "c.txt", UNICODE)
    (tmp_path / "img.bin").write_bytes(b"\x89PNG\xff\xfe\x00\x01")
    write(tmp_path / ".git" / "HEAD", "ref: x\n")
    write(tmp_path / "empty.txt", "")
    docs, skipped = read_documents(DataConfig(source=str(tmp_path)))
    assert [d.segments for d in docs] == [[(CODE, True)], [("# title\n", True)], [(UNICODE, True)]]
    assert skipped == 0


def test_jsonl_text_chat_and_instruction_records(tmp_path):
    path = jsonl(
        tmp_path / "mix.jsonl",
        [
            {"body": "plain doc"},
            chat(("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2"), ("assistant", "A2")),
            {"prompt": "P", "response": "R"},
            "",
        ],
    )
    docs, _ = read_documents(DataConfig(source=str(path), text_field="body"))
    assert [d.segments for d in docs] == [
        [("plain doc", True)],
        [
            ("<|system|>\nS<|end|>\n<|user|>\nU1<|end|>\n<|assistant|>\n", False),
            ("A1<|end|>", True),
            ("\n<|user|>\nU2<|end|>\n<|assistant|>\n", False),
            ("A2<|end|>", True),
            ("\n", False),
        ],
        [("<|user|>\nP<|end|>\n<|assistant|>\n", False), ("R<|end|>", True), ("\n", False)],
    ]


def test_format_forces_record_kind(tmp_path):
    path = jsonl(tmp_path / "data.txt", [{"prompt": "P", "response": "R"}])
    assert read_documents(DataConfig(source=str(path)))[0][0].segments[0][1] is True  # auto: text file
    docs, _ = read_documents(DataConfig(source=str(path), format="instruction"))
    assert docs[0].segments[1] == ("R<|end|>", True)
    with pytest.raises(DataError, match=r"data.txt:1: missing 'messages'"):
        read_documents(DataConfig(source=str(path), format="chat"))


@pytest.mark.parametrize(
    "bad, problem",
    [
        ('{"text": "x",}', "invalid JSON"),
        ('{"text": "x', "invalid JSON \\(Unterminated string starting at column 10\\)"),  # json's "at" once
        ('["text"]', "expected a JSON object"),
        ('{"txt": "x"}', "no 'text', 'messages' or 'prompt'/'response' key"),
        ('{"text": 3}', "'text' must be a string, got int"),
        ('{"prompt": "p"}', "missing 'response'"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "messages\\[0\\].role 'bot' is not one of"),
        ('{"messages": [{"role": "assistant", "content": 1}]}', "'messages\\[0\\].content' must be a string"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
    ],
)
def test_malformed_line_names_file_line_and_fix(tmp_path, bad, problem):
    path = jsonl(tmp_path / "chat.jsonl", [{"text": "ok"}, bad, {"text": "fine"}])
    with pytest.raises(DataError, match=rf"chat.jsonl:2: {problem}.*data.skip_bad_records=true"):
        read_documents(DataConfig(source=str(path)))
    docs, skipped = read_documents(DataConfig(source=str(path), skip_bad_records=True))
    assert skipped == 1 and [d.text for d in docs] == ["ok", "fine"]


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(DataError, match=r"^data.source '.*nope' does not exist"):
        read_documents(DataConfig(source=str(tmp_path / "nope")))
    cfg = DataConfig(source=str(tmp_path), eval_source=str(tmp_path / "gone"))
    with pytest.raises(DataError, match=r"^data.eval_source '.*gone' does not exist"):
        read_documents(cfg, cfg.eval_source)
    with pytest.raises(DataError, match="corpus is empty"):
        read_documents(cfg)  # empty directory
    bad = jsonl(tmp_path / "bad.jsonl", ["{", "{"])
    with pytest.raises(DataError, match="corpus is empty; all 2 records were malformed"):
        read_documents(DataConfig(source=str(bad), skip_bad_records=True))


# ---------------------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", [CODE, UNICODE, "  indented\n\n\n\t\tx\n", "a" * 300, "🙂 ÿ\x7f"])
def test_tokenizer_round_trips(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids_in_a_prompt_and_text_in_a_document(tok):
    ids = [tok.encode(t) for t in SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(SPECIAL_TOKENS)
    assert tok.eos_id == ids[0][0] and tok.pad_id == ids[1][0]
    assert ids[3][0] in tok.encode("x<|user|>\nhi")
    in_text = tok.encode_batch([CODE, "<|end|>"])  # a document's `<|end|>` is text: it ended the document
    assert in_text[0] == tok.encode(CODE) and len(in_text[1]) > 1 and tok.decode(in_text[1]) == "<|end|>"


def test_trained_on_chat_learns_no_merges_across_special_tokens(tmp_path):
    records = [chat(("user", f"q{i}"), ("assistant", f"a{i}")) for i in range(30)]
    path = jsonl(tmp_path / "c.jsonl", records)
    docs, _ = read_documents(DataConfig(source=str(path)))
    chat_tok = get_tokenizer(DataConfig(bpe_vocab_size=300), docs, tmp_path)
    specials = {chat_tok.encode(t)[0] for t in SPECIAL_TOKENS}
    learned = [chat_tok.decode([i]) for i in range(chat_tok.vocab_size) if i not in specials]
    assert len(learned) > 256 and not any("<|" in t or "|>" in t for t in learned)


def test_tokenizer_cache_hit_does_not_retrain_and_training_is_deterministic(tmp_path, monkeypatch):
    docs = [Document([(CODE + UNICODE * i, True)]) for i in range(10)]
    cfg = DataConfig(bpe_vocab_size=300)
    first = get_tokenizer(cfg, docs, tmp_path / "a")
    assert len(list((tmp_path / "a").glob("tokenizer-*.json"))) == 1
    fresh = get_tokenizer(cfg, docs, tmp_path / "b")
    assert fresh.fingerprint == first.fingerprint

    def no_training(*args):
        raise AssertionError("retrained despite a cached tokenizer")

    monkeypatch.setattr(tokenizer_module, "_train_bpe", no_training)
    cached = get_tokenizer(cfg, docs, tmp_path / "a")
    assert cached.fingerprint == first.fingerprint and cached.vocab_size == first.vocab_size
    with pytest.raises(AssertionError, match="retrained"):  # a different vocab size is a new key
        get_tokenizer(DataConfig(bpe_vocab_size=301), docs, tmp_path / "a")


def test_user_tokenizer_file(tmp_path, tok):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(
        [CODE],
        trainers.BpeTrainer(vocab_size=270, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    raw.save(str(tmp_path / "no_eos.json"))
    with pytest.raises(DataError, match=r"^data.tokenizer '.*no_eos.json' has no <\|endoftext\|>"):
        get_tokenizer(DataConfig(tokenizer=str(tmp_path / "no_eos.json")), [], tmp_path)
    raw.add_special_tokens(["<|endoftext|>"])
    raw.save(str(tmp_path / "eos.json"))
    loaded = get_tokenizer(DataConfig(tokenizer=str(tmp_path / "eos.json")), [], tmp_path)
    assert all(len(loaded.encode(f"a{t}b")) == 3 for t in SPECIAL_TOKENS)
    with pytest.raises(DataError, match=r"^data.tokenizer '.*missing.json' does not exist"):
        get_tokenizer(DataConfig(tokenizer=str(tmp_path / "missing.json")), [], tmp_path)
    tok.save(tmp_path / "run" / "tokenizer.json")
    assert TextTokenizer.load(tmp_path / "run" / "tokenizer.json").encode(CODE) == tok.encode(CODE)


# ------------------------------------------------------------------------------------ rows / splits


def test_chat_mask_trains_only_assistant_content_and_end(tok, tmp_path):
    path = jsonl(
        tmp_path / "c.jsonl", [chat(("user", "U1"), ("assistant", "A1"), ("user", "U2"), ("assistant", "A2 ✓"))]
    )
    docs, _ = read_documents(DataConfig(source=str(path)))
    tokenized = tokenize_documents(docs, tok, DataConfig())
    tokens, mask = tokenized.tokens, tokenized.mask
    assert tok.decode(tokens[mask].tolist()) == "A1<|end|>A2 ✓<|end|>"
    assert tok.decode(tokens[~mask].tolist()) == (
        "<|user|>\nU1<|end|>\n<|assistant|>\n\n<|user|>\nU2<|end|>\n<|assistant|>\n\n<|endoftext|>"
    )


def test_packed_rows_have_seq_len_plus_one_tokens_with_stride_seq_len(tok):
    docs = [Document([(CODE * (i + 1), True)]) for i in range(6)]
    cfg = DataConfig(seq_len=16, eval_fraction=0.0)
    stream = tokenize_documents(docs, tok, cfg).tokens
    train, held = build_splits(cfg, tok, docs, None, seed=0)
    assert len(held) == 0 and len(train) == (len(stream) - 1) // 16
    for r in range(len(train)):
        tokens, mask = train.get(r)
        assert tokens.dtype == np.int64 and mask.dtype == bool and train.length(r) == 16
        assert np.array_equal(tokens, stream[r * 16 : r * 16 + 17])
    assert train.n_tokens == 16 * len(train)
    assert (stream == tok.eos_id).sum() == len(docs)  # each document ends in eos


def test_unpacked_rows_one_per_document_truncated(tok):
    docs = [Document([("x", True)]), Document([(CODE * 5, True)]), Document([("a = 1\n", True)])]
    cfg = DataConfig(seq_len=12, eval_fraction=0.0, pack=False)
    train, _ = build_splits(cfg, tok, docs, None, seed=0)
    full = [tok.encode(d.text) + [tok.eos_id] for d in docs]
    assert len(train) == 3
    for r, ids in enumerate(full):
        assert train.length(r) == min(len(ids), 13) - 1
        assert train.get(r)[0].tolist() == ids[:13]


def test_held_out_documents_are_disjoint_and_deterministic(tok):
    docs = [Document([(f"doc_{i} = {i}\n", True)]) for i in range(50)]
    cfg = DataConfig(seq_len=32, eval_fraction=0.2, pack=False)

    def texts(rows: Rows) -> set[str]:
        return {tok.decode(rows.get(i)[0][:-1].tolist()) for i in range(len(rows))}

    train, held = build_splits(cfg, tok, docs, None, seed=7)
    assert len(held) == 10 and len(train) == 40
    assert texts(train) | texts(held) == {d.text for d in docs} and not texts(train) & texts(held)
    assert texts(build_splits(cfg, tok, docs, None, seed=7)[1]) == texts(held)
    assert texts(build_splits(cfg, tok, docs, None, seed=8)[1]) != texts(held)
    two = build_splits(DataConfig(seq_len=32, eval_fraction=0.4, pack=False), tok, docs[:2], None, 0)
    assert (len(two[0]), len(two[1])) == (1, 1)  # at least one eval document
    given = build_splits(cfg, tok, docs, docs[:3], seed=7)
    assert len(given[0]) == 50 and texts(given[1]) == {d.text for d in docs[:3]}


def test_single_document_holds_out_its_tail(tok):
    docs = [Document([(CODE * 20, True)])]
    cfg = DataConfig(seq_len=8, eval_fraction=0.25)
    stream = tokenize_documents(docs, tok, cfg).tokens
    train, held = build_splits(cfg, tok, docs, None, seed=0)
    cut = int(len(stream) * 0.75)
    assert len(train) == (cut - 1) // 8 and len(held) == (len(stream) - cut - 1) // 8 > 0
    for r in range(len(train)):
        assert np.array_equal(train.get(r)[0], stream[r * 8 : r * 8 + 9]) and r * 8 + 9 <= cut
    for r in range(len(held)):
        assert np.array_equal(held.get(r)[0], stream[cut + r * 8 : cut + r * 8 + 9])


def test_too_little_data_says_tokens_vs_needed(tok):
    with pytest.raises(DataError, match=r"has \d+ tokens .* data.seq_len\+1=257"):
        build_splits(DataConfig(seq_len=256, eval_fraction=0.0), tok, [Document([("hi", True)])], None, 0)


def test_builtin_pipeline_caches_token_arrays(tmp_path, monkeypatch):
    cfg = DataConfig(max_bytes=200_000, bpe_vocab_size=512, seq_len=64, eval_fraction=0.2)
    docs, _ = read_documents(cfg)
    tok = get_tokenizer(cfg, docs, tmp_path)
    assert all(tok.decode(tok.encode(d.text)) == d.text for d in docs[:5])
    train, held = build_splits(cfg, tok, docs, None, seed=1, cache_dir=tmp_path)
    assert len(train) > 50 and len(held) > 0 and len(list(tmp_path.glob("tokens-*.npz"))) == 1
    monkeypatch.setattr(TextTokenizer, "encode_batch", lambda *a: pytest.fail("re-tokenized"))
    cached_tok = get_tokenizer(cfg, docs, tmp_path)
    again, _ = build_splits(cfg, cached_tok, docs, None, seed=1, cache_dir=tmp_path)
    assert np.array_equal(again.tokens, train.tokens) and np.array_equal(again.starts, train.starts)


# ------------------------------------------------------------------------------------------- loader


def synthetic_rows(n_rows: int = 23, seed: int = 0) -> Rows:
    """Rows of lengths 3..20 with random tokens and ~70% trainable targets."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 21, n_rows)
    starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]])
    total = int((lengths + 1).sum())
    return Rows(rng.integers(2, 50, total).astype(np.int32), rng.random(total) < 0.7, starts, lengths)


def batches_equal(a, b) -> bool:
    same_micro = all(
        torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets) for x, y in zip(a.micro, b.micro)
    )
    return a.rows == b.rows and a.n_targets == b.n_targets and len(a.micro) == len(b.micro) and same_micro


def test_step_and_micro_batch_token_budgets(tmp_path):
    rows = synthetic_rows()
    loader = BatchLoader(rows, batch_tokens=50, micro_batch_tokens=24, seed=3, pad_id=1)
    for _ in range(12):
        step = loader.next_batch()
        lengths = [rows.length(i) for i in step.rows]
        assert sum(lengths) >= 50 and sum(lengths) - lengths[-1] < 50 and step.n_tokens == sum(lengths)
        assert sum(m.inputs.shape[0] for m in step.micro) == len(step.rows)
        assert step.n_targets == sum(m.n_targets for m in step.micro)
        for m in step.micro:
            b, t = m.inputs.shape
            assert b * t <= 24 or b == 1
            assert m.inputs.dtype == m.targets.dtype == torch.int64


def test_micro_batch_contents_padding_and_masked_targets():
    rows = synthetic_rows()
    step = BatchLoader(rows, batch_tokens=80, micro_batch_tokens=40, seed=0, pad_id=1).next_batch()
    by_length = sorted(step.rows, key=lambda i: -rows.length(i))
    flat = [(m, b) for m in step.micro for b in range(m.inputs.shape[0])]
    expected_targets = 0
    for (m, b), i in zip(flat, by_length):
        tokens, mask = rows.get(i)
        n = rows.length(i)
        assert m.inputs[b, :n].tolist() == tokens[:-1].tolist()
        assert m.targets[b, :n].tolist() == np.where(mask[1:], tokens[1:], IGNORE_INDEX).tolist()
        assert (m.inputs[b, n:] == 1).all() and (m.targets[b, n:] == IGNORE_INDEX).all()
        expected_targets += int(mask[1:].sum())
    assert step.n_targets == expected_targets < step.n_tokens  # masked targets are not counted
    for m in step.micro:
        assert m.n_targets == int((m.targets != IGNORE_INDEX).sum())


def test_epochs_are_distinct_reproducible_permutations():
    rows = synthetic_rows()

    def order(seed: int) -> list[int]:
        loader = BatchLoader(rows, batch_tokens=1, micro_batch_tokens=64, seed=seed, pad_id=0)
        out = [loader.next_batch().rows[0] for _ in range(2 * len(rows))]
        assert loader.epoch == 1
        return out

    first = order(5)
    assert sorted(first[:23]) == sorted(first[23:]) == list(range(23)) and first[:23] != first[23:]
    assert first[:23] == np.random.default_rng([5, 0]).permutation(23).tolist()
    assert order(5) == first and order(6) != first


def test_resume_from_state_dict_gives_identical_batches_across_epochs():
    rows = synthetic_rows()
    reference = BatchLoader(rows, batch_tokens=60, micro_batch_tokens=30, seed=9, pad_id=0)
    for _ in range(3):
        reference.next_batch()
    state = json.loads(json.dumps(reference.state_dict()))
    resumed = BatchLoader(rows, batch_tokens=60, micro_batch_tokens=30, seed=123, pad_id=0)
    resumed.load_state_dict(state)
    epochs = set()
    for _ in range(15):  # ~4 epochs of 23 rows
        assert batches_equal(reference.next_batch(), resumed.next_batch())
        epochs.add(resumed.epoch)
    assert len(epochs) >= 3
    with pytest.raises(DataError, match="rows"):
        BatchLoader(synthetic_rows(5), 60, 30, 9, 0).load_state_dict(state)
    # as many rows, other tokens (an edited corpus): refused, naming what to do
    with pytest.raises(DataError, match=r"other data in source0 .* as many rows \(23\), other tokens"):
        BatchLoader(synthetic_rows(seed=1), 60, 30, 9, 0).load_state_dict(state)
    # a checkpoint from before the digest resumes as it did
    older = {**state, "parts": [{k: v for k, v in part.items() if k != "digest"} for part in state["parts"]]}
    BatchLoader(synthetic_rows(seed=1), 60, 30, 9, 0).load_state_dict(older)


def test_the_digest_is_taken_before_a_row_is_rewritten_in_memory():
    """Fault injection's bad data rewrites a row in memory: a loader made afterwards (a phase
    entered again by a rollback) still holds the data's own digest, and so does one made fresh."""
    rows = synthetic_rows()
    state = BatchLoader(rows, 60, 30, 9, 0).state_dict()
    rows.replace(3, np.zeros(rows.length(3) + 1, dtype=np.int32))
    BatchLoader(rows, 60, 30, 9, 0).load_state_dict(state)
    BatchLoader(synthetic_rows(), 60, 30, 9, 0).load_state_dict(state)


def test_halving_micro_batch_tokens_keeps_rows_and_targets():
    rows = synthetic_rows()
    a = BatchLoader(rows, batch_tokens=100, micro_batch_tokens=64, seed=2, pad_id=0)
    b = BatchLoader(rows, batch_tokens=100, micro_batch_tokens=64, seed=2, pad_id=0)
    a.next_batch(), b.next_batch()
    b.micro_batch_tokens //= 2
    n_micro = [0, 0]
    for _ in range(5):
        x, y = a.next_batch(), b.next_batch()
        assert x.rows == y.rows and x.n_targets == y.n_targets and x.n_tokens == y.n_tokens
        assert all(m.inputs.numel() <= 32 or m.inputs.shape[0] == 1 for m in y.micro)
        n_micro[0] += len(x.micro)
        n_micro[1] += len(y.micro)
    assert n_micro[1] > n_micro[0]


def test_eval_batches_cap_rows_in_order():
    rows = synthetic_rows()
    micro = eval_batches(rows, micro_batch_tokens=40, max_tokens=100, pad_id=0)
    lengths = [rows.length(i) for i in range(len(rows))]
    k = int(np.searchsorted(np.cumsum(lengths), 100, side="right"))
    assert sum(lengths[:k]) <= 100 < sum(lengths[: k + 1])
    got = sorted(
        tuple(m.inputs[b][m.inputs[b] != 0].tolist())  # tokens are >= 2, pad is 0
        for m in micro
        for b in range(m.inputs.shape[0])
    )
    assert got == sorted(tuple(rows.get(i)[0][:-1].tolist()) for i in range(k))  # the first k rows
    assert all(m.inputs.numel() <= 40 or m.inputs.shape[0] == 1 for m in micro)
    assert len(eval_batches(rows, 40, max_tokens=1, pad_id=0)) == 1  # at least one row


def test_a_refused_resume_names_the_checkpoints_source_and_the_way_forward():
    """The source the checkpoint read is named (its saved name, not the new data's), and the
    message says how to go on: the same data, or a new run from the weights."""
    state = BatchLoader(synthetic_rows(), 60, 30, 9, 0, names=["builtin"]).state_dict()
    other = BatchLoader(synthetic_rows(5), 60, 30, 9, 0, names=["OTHER.txt"])
    with pytest.raises(DataError) as refused:
        other.load_state_dict(state)
    message = str(refused.value)
    assert message.startswith(
        "the checkpoint's data loader had 23 rows in builtin but the data now gives 5 (from OTHER.txt)"
    )
    assert "rows in OTHER.txt" not in message
    assert "train.seed" in message and "a new --out with --set train.init_from=RUN" in message
    # as many rows, other tokens: the same source named, the same way forward
    with pytest.raises(DataError, match=r"other data in builtin than .* \(from OTHER.txt\).*train.init_from=RUN"):
        BatchLoader(synthetic_rows(seed=1), 60, 30, 9, 0, names=["OTHER.txt"]).load_state_dict(state)
    # a checkpoint from before sources had names: the config key, never the new source's name
    older = {k: v for k, v in state.items() if k != "parts"}
    with pytest.raises(
        DataError, match=r"had 23 rows in its finetune.data.source but .* \(from OTHER.txt\).* finetune.data.\* setting"
    ):
        BatchLoader(synthetic_rows(5), 60, 30, 9, 0, names=["OTHER.txt"], section="finetune.data").load_state_dict(
            older
        )
    # a refusal changes nothing: the loader still serves its own first step
    assert batches_equal(other.next_batch(), BatchLoader(synthetic_rows(5), 60, 30, 9, 0).next_batch())


def test_a_resume_under_another_train_seed_is_refused_naming_train_seed(tokenizer):
    """train.seed decides which documents are held out for evaluation (packing._hold_out), so a
    resume under another seed reads other training rows: the refusal names train.seed, both
    values, and the --set that resumes."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    docs = [Document([(" ".join(rng.choice(words, int(rng.integers(5, 60)))), True)]) for _ in range(40)]
    cfg = DataConfig(seq_len=16, eval_fraction=0.2)
    saved = BatchLoader(build_splits(cfg, tokenizer, docs, None, seed=1234)[0], 64, 64, 1234, 0).state_dict()
    resumed = BatchLoader(build_splits(cfg, tokenizer, docs, None, seed=7)[0], 64, 64, 7, 0)
    with pytest.raises(DataError) as refused:
        resumed.load_state_dict(saved)
    message = str(refused.value)
    assert "train.seed changed (1234 then, 7 now; it decides which documents are held out for evaluation)" in message
    assert "resume with --set train.seed=1234" in message and "train.init_from=RUN" in message


def test_the_skipped_rows_are_sorted_for_the_state_once_per_change(monkeypatch):
    """An emergency save takes the loader's state every step under DDP (training/emergency.py): with 10,000
    rows skipped its sort took 7-10 ms a step (before: sorted at every state_dict). Sorted again only when the
    rows change, a rollback's in-place `loader.skipped |= rows` included; the state holds every row either way."""
    from trimtab.data import batches

    loader = BatchLoader(synthetic_rows(), batch_tokens=50, micro_batch_tokens=24, seed=3, pad_id=1)
    loader.skip_rows([7, 2])
    calls = []
    monkeypatch.setattr(batches, "sorted", lambda rows: calls.append(1) or sorted(rows), raising=False)
    for _ in range(3):
        assert loader.state_dict()["skipped"] == [2, 7]
    loader.state_dict()["skipped"].append(99)  # a caller's copy: the next state is unchanged
    assert loader.state_dict()["skipped"] == [2, 7] and len(calls) == 1
    loader.skipped |= {5}  # a rollback putting back the rows its branch skipped
    assert loader.state_dict()["skipped"] == [2, 5, 7]
    loader.skip_rows([1])
    assert loader.state_dict()["skipped"] == [1, 2, 5, 7] and len(calls) == 3


def test_the_skipped_rows_cannot_change_behind_the_states_sorted_copy():
    """An in-place change of `loader.skipped` (before: a set, its sorted copy reset on assignment only) left
    the checkpoint's list without the row: a resume would serve it again. Now it cannot be made in place."""
    loader = BatchLoader(synthetic_rows(), batch_tokens=50, micro_batch_tokens=24, seed=3, pad_id=1)
    loader.skip_rows([7, 2])
    assert loader.state_dict()["skipped"] == [2, 7]  # the sorted copy is cached now
    with contextlib.suppress(AttributeError):
        loader.skipped.add(5)
    assert loader.state_dict()["skipped"] == sorted(loader.skipped)


def test_record_with_text_under_another_field_names_text_field(tmp_path):
    """A .jsonl whose text is under "content" named no setting that reads it, only "fix the record"
    (found running `trimtab data prepare b.jsonl` and `trimtab train --set data.source=b.jsonl`)."""
    path = jsonl(tmp_path / "b.jsonl", [{"id": 1, "content": "some text"}])
    with pytest.raises(DataError, match=r"b.jsonl:1: .*if 'content' holds the text: data.text_field=content"):
        read_documents(DataConfig(source=str(path)))
    docs, _ = read_documents(DataConfig(source=str(path), text_field="content"))
    assert [d.text for d in docs] == ["some text"]
    alpaca = jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Add", "input": "1+1", "output": "2"}])
    with pytest.raises(DataError, match=r"one of 'instruction', 'input', 'output' holds the text"):
        read_documents(DataConfig(source=str(alpaca)))  # none picked: text_field=output alone drops the rest
