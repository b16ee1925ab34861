"""Prompts with verifiable answers (rl/tasks.py): the built-in arithmetic task and prompt files."""

import re

import pytest

from trimtab.data.arithmetic import split_held_out
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
    bad.write_text('{"prompt": "2+3=", "answer": "5"}\n{"prompt": "Q\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: invalid JSON \(Unterminated string starting at column 12\)"):
        read_problems(bad)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="no prompts"):
        read_problems(tmp_path / "empty.jsonl")
    bad.write_text('{"prompt": "2+3=", "answer": "5"}\n{"prompt": " ", "answer": "0"}\n')  # crashed mid-run when drawn
    with pytest.raises(DataError, match=r'bad.jsonl:2: an empty "prompt"'):
        read_problems(bad)
    bad.write_text('{"prompt": "2+3=", "answer": null}\n')  # read as the answer "None"
    with pytest.raises(DataError, match=r'bad.jsonl:1: a prompt record needs "prompt" \(text\) and "answer"'):
        read_problems(bad)
    for empty in ('""', '"  "', "true"):  # an empty answer scored an empty response right under `exact`
        bad.write_text(f'{{"prompt": "2+3=", "answer": "5"}}\n{{"prompt": "Q", "answer": {empty}}}\n')
        with pytest.raises(DataError, match=rf'bad.jsonl:2: "answer" is {re.escape(empty)}: give the text'):
            read_problems(bad)
    good.write_text('{"prompt": "Q", "answer": {"value": 5, "unit": "m"}}\n')  # as JSON, not Python's repr
    assert read_problems(good)[0].answer == '{"value": 5, "unit": "m"}'


def test_a_files_held_out_split_trains_every_other_prompt_and_keeps_a_prompts_items_together():
    """rl.held_out / dpo.held_out of a file: the n lowest-hashing prompts' items held out (at most
    a tenth of the file), the rest trained on in file order (it held a hash's 10% out whatever n
    was: with n = 0 a tenth of a file was never trained on nor evaluated); a prompt with several
    items (DPO pairs) is held out whole; a prompt's place does not depend on the other lines."""
    items = [(f"{a}+{b}=", i) for i, (a, b) in enumerate((a, b) for a in range(20) for b in range(2))]
    items += [("0+0=", "again"), ("0+0=", "and again")]  # the same prompt three times in all
    prompt = lambda item: item[0]  # noqa: E731
    assert split_held_out(items, 0, prompt) == (items, [])
    assert len(split_held_out(items, 64, prompt)[1]) == 4  # a tenth of the 42 lines, not 64
    train, held = split_held_out(items, 3, prompt)
    assert len(held) == 3 and len(train) + len(held) <= len(items)
    assert not {prompt(i) for i in train} & {prompt(i) for i in held}  # never both
    assert train == [i for i in items if prompt(i) not in {prompt(h) for h in held}]  # file order
    assert sum(prompt(i) == "0+0=" for i in train) in (0, 3)  # together, on one side
    rest = items[10:]  # other lines gone: a held prompt that is left stays held
    assert {prompt(i) for i in split_held_out(rest, 3, prompt)[1]} >= {prompt(i) for i in held if i in rest}
