"""`trimtab eval RUN --data PREPARED_DIR` gave one figure for a directory prepared from several
sources (or files): now val_loss over it all and val_loss/NAME per source, named as a mixture's
sources are (web for web/ or web.txt), each target counted toward its own document's source."""

from __future__ import annotations

import json

import pytest
import torch

from trimtab.config import load_config
from trimtab.data.prepare import prepare
from trimtab.evaluation.held_out import prepared_figures
from trimtab.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")


def _sources(root):
    (root / "web").mkdir(parents=True)
    (root / "code").mkdir()
    (root / "web" / "web.txt").write_text("The quick brown fox jumps over the lazy dog. " * 60)
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 4}) for i in range(40)]
    (root / "code" / "code.jsonl").write_text("\n".join(lines) + "\n")
    return root / "web", root / "code"


def _parts(figures):
    return {k.split("/", 1)[1]: (figures[k], figures[f"targets/{k.split('/', 1)[1]}"]) for k in figures
            if k.startswith("val_loss/")}  # fmt: skip


def test_a_prepared_directory_is_scored_per_source_and_the_parts_make_the_total(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "tokenizer.json")
    web, code = _sources(tmp_path / "src")
    cfg = load_config(preset="debug", sets=[f"model.vocab_size={tokenizer.vocab_size}", "data.seq_len=32"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    for given in ([str(web), str(code)], [str(tmp_path / "src")]):  # two sources; one holding two files
        out = tmp_path / f"prep{len(given)}"
        prepare(given, out, tokenizer=str(tmp_path / "tokenizer.json"))
        got = prepared_figures(out, cfg, model, tokenizer, "all")
        parts = _parts(got)
        assert set(parts) == {"web", "code"}, got
        assert sum(n for _, n in parts.values()) == got["targets"]
        assert sum(loss * n for loss, n in parts.values()) / got["targets"] == pytest.approx(got["val_loss"], rel=1e-5)
        manifest = json.loads((out / "trimtab-data.json").read_text())
        tokens = {f["path"].rsplit("/", 2)[-2]: f["tokens"] for f in manifest["files"]}
        for name, (_, n) in parts.items():  # each target counted toward its own document's source
            assert tokens[name] - cfg.data.seq_len - 1 <= n <= tokens[name], (name, n, tokens)
