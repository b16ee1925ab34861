"""What the data path says of a file it cannot read and of one flagged document: a Latin-1 / cp1252 file is told
the command that converts it, as a UTF-16 file is; "1 of 1 document", not "documents"."""

import numpy as np
import pytest

from trimtab.data import junk
from trimtab.data.formats import Unreadable, records


def test_a_latin1_file_is_told_the_command_that_converts_it(tmp_path):
    """Before: "not UTF-8 text at line 1 (...); convert it to UTF-8", naming no encoding (UTF-16 named its iconv)."""
    path = tmp_path / "notes.txt"
    path.write_bytes("Caf\u00e9 cr\u00e8me \u2014 r\u00e9sum\u00e9\n".encode("cp1252"))
    with pytest.raises(Unreadable) as caught:
        list(records(path))
    assert f"iconv -f cp1252 -t utf-8 {path}" in str(caught.value)


def test_bytes_cp1252_leaves_undefined_are_told_latin1(tmp_path):
    path = tmp_path / "old.txt"
    path.write_bytes(b"na\xefve \x81 text\n")  # 0x81 has no cp1252 character
    with pytest.raises(Unreadable) as caught:
        list(records(path))
    assert f"iconv -f latin1 -t utf-8 {path}" in str(caught.value)


def test_the_junk_lines_say_one_document():
    flagged = [junk.Verdict("word salad", 0.1, junk.SMALL_BITS)]
    line = junk.report(flagged, np.array([True]), ["a.txt"], np.array([300]), "data.source", dropped=False)
    assert "1 of 1 document (" in line
