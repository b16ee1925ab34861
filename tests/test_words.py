"""Counts in words (trimtab/words.py): the noun agrees with its count wherever a person reads one; `trimtab data
prepare` of one document said "1 documents from 1 files, 1 shards"."""

from trimtab.cli import main
from trimtab.words import all_of, counted


def test_the_noun_agrees_with_its_count():
    assert [counted(n, "document") for n in (0, 1, 2, 1024)] == [
        "0 documents",
        "1 document",
        "2 documents",
        "1,024 documents",
    ]
    assert all_of(1, "document") == "its only document" and all_of(3, "document") == "every one of its 3 documents"


def test_prepare_of_one_document_says_it_in_the_singular(tmp_path, capsys, tokenizer):
    tok_file = tmp_path / "tokenizer.json"
    tokenizer.save(tok_file)
    (tmp_path / "one.txt").write_text("A single short document of plain text, prepared on its own.\n" * 40)
    args = ["data", "prepare", str(tmp_path / "one.txt"), "--out", str(tmp_path / "p"), "--tokenizer", str(tok_file)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert " in 1 document from 1 file, 1 shard (" in out, out
