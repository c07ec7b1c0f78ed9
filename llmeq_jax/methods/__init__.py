"""Quantization methods: each is ``(params, stats, recipe) -> params`` (DESIGN §2).

``rtn`` (round-to-nearest under the recipe's rules) needs no statistics.
The calibrated methods work one decoder block at a time, driven by
:func:`llmeq_jax.calibrate.calibrate` with ``process_block``; each lives in a
module of its own and exposes the same four functions:

  ``parse_args(method_args) -> cfg``       validated options (clear errors)
  ``wants(cfg) -> stats names``            what calibration collects per linear input
  ``sequential(cfg) -> bool``              whether block i+1 must see the *quantized* block i
  ``block_processor(config, recipe, cfg, info) -> process_block``
                                           ``(layer, block, block_stats, block_inputs) -> quantized block``

  smoothquant   fold s = max|X|^a / max|W|^(1-a) into the producer, then W8A8 RTN
  awq           activation-aware scale search + clip search (low-bit weights)
  gptq          Hessian-based row-by-row quantization with error feedback
  zeroquant     group-wise weights + per-token activations, optional LKD
  autoround     learned rounding offsets and clip ranges (signed gradient descent per block)

:func:`quantize_model` runs any recipe end to end (calibrating when needed).
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any, Callable

import numpy as np

from llmeq_jax.core.rules import Recipe, RecipeError, is_table, map_rules, quantize_leaf, quantize_params


def rtn(params: Any, stats: dict | None, recipe: Recipe) -> Any:
    """Round-to-nearest: each kernel quantized on its own grid, no calibration."""
    return quantize_params(params, recipe, stats=stats)


def _module(name: str) -> ModuleType:
    import importlib

    return importlib.import_module(f"llmeq_jax.methods.{name}")


CALIBRATED = ("smoothquant", "awq", "gptq", "zeroquant", "autoround")
# Methods that can only handle kernels inside decoder blocks (they need that block's inputs).
BLOCK_ONLY = {"awq", "gptq", "autoround"}


def _calibrated(name: str) -> Callable[[Any, dict | None, Recipe], Any]:
    def run(params, stats, recipe, *, config=None, windows=None):
        """As a plain function it needs ``config`` and calibration ``windows``; ``stats`` are recomputed."""
        if config is None or windows is None:
            raise RecipeError(f"method {name!r} calibrates block by block: call "
                              "llmeq_jax.methods.quantize_model(config, params, recipe, windows)")
        return quantize_model(config, params, recipe, windows)[0]

    run.__name__ = name
    return run


METHODS: dict[str, Callable[..., Any]] = {"rtn": rtn, **{m: _calibrated(m) for m in CALIBRATED}}
# Methods whose recipes need calibration statistics before they can run.
NEEDS_STATS: set[str] = set(CALIBRATED)


def get_method(name: str) -> Callable[[Any, dict | None, Recipe], Any]:
    if name not in METHODS:
        raise RecipeError(f"unknown method {name!r}; available: {sorted(METHODS)}")
    return METHODS[name]


def needs_calibration(recipe: Recipe) -> bool:
    """True when the recipe's method or a static activation scale needs calibration statistics."""
    return recipe.method in NEEDS_STATS or any(r.act_static for r in recipe.rules)


def apply_recipe(params: Any, recipe: Recipe, stats: dict | None = None) -> Any:
    return get_method(recipe.method)(params, stats, recipe)


# --------------------------------------------------------------------------- the driver


def _check_recipe(params: Any, recipe: Recipe) -> list[str]:
    """Run the rule checks of map_rules (unused rules warn, no match is an error); -> quantized kernel paths."""
    chosen: list[str] = []

    def note(path, w, rule):
        chosen.append(path)
        return w

    map_rules(params, recipe, note)
    return chosen


def quantize_model(config, params: dict, recipe: Recipe, windows: np.ndarray | None, progress: bool = False,
                   calibrate_fn=None) -> tuple[dict, dict]:
    """Quantize a model under ``recipe`` -> (params, info).

    ``windows`` ``[N, T]`` are the calibration token windows (needed by
    calibrated methods and static activation scales; ignored otherwise).
    ``info`` holds the method, the calibration size, the wall time and what
    the method chose (alphas, exponents, damping, LKD losses).
    ``calibrate_fn`` replaces ``calibrate.calibrate`` (same signature), e.g. the
    data-parallel one of :func:`llmeq_jax.distributed.quantize_model_sharded`.
    """
    from llmeq_jax import calibrate

    calib = calibrate_fn or calibrate.calibrate
    t0 = time.perf_counter()
    info: dict[str, Any] = {"method": recipe.method, "calib_samples": 0}
    get_method(recipe.method)  # unknown names fail here
    if needs_calibration(recipe) and windows is None:
        raise RecipeError(f"recipe {recipe.name!r} ({recipe.method}) needs calibration windows")
    if recipe.method == "rtn":
        stats = None
        if needs_calibration(recipe):
            stats, _ = calib(config, params, windows, wants=("absmax",), progress=progress)
            info["calib_samples"] = int(len(windows))
        out = quantize_params(params, recipe, stats=stats, progress=progress)
        info["seconds"] = time.perf_counter() - t0
        return out, info

    mod = _module(recipe.method)
    cfg = mod.parse_args(dict(recipe.method_args))
    chosen = _check_recipe(params, recipe)
    outside = [p for p in chosen if not p.startswith("layers_")]
    # The embedding table is round-to-nearest under every method (no block sees its input).
    beyond_blocks = [p for p in outside if not is_table(p)]
    if beyond_blocks and recipe.method in BLOCK_ONLY:
        raise RecipeError(
            f"{recipe.method} works on the linear layers inside decoder blocks, but recipe {recipe.name!r} also "
            f"quantizes {beyond_blocks}; add a skip rule for them first (e.g. pattern '.*lm_head.*', skip: true)"
        )
    process = mod.block_processor(config, recipe, cfg, info)
    _, out = calib(config, params, windows, wants=mod.wants(cfg), process_block=process,
                   keep=(), progress=progress, sequential=mod.sequential(cfg))
    info["calib_samples"] = int(len(windows))
    for path in outside:  # the embedding table, or an untied lm_head under SmoothQuant/ZeroQuant: plain RTN
        rule = recipe.rule_for(path)
        if rule.act_static:
            raise RecipeError(f"{recipe.method}: {path} is outside the decoder blocks, so calibration has no "
                              "input statistics for its static activation scale; skip it or use per-token act")
        out = _set_path(out, path, quantize_leaf(path, _get_path(out, path), rule))
    info["seconds"] = time.perf_counter() - t0
    return out, info


def _get_path(tree, path):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def _set_path(tree, path, value):
    head, _, rest = path.partition("/")
    out = dict(tree)
    out[head] = value if not rest else _set_path(tree[head], rest, value)
    return out


__all__ = ["METHODS", "NEEDS_STATS", "CALIBRATED", "apply_recipe", "get_method", "needs_calibration",
           "quantize_model", "rtn"]
