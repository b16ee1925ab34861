"""train.precision fp8: the model's linear layers train with float8 matmuls through torchao.

torchao's Float8Linear (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv
2209.05433) casts a linear layer's input and weight to e4m3 and the gradient of its output to
e5m2 (tensorwise) or everything to e4m3 (rowwise), each with a scale computed from its current
absolute maximum (dynamic scaling: no history to go stale after a rollback), and multiplies them
with torch._scaled_mm on float8 tensor cores; the weights, optimizer and everything else stay as
under bf16 autocast. Weights keep their names and fp32 storage, so checkpoints, resumption in
either precision and Hugging Face export are unchanged. As torchtitan does, the lm head (read by
the fused loss, never called), routers and layers whose sides are not multiples of 16 (the
kernel's requirement) stay in bf16. Expert weights (MoE's grouped_mm) stay in bf16 too: torchao's
float8 grouped GEMM is a prototype.
"""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise")


def _eligible(module: nn.Module, name: str) -> bool:
    """A linear layer float8 can run: not the lm head, both sides multiples of 16."""
    if not isinstance(module, nn.Linear) or name.split(".")[-1] == "lm_head":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def to_float8(model: nn.Module, recipe: str = "tensorwise") -> list[str]:
    """Swap `model`'s eligible nn.Linear layers for torchao Float8Linear, in place (the same
    weight Parameters: an optimizer built before or after sees the same tensors). Returns the
    names of the swapped layers."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe not in RECIPES:
        raise ValueError(f"float8 recipe must be one of {RECIPES}, got {recipe!r}")
    swapped = [name for name, module in model.named_modules() if _eligible(module, name)]
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=_eligible)
    log.info("float8 (%s scaling): %d linear layers; lm head, routers and experts stay bf16", recipe, len(swapped))
    return swapped
