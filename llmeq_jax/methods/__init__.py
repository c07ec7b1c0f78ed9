"""Quantization methods and the driver that runs a recipe end to end: :func:`quantize_model`.

One signature for every method, the driver's:
``quantize_model(config, params, recipe, windows) -> (params, info)``.

``rtn`` (round-to-nearest under the recipe's rules, :func:`llmeq_jax.core.rules.quantize_params`)
needs no statistics (unless a rule asks for a static activation scale). The calibrated
methods work one decoder block at a time, driven by :func:`llmeq_jax.calibrate.calibrate`
with ``process_block``; each is a module of :data:`CALIBRATED` with the same four functions.

Options: each method module declares one frozen dataclass of its options, ``<Method>Options``
(``GPTQOptions``, ``AWQOptions``, ``SmoothQuantOptions``, ``ZeroQuantOptions``, ``AutoRoundOptions``;
``QATOptions`` for ``llmeq qat``), its fields made with :func:`llmeq_jax.methods.blockwise.option`
(default, accepted types, check, hint). ``parse_args`` builds it from the recipe's ``method_args``
through :func:`~llmeq_jax.methods.blockwise.options_from_args`: one RecipeError for unknown keys, one
per bad value. ``opts`` below is that dataclass; ``config`` is always the model's ModelConfig.

  ``parse_args(method_args) -> opts``      validated options (clear errors)
  ``wants(opts) -> stats names``           what calibration collects per linear input
  ``sequential(opts) -> bool``             whether block i+1 must see the *quantized* block i
  ``block_processor(config, recipe, opts, info) -> process_block``
                                           ``(layer, block, block_stats, block_inputs) -> quantized block``

  smoothquant   fold s = max|X|^a / max|W|^(1-a) into the producer, then W8A8 RTN
  awq           activation-aware scale search + clip search (low-bit weights)
  gptq          Hessian-based row-by-row quantization with error feedback
  zeroquant     group-wise weights + per-token activations, optional LKD
  autoround     learned rounding offsets and clip ranges (signed gradient descent per block)
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

import jax
import numpy as np

from llmeq_jax import calibrate
from llmeq_jax.core.rules import (Recipe, RecipeError, get_path, is_table, map_rules, quantize_leaf, quantize_params,
                                  set_path)
from llmeq_jax.methods import autoround, awq, distill, folding, gptq, rotate, sampled_text, smoothquant, zeroquant

# The calibrated methods by recipe name (a static table: adding a method is adding a line).
CALIBRATED: dict[str, ModuleType] = {"smoothquant": smoothquant, "awq": awq, "gptq": gptq, "zeroquant": zeroquant,
                                     "autoround": autoround}
METHODS: tuple[str, ...] = ("rtn", *CALIBRATED)
# Methods that can only handle kernels inside decoder blocks (they need that block's inputs).
BLOCK_ONLY = {"awq", "gptq", "autoround"}


def check_method(name: str) -> None:
    """A RecipeError naming the known methods when ``name`` is not one."""
    if name not in METHODS:
        raise RecipeError(f"unknown method {name!r}; available: {sorted(METHODS)}")


def needs_calibration(recipe: Recipe) -> bool:
    """True when the recipe's method, a static activation scale, ``rotate.smooth_down`` or ``finetune`` needs
    calibration text."""
    return (recipe.method in CALIBRATED or any(r.act_static for r in recipe.rules)
            or bool(recipe.rotate and recipe.rotate.get("smooth_down")) or recipe.finetune is not None)


def smooth_down_proj(config, params: dict, windows: np.ndarray, alpha: float, calib=None, progress: bool = False):
    """SmoothQuant's up_proj -> down_proj fold on the *float, unrotated* model (``rotate.smooth_down``).

    Per block, ``s_j = max|h_j|^alpha / max|W_down_j|^(1-alpha)`` from the calibrated absmax of down_proj's
    input ``h = silu(gate) * up`` (statistics of the float model, not sequential), folded into up_proj's
    output columns and down_proj's rows: the same function. The rotation that follows then spreads a
    smoothed ``h`` over all channels, so the few tokens whose ``h`` is huge in a few channels (SmolLM2's
    massive activations) no longer set down_proj's per-tensor static scale alone.
    """
    calib = calib or calibrate.calibrate
    group = folding.ScaleGroup("mlp/up_proj", "linear", ("mlp/down_proj",))

    def process(layer, block, block_stats, inputs):
        del layer, inputs
        return smoothquant.smooth_block(config, block, block_stats, alpha, groups=[group])[0]

    _, out = jax.block_until_ready(calib(config, params, windows, wants=("absmax",), process_block=process,
                                         keep=(), progress=progress, sequential=False))
    return out


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
                   calibrate_fn=None, finetune_windows: np.ndarray | None = None) -> tuple[dict, dict]:
    """Quantize a model under ``recipe`` -> (params, info).

    ``windows`` ``[N, T]`` are the calibration token windows (needed by
    calibrated methods and static activation scales; ignored otherwise).
    ``info`` holds the method, the calibration size, the wall time and what
    the method chose (alphas, exponents, damping, LKD losses).
    ``finetune_windows``: the training windows of the recipe's ``finetune`` step (default: the
    calibration windows cut to its ``seq_len``; more, fresh text over-fits less).
    ``calibrate_fn`` replaces ``calibrate.calibrate`` (same signature), e.g. the
    data-parallel one of :func:`llmeq_jax.distributed.quantize_model_sharded`.
    """
    check_method(recipe.method)
    if needs_calibration(recipe) and windows is None:
        raise RecipeError(f"recipe {recipe.name!r} ({recipe.method}) needs calibration windows")
    # The recipe's sampled sequences join the calibration windows of the method (not the fine-tuning's:
    # its `data` option says what it trains on)
    calib = None if windows is None else sampled_text.with_sampled(config, params, windows, recipe.calibration,
                                                                   progress)
    out, info = _apply_method(config, params, recipe, calib, progress, calibrate_fn or calibrate.calibrate)
    if recipe.finetune is not None:
        if finetune_windows is None:
            finetune_windows = distill.training_windows(windows, recipe.finetune["seq_len"])
        out, info["finetune"] = _finetune(config, out, params, recipe, finetune_windows, progress)
        info["seconds"] += info["finetune"]["seconds"]
    return out, info


def _finetune(config, qparams: dict, float_params: dict, recipe: Recipe, windows: np.ndarray, progress: bool):
    """The recipe's ``finetune`` step: the quantized model's scales (and latent weights) trained against the
    float model (the teacher: the params before any rotation, the same function) on ``windows``."""
    t0 = time.perf_counter()
    opts = distill.DistillOptions(**recipe.finetune)
    windows = distill.training_data(opts, windows, lambda n: sampled_text.sampled_windows(
        config, float_params, n, opts.seq_len, seed=opts.sample_seed, progress=progress))
    qparams, losses, n = distill.train(config, qparams, float_params, windows, opts, progress=progress)
    qparams = jax.block_until_ready(qparams)
    return qparams, {"kernels": n, "first_loss": losses[0], "last_loss": losses[-1],
                     "seconds": time.perf_counter() - t0}


def _apply_method(config, params: dict, recipe: Recipe, windows: np.ndarray | None, progress: bool, calib):
    """:func:`quantize_model` up to the method's quantized params (no fine-tuning step)."""
    t0 = time.perf_counter()
    info: dict[str, Any] = {"method": recipe.method, "calib_samples": 0}
    if recipe.rotate is not None:  # QuaRot pre-step: same function, outlier-free linear inputs
        t1 = time.perf_counter()
        if recipe.rotate.get("smooth_down"):
            params = smooth_down_proj(config, params, windows, recipe.rotate["smooth_down"], calib, progress)
        params = jax.block_until_ready(rotate.rotate_params(config, params, recipe.rotate))
        info["rotate"] = dict(recipe.rotate)
        info["rotate_s"] = time.perf_counter() - t1
    if recipe.method == "rtn":
        stats = None
        info["calib_s"] = 0.0
        if needs_calibration(recipe):
            t1 = time.perf_counter()
            stats, _ = jax.block_until_ready(calib(config, params, windows, wants=("absmax",), progress=progress))
            info["calib_s"] = time.perf_counter() - t1
            info["calib_samples"] = int(len(windows))
        out = quantize_params(params, recipe, stats=stats, progress=progress)
        info["seconds"] = time.perf_counter() - t0
        return out, info

    other = [r.pattern for r in recipe.rules if r.weight is not None and r.weight.grid != "uniform"]
    if other:  # their solvers round to uniform integer grids (GPTQ error feedback, AWQ/SmoothQuant searches)
        raise RecipeError(f"recipe {recipe.name!r}: method {recipe.method!r} works on uniform grids, but rules "
                          f"{other} ask for another grid; use method rtn for log2 and fp8 grids")
    mod = CALIBRATED[recipe.method]
    opts = mod.parse_args(dict(recipe.method_args))
    chosen = _check_recipe(params, recipe)
    outside = [p for p in chosen if not p.startswith("layers_")]
    # The embedding table, and a linear outside the blocks that a rule of its own names (an untied
    # lm_head), are round-to-nearest under every method (no block sees their input). A rule that
    # also reaches block kernels asked for the method there: refused under a block-only method.
    beyond_blocks = [p for p in outside if not is_table(p) and _rule_reaches_blocks(recipe, p, chosen)]
    if beyond_blocks and recipe.method in BLOCK_ONLY:
        raise RecipeError(
            f"{recipe.method} works on the linear layers inside decoder blocks, but recipe {recipe.name!r} also "
            f"quantizes {beyond_blocks} with a rule of the block kernels; add a skip rule for them first (e.g. "
            f"pattern '.*lm_head.*', skip: true), or a rule of their own (round-to-nearest)"
        )
    process = mod.block_processor(config, recipe, opts, info)
    method_s = [0.0]

    def timed_process(layer, block, block_stats, inputs):  # the method's own time, told apart from calibration's
        t1 = time.perf_counter()
        out = jax.block_until_ready(process(layer, block, block_stats, inputs))
        method_s[0] += time.perf_counter() - t1
        return out

    t1 = time.perf_counter()
    _, out = jax.block_until_ready(calib(config, params, windows, wants=mod.wants(opts), process_block=timed_process,
                                         keep=(), progress=progress, sequential=mod.sequential(opts)))
    # Calibration passes (statistics, and the next block's inputs) interleave with the method's
    # block steps: their time is the driver's wall time less the method's.
    info["calib_s"] = time.perf_counter() - t1 - method_s[0]
    info["calib_samples"] = int(len(windows))
    for path in outside:  # the embedding table, an untied lm_head with its own rule (or under SmoothQuant/ZeroQuant): RTN
        rule = recipe.rule_for(path)
        if rule.act_static:
            raise RecipeError(f"{recipe.method}: {path} is outside the decoder blocks, so calibration has no "
                              "input statistics for its static activation scale; skip it or use per-token act")
        out = set_path(out, path, quantize_leaf(path, get_path(out, path), rule))
    info["seconds"] = time.perf_counter() - t0
    return out, info


def _rule_reaches_blocks(recipe: Recipe, path: str, chosen: list[str]) -> bool:
    """Whether the rule that quantizes ``path`` is also the rule of a quantized kernel inside the blocks."""
    rule = recipe.rule_for(path)
    return any(recipe.rule_for(p) is rule for p in chosen if p.startswith("layers_"))


__all__ = ["BLOCK_ONLY", "CALIBRATED", "METHODS", "check_method", "needs_calibration", "quantize_model"]
