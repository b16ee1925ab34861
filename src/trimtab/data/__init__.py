"""Data pipeline: documents -> tokenizer -> token rows -> step / micro-batches.

Names resolve on first use: `trimtab data prepare`'s worker processes import the readers and
the tokenizer, never torch (batches.py's micro-batches need it), which would cost each worker ~1 s.
"""

from importlib import import_module

_LAZY = {
    "IGNORE_INDEX": "trimtab.data.batches",
    "BatchLoader": "trimtab.data.batches",
    "MicroBatch": "trimtab.data.batches",
    "Rows": "trimtab.data.packing",
    "StepBatch": "trimtab.data.batches",
    "TokenizedDocs": "trimtab.data.packing",
    "build_splits": "trimtab.data.packing",
    "eval_batches": "trimtab.data.held_out",
    "tokenize_documents": "trimtab.data.packing",
    "Document": "trimtab.data.sources",
    "corpus_fingerprint": "trimtab.data.sources",
    "read_documents": "trimtab.data.sources",
    "SPECIAL_TOKENS": "trimtab.data.tokenizer",
    "TextTokenizer": "trimtab.data.tokenizer",
    "get_tokenizer": "trimtab.data.tokenizer",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trimtab.data' has no attribute '{name}'")
