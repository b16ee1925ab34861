"""RL rollout generation speed: trimtab's batched KV-cached generation (rl/rollout.py) against
transformers' batched `generate` on the same weights, prompts and lengths, on CPU or a GPU.

    python bench/generate.py [--preset dense-25m] [--batch 64] [--new 32] [--reps 7] [--dry-run]
    python bench/generate.py --device cuda --dtype bf16 --preset dense-1b --new 128   # its own section

A random checkpoint of `preset`'s model (bench/interop.py's `make_run`) is exported to a
Hugging Face directory and loaded by transformers (LlamaForCausalLM), both in --dtype (fp32;
bf16 weights on a GPU) on --device (a GPU's figures go to a section of their own). `batch`
prompts of ragged lengths (8 to 24 tokens, left-padded for transformers with its attention mask)
are answered greedily with `new` tokens each and no end-of-text stop, so both make the same number
of tokens; the tokens themselves are compared (parity: the same greedy answers, a sign both
computed the same thing). Each round times trimtab and transformers back to back, the order
alternating between rounds, so their ratio pairs measurements made at the same moments of this
shared machine (a median of the rounds' ratios with its 95% bootstrap interval). Tokens/s count
generated tokens. Results go to the "RL rollout generation" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _benchfile import publish, scratch  # noqa: E402  bench/_benchfile.py, next to this file
from _measure import Contention, paired_ratio  # noqa: E402
from interop import make_run  # noqa: E402

HEADING = "## RL rollout generation (bench/generate.py)"


def prompts_of(batch: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 25, (batch,), generator=g).tolist()
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def heading(device: str) -> str:
    """The CPU's section, or a device's own (a GPU run never overwrites the CPU figures)."""
    return HEADING if device == "cpu" else f"## RL rollout generation on {device.upper()} (bench/generate.py)"


def ours(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    from trimtab.rl.rollout import generate

    # end of text: token 0, which no prompt holds; a row that draws it is padded with it to the
    # batch's end, as transformers (told no end of text) goes on: the same forwards either way
    out = [r.tokens for r in generate(model, prompts, new, eos_id=0, temperature=0.0)]
    return [t + [0] * (new - len(t)) for t in out]


def theirs(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
        )
    return out[:, width:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="dense-25m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--work", default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="both models' weights")
    ap.add_argument("--dry-run", action="store_true", help="debug, 8 prompts, 8 tokens, 2 rounds; no BENCHMARKS.md")
    args = ap.parse_args()
    if args.dry_run:
        args.preset, args.batch, args.new, args.reps = "debug", 8, 8, 2
    import torch
    import transformers

    from trimtab import api
    from trimtab.hf import export_run

    transformers.logging.set_verbosity_error()
    with scratch(args.work, "trimtab-generate-") as work:
        run, _ = make_run(args.preset, work)
        hf_dir = export_run(run, work / "hf")
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        _, model, _ = api.load_run(run)
        model = model.to(args.device, dtype).eval()
        reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(args.device).eval()
        reference.generation_config.eos_token_id = None
        prompts = prompts_of(args.batch, model.cfg.vocab_size)
        same = ours(model, prompts, args.new) == theirs(reference, prompts, args.new)  # also a warm-up
        times: dict[str, list[float]] = {"trimtab": [], "transformers": []}
        with Contention() as contention:
            for rep in range(args.reps):
                order = [("trimtab", model, ours), ("transformers", reference, theirs)]
                for name, m, fn in order if rep % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    fn(m, prompts, args.new)
                    times[name].append(time.perf_counter() - t0)
    tokens = args.batch * args.new
    ratio = paired_ratio(times["transformers"], times["trimtab"])  # > 1: trimtab is faster
    rate = {k: tokens / statistics.median(v) for k, v in times.items()}
    where = f"{torch.get_num_threads()} torch threads" if args.device == "cpu" else torch.cuda.get_device_name()
    size = sum(p.numel() for p in model.parameters())
    body = f"""`{args.preset}` (random weights, {args.dtype}, {size:,} parameters),
{args.batch} prompts of 8-24 tokens, {args.new} new tokens each, greedy, no end-of-text stop;
{where}; {args.reps} rounds, the two back to back in each.

| engine | tokens/s (median) | round times (s) |
|---|---|---|
| trimtab `rl.rollout.generate` | {rate["trimtab"]:,.0f} | {", ".join(f"{t:.2f}" for t in times["trimtab"])} |
| transformers `generate` | {rate["transformers"]:,.0f} | {", ".join(f"{t:.2f}" for t in times["transformers"])} |

trimtab against transformers: **{ratio}** (their time over ours: > 1, trimtab is faster).
The same greedy tokens: {"yes" if same else "no (rounding: the two differ in the order of their sums)"}.
"""
    publish(heading(args.device), body, precision=args.dtype, other_cpu=contention.other, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
