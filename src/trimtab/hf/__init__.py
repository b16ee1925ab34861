"""Hugging Face interop: export a run as a transformers model directory, and start a run (or
generate, evaluate, merge) from one. Architecture map in architectures.py, tensor names in
tensors.py; classes with no standard equivalent leave through remote/ (trust_remote_code)."""

from trimtab.hf.export import export_run
from trimtab.hf.importer import import_model, is_hf_dir, load_tokenizer, model_config, too_few_embeddings

__all__ = ["export_run", "is_hf_dir", "import_model", "load_tokenizer", "model_config", "too_few_embeddings"]
