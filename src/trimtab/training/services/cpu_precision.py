"""train.precision auto on a CPU with native bf16: keep bf16 autocast only where it speeds up this
model's own training step.

Native bf16 matmuls (AVX512-BF16, AMX) run about 2x fp32's at large sizes, which is all that
hardware.choose_precision measures. A step is more than large matmuls: autocast casts every
weight and activation it touches each step, and PyTorch's CPU flash attention runs its backward
slower in bf16 than in fp32 at every shape measured (torch 2.13: 1.07x slower at head dim 64,
T 256; 5.9x at head dim 24, T 64). Measured on an AVX512-BF16 EPYC (2 cores): `small` (d_model
256) trains 1.5x faster in bf16, while `debug` and `debug-moe` (d_model 96) train 1.3x and 1.8x
slower. So the step itself is timed, on a copy of the model (weights, buffers and the RNG
untouched): forward, loss and backward on random tokens shaped like a micro-batch (at most
PROBE_TOKENS), fp32 and bf16 interleaved PROBE_REPS times after a warm-up, or fewer where a step is
long (PROBE_BUDGET_S), best of each kept (other load only slows a step down). bf16 stays if it
is at least MARGIN faster: bf16's 8-bit mantissa is not worth less. The answer is cached per CPU,
torch, thread count, model shape and probe shape in $TRIMTAB_CACHE/cpu_precision.json, so a run
and its resumptions agree and the probe runs once.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import time

import torch

from trimtab.config import RunConfig
from trimtab.hardware import Precision, cached_timings, choose_precision, cpu_precision_path, machine_key
from trimtab.model import Transformer
from trimtab.training.loss import model_loss

log = logging.getLogger(__name__)

PROBE_TOKENS = 2048  # per timed step: large enough for the BLAS's steady rate on small models
PROBE_REPS = 3
# Seconds the probe's steps may take: rounds stop once another would overrun (one timed round
# after the warm-up at least). A moe-40m step is ~16 s in fp32 and ~9 s in bf16 on 2 cores, so
# its four rounds kept `trimtab plan --preset moe-40m` 2 min (more on a loaded host); now two.
# Debug-sized models (well under a second a step) still get every round.
PROBE_BUDGET_S = 30.0
MARGIN = 1.1  # bf16 must be at least this much faster than fp32
# Above this many parameters a step is matmul-bound and bf16 wins (1.6-1.7x measured from 4M up,
# `small` and `dense-25m`), while the probe's copy would double the model's memory: no probe.
PROBE_MAX_PARAMS = 100_000_000


def refine_cpu_precision(
    precision: Precision, cfg: RunConfig, model: Transformer, saved: str | None = None
) -> Precision:
    """`precision` as chosen from the hardware alone, or fp32 where train.precision is auto, the
    device a CPU, and bf16 autocast measured no faster on `model`'s training step. A resumed run
    keeps the precision its checkpoint was trained in (`saved`), so its resumption stays exact
    whatever the cache now says; a CPU without native bf16 trains in fp32 regardless."""
    if cfg.train.precision != "auto" or precision.device.type != "cpu" or precision.name != "bf16":
        return precision
    if saved in ("fp32", "bf16"):
        return dataclasses.replace(precision, name=saved, reason=f"{saved}, as the run trained so far (checkpoint)")
    if model.num_params() > PROBE_MAX_PARAMS:
        return dataclasses.replace(precision, reason=f"{precision.reason}; a model this large is matmul-bound")
    rows = max(1, min(cfg.train.micro_budget, PROBE_TOKENS) // cfg.data.seq_len)

    def measure() -> dict:
        log.info(
            "timing a training step of this model in fp32 and bf16 (once: a warm-up round, then timed rounds while "
            "they fit in %.0f s, one at least; cached in %s; train.precision fp32 or bf16 skips it)",
            PROBE_BUDGET_S,
            cpu_precision_path(),
        )
        return _probe(model, rows, cfg.data.seq_len)

    entry = cached_timings(probe_key(cfg, rows), measure)
    speedup = entry["fp32_s"] / entry["bf16_s"]
    measured = (
        f"this model's training step measured {speedup:.2f}x in bf16 autocast "
        f"(best of {entry.get('reps', PROBE_REPS)} steps each, {entry['measured']}, cached)"
    )
    if speedup >= MARGIN:
        return dataclasses.replace(precision, reason=f"{precision.reason}; {measured}")
    return dataclasses.replace(precision, name="fp32", reason=f"{measured}, under {MARGIN}x: fp32")


def run_precision(device: torch.device, cfg: RunConfig) -> Precision:
    """What a new run of `cfg` trains in on `device`: its train.precision, and for auto the hardware's
    choice, which on a CPU with native bf16 the model's own training step refines (through the same
    cache as the run, so `trimtab doctor`, `trimtab plan` and the run agree; the vocabulary as the
    tokenizer will make it, data.bpe_vocab_size, when the model follows it)."""
    from trimtab.config import derive
    from trimtab.model import build_model
    from trimtab.model.catalog import meta_model

    precision = choose_precision(device, cfg.train.precision)
    if cfg.train.precision != "auto" or device.type != "cpu" or precision.name != "bf16":
        return precision
    cfg = derive(cfg, {"model": {"vocab_size": cfg.model.vocab_size or cfg.data.bpe_vocab_size}})
    model = meta_model(cfg)  # the size without the memory: a large preset is not probed
    if model.num_params() <= PROBE_MAX_PARAMS:
        model = build_model(cfg.model)
    return refine_cpu_precision(precision, cfg, model)


def probe_key(cfg: RunConfig, rows: int) -> str:
    """What the answer depends on: the CPU, torch and its threads, the model's shape, the probe's."""
    shape = json.dumps(dataclasses.asdict(cfg.model), sort_keys=True, default=str)
    digest = hashlib.sha1(shape.encode()).hexdigest()[:12]
    return (
        f"{machine_key()} | model {digest}"
        f" | checkpointing {cfg.train.activation_checkpointing} | {rows} x {cfg.data.seq_len}"
    )


def _probe(model: Transformer, rows: int, seq_len: int, budget_s: float = PROBE_BUDGET_S) -> dict:
    """Best seconds of a forward + loss + backward in fp32 and in bf16 autocast, on a copy: a
    warm-up round, then up to PROBE_REPS timed rounds while the next (taken to last as long as
    the last) still ends within budget_s of steps; `reps` says how many were timed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        # a model built on the meta device (sharded later, distributed/metainit.py) has no values
        # to copy: the probe times its shape, with any weights
        probe = (Transformer(model.cfg) if model.lm_head.weight.is_meta else copy.deepcopy(model)).train()
        vocab = probe.lm_head.weight.shape[0]
        tokens = torch.randint(0, vocab, (rows, seq_len + 1), device=next(probe.parameters()).device)
        best = {"fp32": math.inf, "bf16": math.inf}
        spent, reps = 0.0, 0
        for rep in range(PROBE_REPS + 1):  # the first round warms up
            took = {name: _step_seconds(probe, tokens, torch.bfloat16 if name == "bf16" else None) for name in best}
            spent += sum(took.values())
            if rep:
                reps, best = rep, {name: min(best[name], took[name]) for name in best}
                if spent + sum(took.values()) > budget_s:
                    break
    return {
        "fp32_s": best["fp32"],
        "bf16_s": best["bf16"],
        "measured": datetime.date.today().isoformat(),
        "reps": reps,
    }


def _step_seconds(model: Transformer, tokens: torch.Tensor, dtype: torch.dtype | None) -> float:
    start = time.perf_counter()
    model_loss(model, tokens, dtype).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start
