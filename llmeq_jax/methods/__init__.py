"""Quantization methods: each is ``(params, stats, recipe) -> params`` (DESIGN §2).

``rtn`` (round-to-nearest under the recipe's rules) needs no statistics;
calibrated methods (SmoothQuant, AWQ, GPTQ, ZeroQuant) register here as they
land, each in a module of its own.
"""

from __future__ import annotations

from typing import Any, Callable

from llmeq_jax.core.rules import Recipe, RecipeError, quantize_params


def rtn(params: Any, stats: dict | None, recipe: Recipe) -> Any:
    """Round-to-nearest: each kernel quantized on its own grid, no calibration."""
    return quantize_params(params, recipe, stats=stats)


METHODS: dict[str, Callable[[Any, dict | None, Recipe], Any]] = {"rtn": rtn}
# Methods whose recipes need calibration statistics before they can run.
NEEDS_STATS: set[str] = set()


def get_method(name: str) -> Callable[[Any, dict | None, Recipe], Any]:
    if name not in METHODS:
        raise RecipeError(f"unknown method {name!r}; available: {sorted(METHODS)}")
    return METHODS[name]


def needs_calibration(recipe: Recipe) -> bool:
    """True when the recipe's method or a static activation scale needs calibration statistics."""
    return recipe.method in NEEDS_STATS or any(r.act_static for r in recipe.rules)


def apply_recipe(params: Any, recipe: Recipe, stats: dict | None = None) -> Any:
    return get_method(recipe.method)(params, stats, recipe)
