"""A prompt file with a NaN answer (json.dumps of a pandas frame with a missing value writes
`NaN`): it was read as the answer "nan", which no response earns, silently."""

import pytest

from trimtab.errors import DataError
from trimtab.rl.tasks import read_problems


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_missing_answer_written_as_nan_is_named_with_its_line(tmp_path, value):
    path = tmp_path / "tasks.jsonl"
    path.write_text(f'{{"prompt": "1+1=", "answer": 2}}\n{{"prompt": "2+2=", "answer": {value}}}\n')
    with pytest.raises(DataError, match=r"tasks.jsonl:2: \"answer\" is (NaN|-?Infinity), not an answer"):
        read_problems(path)
    path.write_text('{"prompt": "1+1=", "answer": 2.5}\n')
    assert read_problems(path)[0].answer == "2.5"  # a finite number reads as written
