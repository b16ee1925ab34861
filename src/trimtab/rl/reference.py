"""The frozen reference policy of DPO (rl/dpo.py) and of RL's KL term (`rl.kl_coef` > 0; off by
default, as in DAPO and Dr. GRPO, which found it holds the policy back on verifiable rewards):
the policy's starting weights, read from the run's own step-0 checkpoint. That checkpoint is kept
from pruning while either is on, so a resumed run compares with the same reference wherever
train.init_from has gone since. RL's objective adds kl_coef x GRPO's per-token estimator of
KL(pi || pi_ref) (Shao et al. 2024, eq. 4: pi_ref / pi - log(pi_ref / pi) - 1, unbiased and never
negative; rl/loss.py), evaluated at the rollouts' temperature as the policy is; DPO compares
the policy's log-probabilities of responses with the reference's (rl/dpo.py).

Shape legend: B rows, T positions, V vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trimtab.checkpoint_load import load_model
from trimtab.config import ModelConfig, RunConfig
from trimtab.errors import CheckpointError, ConfigError
from trimtab.model import Transformer, build_model
from trimtab.rl.loss import Temperature, target_logprobs


def reference_key(cfg: RunConfig) -> str | None:
    """What needs the reference in this run (rl.kl_coef, dpo), in its config's words; None: nothing."""
    if cfg.dpo.enabled:
        return "dpo" if cfg.dpo.uses_reference else None
    return "rl.kl_coef" if cfg.rl.enabled and cfg.rl.kl_coef else None


def check_reference(cfg: RunConfig) -> None:
    """A resumed run's reference is there, or the resume is refused before it writes config.yaml
    or journals its changes: the reference loads at the first step, and a run without a KL term
    kept no step-0 checkpoint, so a resume that turned rl.kl_coef on was journaled, its config
    rewritten, and then failed."""
    key = reference_key(cfg)
    if key is not None:
        check_sizes(reference_path(cfg.run_dir, key), key)


def resume_reference(cfg: RunConfig, device: torch.device) -> Transformer | None:
    """A resumed run's reference, loaded (every file's sha256 checked) before the resume rewrites config.yaml or
    journals its changes; None where nothing needs one. Loaded at the first step instead, a flipped byte of the
    right size had the changes journaled and config.yaml rewritten before the run stopped; loaded here it is read
    once, as it was then, only earlier."""
    check_reference(cfg)  # a missing or truncated file: said by its sizes, without reading the weights
    key = reference_key(cfg)
    return None if key is None else load_reference(cfg.model, cfg.run_dir, device, key)


def check_sizes(path: Path, key: str) -> None:
    """The reference's files are there at the sizes its manifest says (state.json), or ConfigError naming `key`
    and the way on: the cheap part of checkpoint.verify, which reads every byte (its sha256) when the reference
    loads (resume_reference: before a resume journals its changes)."""
    try:
        manifest = json.loads((path / "state.json").read_text())["manifest"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{key}: the reference policy's {path / 'state.json'} is unreadable ({exc}); "
            + _way_on(path.parent.parent, key)
        ) from None
    for name, entry in manifest.items():
        file, expected = path / name, entry.get("bytes") if isinstance(entry, dict) else None
        size = file.stat().st_size if file.is_file() else None
        if expected is not None and size != expected:
            found = "missing" if size is None else f"{size} bytes, the manifest says {expected}"
            raise ConfigError(
                f"{key}: the reference policy, the run's step-0 checkpoint, is damaged ({file}: {found}); restore "
                f"{path} from a copy, or {_way_on(path.parent.parent, key)}"
            )


def reference_path(run_dir: Path, key: str) -> Path:
    """The run's step-0 checkpoint, its reference; ConfigError naming `key` (what needs it) and
    the way on where it is gone."""
    path = Path(run_dir) / "checkpoints" / "step_000000"
    if path.is_dir():
        return path
    gone = "pruned or deleted"
    if key == "rl.kl_coef":  # the run may never have kept it: a run without the term does not
        gone = "pruned, deleted, or never kept: a run without a KL term keeps none"
    raise ConfigError(
        f"{key}: the reference policy is the run's step-0 checkpoint, and {path} is not there ({gone}); "
        + _way_on(run_dir, key)
    )


def _way_on(run_dir: Path, key: str) -> str:
    """What a run whose reference is gone or damaged can do instead."""
    if key != "rl.kl_coef":
        return "start a new run"
    return (
        "resume with rl.kl_coef=0, or start a new run from these weights with the term "
        f"(--out NEW --set train.init_from={run_dir} --set rl.kl_coef=...): its own step 0 is its reference"
    )


def load_reference(cfg: ModelConfig, run_dir: Path, device: torch.device, key: str = "rl.kl_coef") -> Transformer:
    """The run's starting policy, frozen, on `device`; `key`: what needs it (rl.kl_coef, dpo). A
    damaged one is refused naming `key` and the way on: it had said only that a file's checksum
    differs, as if the resume's own checkpoint were at fault (the resume had loaded that one)."""
    path = reference_path(run_dir, key)
    reference = build_model(cfg)
    try:
        load_model(reference, path)
    except CheckpointError as exc:
        raise ConfigError(
            f"{key}: the reference policy, the run's step-0 checkpoint, is damaged ({exc}); restore {path} "
            f"from a copy, or {_way_on(run_dir, key)}"
        ) from exc
    return reference.to(device).eval().requires_grad_(False)


@torch.no_grad()
def reference_logprobs(
    reference: Transformer, inputs: torch.Tensor, targets: torch.Tensor, temperature: Temperature, at: torch.Tensor
) -> torch.Tensor:
    """The reference's log-probability of each target [B, T] (inputs, targets [B, T]; `at` the
    responses' flat positions, rl/loss.py response_positions: 0 elsewhere, never read)."""
    return target_logprobs(reference.hidden(inputs), reference.lm_head.weight, targets, at, temperature)
