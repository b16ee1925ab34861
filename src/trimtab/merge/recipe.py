"""A merge recipe in mergekit's YAML format, read and checked:

    merge_method: ties            # linear | slerp | task_arithmetic | ties | dare_linear | dare_ties | model_stock
    base_model: runs/base         # a trimtab run directory or a Hugging Face model directory
    models:
      - model: runs/ft-code
        parameters: {weight: 0.6, density: 0.5}
      - model: runs/ft-chat
        parameters: {weight: 0.4, density: 0.5}
    parameters: {normalize: true, lambda: 1.0}   # method-wide: t (slerp), normalize, rescale, lambda, filter_wise, seed
                                                 # and trimtab's own per_expert (merge/units.py)
    dtype: float32                # of the merged weights (the run keeps fp32 master weights)

Per-layer gradients (a list for a parameter) and `slices` are mergekit features trimtab does not
implement: refused with a clear message rather than read differently.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trimtab.config import read_yaml
from trimtab.errors import ConfigError

# method -> (sparsification, sign consensus, default normalize, default rescale); mergekit registry.py
TASK_ARITHMETIC = {
    "task_arithmetic": (None, False, False, False),
    "ties": ("magnitude", True, True, False),
    "dare_ties": ("random", True, False, True),
    "dare_linear": ("random", False, False, True),
}
METHODS = ("linear", "slerp", *TASK_ARITHMETIC, "model_stock")
RECIPE_KEYS = ("merge_method", "base_model", "models", "parameters", "dtype")
GLOBAL = {"t", "normalize", "rescale", "lambda", "filter_wise", "seed", "int8_mask", "per_expert"}
PER_MODEL = {"weight", "density"}
ZERO = 1e-8  # a weight sum this small divides to infinities (methods.task_arithmetic takes it as 0 too)


def same_model(path: str, base: Any) -> bool:
    """Whether a recipe path names the base model however it is spelt (`runs/base/`, `./runs/base`):
    compared as strings, a base listed under `models` so was merged as one more model (model_stock's
    ratio changed silently, slerp refused as having two models)."""
    if not isinstance(base, str) or not base:
        return False
    if "://" in path or "://" in base:  # object storage: no local path to resolve
        return path.rstrip("/") == base.rstrip("/")
    return Path(path).resolve() == Path(base).resolve()


@dataclass
class RecipeModel:
    """One model of a merge recipe (`models:`): its path and per-model parameters."""

    path: str
    weight: float = 1.0
    density: float = 1.0


@dataclass
class Recipe:
    method: str
    base: str | None
    models: list[RecipeModel]
    parameters: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"

    def others(self) -> list[RecipeModel]:
        """The models other than the base (listed under `models` too, as mergekit recipes do)."""
        return [m for m in self.models if m.path != self.base]

    def param(self, name: str, default: Any) -> Any:
        return self.parameters.get(name, default)


def read_recipe(source: str | Path | dict[str, Any]) -> Recipe:
    """A Recipe from a YAML file or its dict; ConfigError naming the key and the fix."""
    where = str(source) if not isinstance(source, dict) else "the recipe"
    data = dict(source) if isinstance(source, dict) else _read(Path(source))
    if not data:
        raise ConfigError(f"{where}: the recipe is empty; write merge_method, base_model and models (docs/merge.md)")
    for key in data:
        if key == "slices":
            raise ConfigError(f"{where}: 'slices' (layer ranges from several models) is not supported; use 'models'")
        if key not in RECIPE_KEYS:
            raise ConfigError(f"{where}: unknown key '{key}'{_near(key, RECIPE_KEYS)}")
    method = data.get("merge_method")
    if method is None:
        raise ConfigError(f"{where}: no merge_method; add one of {', '.join(METHODS)} (e.g. 'merge_method: ties')")
    if method not in METHODS:
        hint = _near(method, METHODS)
        raise ConfigError(f"{where}: merge_method {method!r} is not one of {', '.join(METHODS)}{hint}")
    base = data.get("base_model")
    models = [_model(m, i, where) for i, m in enumerate(data.get("models") or [])]
    for m in models:  # the base listed under `models` too, spelt otherwise: one path, so it is the base
        m.path = base if same_model(m.path, base) else m.path
    recipe = Recipe(method, base, models, _params(data.get("parameters"), GLOBAL, where, "parameters"))
    recipe.dtype = data.get("dtype", "float32")
    _check(recipe, where)
    return recipe


def _read(path: Path) -> dict[str, Any]:
    if path.is_dir():  # a run directory, without --method average
        raise ConfigError(
            f"{path} is a directory, not a recipe file; to average a run's checkpoints add --method average"
        )
    if not path.exists():
        raise ConfigError(f"recipe file '{path}' does not exist; check the path")
    return read_yaml(path)


def _model(entry: Any, i: int, where: str) -> RecipeModel:
    if not isinstance(entry, dict) or "model" not in entry:
        raise ConfigError(f"{where}: models[{i}] must be a mapping with a 'model' path")
    params = _params(entry.get("parameters"), PER_MODEL, where, f"models[{i}].parameters")
    return RecipeModel(str(entry["model"]), **params)


def _params(data: Any, allowed: set[str], where: str, key: str) -> dict[str, Any]:
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {key} must be a mapping")
    for name, value in data.items():
        if name not in allowed:
            raise ConfigError(f"{where}: unknown parameter '{key}.{name}' (known: {', '.join(sorted(allowed))})")
        if isinstance(value, (list, dict)):
            raise ConfigError(
                f"{where}: {key}.{name} is a list or mapping (a per-layer gradient or filter); "
                "trimtab takes one number per parameter"
            )
    return dict(data)


def _check(r: Recipe, where: str) -> None:
    if not r.models:
        raise ConfigError(f"{where}: 'models' is empty; list the models to merge")
    needs_base = r.method != "linear"
    if needs_base and not r.base:
        raise ConfigError(f"{where}: merge_method {r.method} needs 'base_model'")
    if r.method == "linear" and r.base and r.base not in [m.path for m in r.models]:
        raise ConfigError(f"{where}: linear merges the listed models; add base_model to 'models' or drop it")
    if r.method == "slerp" and ("t" not in r.parameters or len(r.others()) != 1):
        raise ConfigError(f"{where}: slerp needs parameters.t and exactly one model besides base_model")
    if r.method == "model_stock" and len(r.others()) < 2:
        raise ConfigError(f"{where}: model_stock needs at least two models besides base_model")
    _check_globals(r.parameters, where)
    for i, m in enumerate(r.models):
        for name in ("weight", "density"):
            value = getattr(m, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{where}: models[{i}].parameters.{name} {value!r} must be a finite number")
        if not 0 < m.density <= 1:
            raise ConfigError(f"{where}: models[{i}].parameters.density {m.density} must be in (0, 1]")
    if r.method == "linear" and r.param("normalize", True) and abs(sum(m.weight for m in r.models)) < ZERO:
        raise ConfigError(
            f"{where}: the models' weights sum to 0, and linear with normalize (the default) divides by their sum; "
            "change a weight, or set parameters.normalize: false to add the weighted models as they are"
        )
    if r.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"{where}: dtype {r.dtype!r} must be float32, bfloat16 or float16")


FLAGS = ("normalize", "rescale", "filter_wise", "int8_mask", "per_expert")
NUMBERS = ("t", "lambda")


def _check_globals(parameters: dict[str, Any], where: str) -> None:
    """Method-wide parameters of the type they are read as, checked before any model loads: a
    string for t or lambda failed with a traceback once every input was loaded (minutes), and
    any string for a flag (normalize: "false") read as true."""
    for name, value in parameters.items():
        if name in FLAGS and not isinstance(value, bool):
            raise ConfigError(f"{where}: parameters.{name} must be true or false (unquoted), not {value!r}")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if name in NUMBERS and not (number and math.isfinite(value)):
            raise ConfigError(f"{where}: parameters.{name} must be a finite number, not {value!r}")
        if name == "seed" and not (number and math.isfinite(value) and value == int(value)):
            raise ConfigError(f"{where}: parameters.seed must be a whole number, not {value!r}")


def _near(name: object, names: tuple[str, ...]) -> str:
    """ "; did you mean 'X'?" for a misspelt name close to one of `names`, else ''."""
    near = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
    return f"; did you mean '{near[0]}'?" if near else ""
