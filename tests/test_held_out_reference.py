"""The orchestrator's row reference (RunView.held_out_row_losses, the median and spread the data
watch and the spike attribution judge rows against) is a sample spread over the whole held-out
split, drawn by the seed: it took val_loss's first micro-batches, the split's first rows, which
were one document where the split held four (debug preset with data.max_bytes=3000000: 64 rows,
all of one file). val_loss keeps its own rows."""

import logging
import random
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from trimtab.config import DataConfig, load_config
from trimtab.data.held_out import HeldOut, eval_rows
from trimtab.data.packing import Rows, build_splits
from trimtab.data.sources import Document
from trimtab.training import view as view_module
from trimtab.training.control import Control
from trimtab.training.view import RunView

pytestmark = pytest.mark.usefixtures("one_thread")
WORDS = "red green blue cyan magenta yellow black white orange purple brown grey".split()
N_DOCS = 12


@pytest.fixture
def rows(tokenizer):
    """Packed rows of 16 input positions over N_DOCS documents of about 10 rows each, named doc0.."""
    rng = random.Random(0)
    docs = [Document([(" ".join(rng.choice(WORDS) for _ in range(60)), True)], source=f"doc{i}") for i in range(N_DOCS)]
    return build_splits(DataConfig(seq_len=16, eval_fraction=0.0), tokenizer, docs, None, seed=0)[0]


class NoModel(torch.nn.Module):
    def moe_layers(self) -> list:
        return []

    def mod_layers(self) -> list:
        return []


def run_view(held: HeldOut) -> RunView:
    """A view of a trainer that holds `held` and nothing else it reads for the reference."""
    dist = SimpleNamespace(completing_forward=nullcontext, first_error=lambda error: error)
    trainer = SimpleNamespace(
        phases=[SimpleNamespace(eval_rows=held)],
        state=SimpleNamespace(phase=0),
        loader=SimpleNamespace(micro_batch_tokens=held.budget),
        model=NoModel(),
        forward=None,
        precision=None,
        device=torch.device("cpu"),
        dist=dist,
    )
    return RunView(trainer, Control(trainer))


def reference_rows(monkeypatch, held: HeldOut, limit: int) -> list[int]:
    """The rows held_out_row_losses scores: each row "scored" as its own index."""
    monkeypatch.setattr(
        view_module.scoring,
        "row_losses",
        lambda model, forward, precision, micro, device: [float(r) for m in micro for r in m.rows],
    )
    return [int(r) for r in run_view(held).held_out_row_losses(limit)]


def test_the_row_reference_spreads_over_the_held_out_documents_not_val_losss_first_rows(rows, monkeypatch):
    assert len(rows) >= 8 * N_DOCS
    scored = eval_rows(rows, 40 * 16)  # val_loss's rows: the first 40
    held = HeldOut([(rows, scored, "")], 64, pad_id=0)
    val_before = [m.rows for m in held.micro]
    picked = reference_rows(monkeypatch, held, 24)
    assert len(picked) == len(set(picked)) == 24
    documents = {s for r in picked for s in rows.sources(r)}
    assert documents == {f"doc{i}" for i in range(N_DOCS)}, sorted(documents)  # the first 24 rows: 2 documents
    assert max(picked) >= len(rows) - len(rows) // 24  # to the split's end, past val_loss's rows
    assert [m.rows for m in held.micro] == val_before  # val_loss scores its rows, as before
    assert sorted(reference_rows(monkeypatch, held, len(rows) + 1)) == list(range(len(rows)))  # all, when few


def test_the_reference_sample_is_the_seeds_and_splits_by_part(rows, monkeypatch):
    def sample(seed: int, limit: int = 24, part: str | None = None) -> list[int]:
        held = HeldOut([(rows, [0], "a"), (rows, [0], "b")], 64, pad_id=0, seed=seed)
        return [r for m in held.reference(limit, part) for r in m.rows]

    assert sample(1) == sample(1)  # the same rows at every read, in every process
    assert len({tuple(sample(seed)) for seed in range(4)}) > 1  # another seed, another sample
    assert len(sample(1, 24)) == 24 and len(sample(1, 12, "b")) == 12  # all the sets' rows, or a part's


def test_a_held_out_split_under_the_reference_rows_is_said_at_setup(rows, caplog):
    from trimtab.training.phase_data import _say_thin_reference  # here: the other tests run on code without it

    cfg = load_config(preset="debug", sets=["orchestrator.data.reference_rows=64"])
    caplog.set_level(logging.INFO, logger="trimtab.training.phase_data")
    _say_thin_reference(cfg, HeldOut([(rows, [0], "")], 64, pad_id=0), "data")
    assert caplog.text == ""  # its rows are enough
    nine = Rows(rows.tokens, rows.mask, rows.starts[:9], rows.lengths[:9])  # the debug preset's seed 3 split
    _say_thin_reference(cfg, HeldOut([(nine, [0], "")], 64, pad_id=0), "data")
    assert "holds 9 rows, under orchestrator.data.reference_rows=64" in caplog.text
    assert "raise data.eval_fraction or give data.eval_source" in caplog.text


def test_the_setup_note_counts_the_rows_the_reference_samples_not_flagged_ones(rows, caplog):
    """A flagged document's held-out rows, left out of the reference (HeldOut.reference), were counted."""
    from trimtab.training.phase_data import _say_thin_reference

    cfg = load_config(preset="debug", sets=["orchestrator.data.reference_rows=64"])
    caplog.set_level(logging.INFO, logger="trimtab.training.phase_data")
    flagged = frozenset(range(9, len(rows)))
    _say_thin_reference(cfg, HeldOut([(rows, [0], "")], 64, pad_id=0, skips=[flagged]), "data")
    assert "holds 9 rows, under orchestrator.data.reference_rows=64" in caplog.text  # before: all of them
