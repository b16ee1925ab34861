"""Prompts with verifiable answers (rl/tasks.py): the built-in arithmetic task and prompt files."""

import pytest

from trimtab.errors import DataError
from trimtab.rl.tasks import arithmetic, read_problems


def test_the_arithmetic_task_is_seeded_correct_and_its_splits_disjoint():
    train = arithmetic(300, seed=3)
    assert train == arithmetic(300, seed=3) and train != arithmetic(300, seed=4)
    held = arithmetic(100, seed=3, split="held_out")
    assert len(train) == 300 and len(held) == 100
    assert not {p.prompt for p in train} & {p.prompt for p in arithmetic(2000, seed=9, split="held_out")}
    for p in train + held:
        assert p.prompt.endswith("=") and eval(p.prompt[:-1]) == int(p.answer)  # noqa: S307 - digits and +/-
    every = arithmetic(10_000, digits=1) + arithmetic(10_000, digits=1, split="held_out")
    assert len(every) == 200  # 10 x 10 x {+, -}: the splits run out
    assert len(arithmetic(50, digits=4)) == 50


def test_a_prompt_file_is_read_and_a_bad_line_named(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "2+3=", "answer": 5}\n{"prompt": "Q", "answer": "x"}\n')
    assert [(p.prompt, p.answer) for p in read_problems(good)] == [("2+3=", "5"), ("Q", "x")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "2+3=", "answer": "5"}\n{"question": "Q"}\n')
    with pytest.raises(DataError, match=r'bad.jsonl:2: a prompt record needs "prompt"'):
        read_problems(bad)
    bad.write_text('{"prompt": "2+3=", "answer": "5"}\n{"prompt": "Q",\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: invalid JSON"):
        read_problems(bad)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="no prompts"):
        read_problems(tmp_path / "empty.jsonl")
