"""Which tokenizer a run reads with, chosen before its data is built (training/phase_data.py): a resumed
run's own (RUN_DIR/tokenizer.json), the run or Hugging Face model train.init_from names, or
data.tokenizer; None where none is given and the run trains a BPE on its data. A damaged or
mismatched file is refused with the file and the fix."""

from __future__ import annotations

import logging
from pathlib import Path

from trimtab import hf
from trimtab.config import RunConfig
from trimtab.data import TextTokenizer
from trimtab.errors import ConfigError
from trimtab.rundir import CONFIG
from trimtab.training.init_from import run_dir_of

log = logging.getLogger(__name__)


def given_tokenizer(cfg: RunConfig, path: Path | None) -> TextTokenizer | None:
    """The tokenizer already chosen: `path` (tokenizer_source: this run's, resumed, or the run
    train.init_from names; a damaged one is refused with the way back), else data.tokenizer,
    else None."""
    if path is None:
        return _data_tokenizer(cfg) if cfg.data.tokenizer else None
    if path.parent == cfg.run_dir:
        return _run_dir_tokenizer(cfg, path)
    if hf.is_hf_dir(path.parent):  # a downloaded model's, not a run's
        fix = "download it again with the model, or save it again with tokenizer.save_pretrained"
    else:
        fix = "restore it (that run's tokenizer.json)"
    return TextTokenizer.load(path, key="train.init_from's tokenizer", fix=fix)


def _run_dir_tokenizer(cfg: RunConfig, path: Path) -> TextTokenizer:
    """RUN_DIR/tokenizer.json: the run's own where the run has started (config.yaml: prepare_run_dir
    writes it first), else one the user put into the new run directory, named as theirs in errors."""
    if (cfg.run_dir / CONFIG).is_file():  # a BPE trimtab trained comes out the same from the same data
        fix = (
            "it is the tokenizer this run trained with: restore it, or remove it and run the same command "
            "again, which makes it as the run first did (the resume checks that the data's rows still match)"
        )
        return TextTokenizer.load(path, key="the run's tokenizer", fix=fix)
    key = f"the tokenizer.json put into the new run directory (no run has started there: no {CONFIG})"
    fix = "fix or remove it (without it the run trains a BPE on its data), or set data.tokenizer to a good one"
    tok = TextTokenizer.load(path, key=key, fix=fix)
    log.info("tokenizer: %s, found in the new run directory (not made by trimtab: no %s beside it)", path, CONFIG)
    return tok


def _data_tokenizer(cfg: RunConfig) -> TextTokenizer:
    """data.tokenizer; beside a Hugging Face train.init_from it must tokenize as the model's own
    does, whose ids index the embeddings (another would be read under the wrong rows, silently)."""
    tok = TextTokenizer.load(Path(cfg.data.tokenizer), key="data.tokenizer")
    model_dir = Path(cfg.train.init_from)
    if not (cfg.train.init_from and hf.is_hf_dir(model_dir) and (model_dir / "tokenizer.json").is_file()):
        return tok
    own = hf.load_tokenizer(model_dir)
    if own.fingerprint != tok.fingerprint:
        raise ConfigError(
            f"config key 'data.tokenizer' ({cfg.data.tokenizer}) is not the tokenizer of train.init_from's model "
            f"({model_dir / 'tokenizer.json'}): {tok.difference(own)}; the model's embeddings are indexed by its "
            "own tokenizer's ids, so leave data.tokenizer unset (the model's is used) or point it at that file"
        )
    return tok


def tokenizer_source(cfg: RunConfig) -> Path | None:
    """A resumed run keeps its tokenizer; a finetune from another run or a Hugging Face model
    takes that one's. A model directory without one is refused: a BPE trained here would map
    text to ids other than those its embeddings were trained on."""
    if cfg.data.tokenizer:
        return None  # the user's own tokenizer.json, loaded by given_tokenizer
    candidates = [cfg.run_dir / "tokenizer.json"]
    if cfg.train.init_from:
        candidates.append(run_dir_of(cfg.train.init_from) / "tokenizer.json")
    found = next((path for path in candidates if path.is_file()), None)
    if found is None and cfg.train.init_from and hf.is_hf_dir(cfg.train.init_from):
        model_dir = cfg.train.init_from
        raise ConfigError(
            f"train.init_from '{model_dir}' has no tokenizer.json; fine-tuning needs the model's own tokenizer, "
            "whose ids its embeddings are indexed by (one trained on the data would map text to other ids): save "
            f"it into that directory (in transformers: AutoTokenizer.from_pretrained(<the model's name>)"
            f".save_pretrained('{model_dir}')), or set data.tokenizer to the model's tokenizer.json (with its "
            "tokenizer_config.json beside it)"
        )
    return found
