"""Data pipeline: documents -> tokenizer -> token rows -> step / micro-batches."""

from trimtab.data.packing import (
    IGNORE_INDEX,
    BatchLoader,
    MicroBatch,
    Rows,
    StepBatch,
    TokenizedDocs,
    build_splits,
    eval_batches,
    tokenize_documents,
)
from trimtab.data.sources import Document, corpus_fingerprint, read_documents
from trimtab.data.tokenizer import SPECIAL_TOKENS, TextTokenizer, get_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "SPECIAL_TOKENS",
    "BatchLoader",
    "Document",
    "MicroBatch",
    "Rows",
    "StepBatch",
    "TextTokenizer",
    "TokenizedDocs",
    "build_splits",
    "corpus_fingerprint",
    "eval_batches",
    "get_tokenizer",
    "read_documents",
    "tokenize_documents",
]
