"""`data prepare` judges whether a source is mostly word salad per source, on its sample (junk.mostly_salad), as
training judges the source whole: judged per encode batch (one file's documents, shards.ENCODE_CHARS), a file of
real pages beside a larger file of salad in the same directory was under the bar, and its real pages were judged by
the full rule against the source's reference, mostly salad, which named them."""

import json

import numpy as np
import pytest

from test_junk_mostly_salad import source
from trimtab.data.prepare import Options, prepare
from trimtab.data.prepared import PreparedData

pytestmark = pytest.mark.usefixtures("one_thread")


def test_real_pages_in_their_own_file_beside_a_file_of_salad_are_not_named(tmp_path):
    texts, salad = source(500)  # ~110K words of salad beside ~35K real ones
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, which in (("a_real.jsonl", ~salad), ("b_salad.jsonl", salad)):
        (corpus / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in np.array(texts)[which]))
    out = tmp_path / "out"
    manifest = prepare([str(corpus)], out, vocab_size=400, options=Options(), workers=1)
    data = PreparedData(out)
    named = {data.source(d) for d in range(data.n_docs) if data.why.get(d, "").startswith("word salad")}
    real = sum(name.startswith(str(corpus / "a_real.jsonl")) for name in named)
    assert real <= 3, sorted(named)[:10]  # judged per batch: 21 of the 134 real pages
    assert len(named) - real > 0.6 * salad.sum()  # the salad still mostly named
    assert manifest["sources"][0]["salad"] is True
