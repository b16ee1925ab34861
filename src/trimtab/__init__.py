"""trimtab: a PyTorch LLM training stack that watches its own training and corrects it.

import trimtab
cfg = trimtab.load_config(preset="debug", overrides={"out": "runs/x"})
summary = trimtab.train(cfg)
print(trimtab.generate("runs/x", "def ", max_new_tokens=40))
"""

from importlib import import_module

from trimtab.errors import CheckpointError, ConfigError, DataError, TrimtabError

# Public names resolved on first use, so `trimtab --help` does not pay for importing torch.
_LAZY = {
    "train": "trimtab.api",
    "generate": "trimtab.api",
    "load_run": "trimtab.api",
    "load_config": "trimtab.config",
    "RunConfig": "trimtab.config",
}

__all__ = [*_LAZY, "TrimtabError", "ConfigError", "DataError", "CheckpointError"]
__version__ = "0.2.0"


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trimtab' has no attribute '{name}'")
