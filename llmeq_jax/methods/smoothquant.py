"""SmoothQuant (Xiao et al., 2022): move activation outliers into the weights before W8A8.

Per scale group (a producer and the linears reading its output, see
:mod:`llmeq_jax.methods.folding`) and input channel ``j``::

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

``X / s`` is folded into the producer (norm scale/bias, or the producing
linear's output columns) and ``s`` into the consumers' kernel rows, so the
served model has no extra op; the function is unchanged before quantization.
The calibrated input absmax of every consumer is divided by ``s`` as well, so
static per-tensor activation scales see the *smoothed* activations.

``alpha`` is a number in [0, 1] or ``"auto"``: per group, the value of
``alpha_grid`` whose W8A8 simulation (the recipe's weight spec and activation
spec) gives the lowest output error on the calibration sample.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.quantize import quantize_dequantize
from llmeq_jax.core.rules import get_path
from llmeq_jax.methods import folding
from llmeq_jax.methods.blockwise import fake_quant_act, option, options_from_args, quant_rule, rtn_block

@dataclasses.dataclass(frozen=True)
class SmoothQuantOptions:
    """SmoothQuant's ``method_args``."""

    alpha: float | str = option(0.5, (float, int, str),
                                lambda v: v == "auto" or (not isinstance(v, str) and 0 <= v <= 1),
                                "a number in [0, 1] or 'auto'")  # migration strength; 'auto' searches alpha_grid
    alpha_grid: tuple | list = option((0.3, 0.4, 0.5, 0.6, 0.7, 0.8), (list, tuple),
                                      lambda v: len(v) > 0 and all(isinstance(a, (int, float)) and 0 <= a <= 1
                                                                   for a in v),
                                      "a non-empty list of numbers in [0, 1]")
    min_scale: float = option(1e-5, (float,), lambda v: v > 0, "a positive number")


def smoothing_factors(x_absmax: jax.Array, w_absmax: jax.Array, alpha: float, min_scale: float = 1e-5) -> jax.Array:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha); channels with a zero max keep s = 1."""
    x_absmax = jnp.asarray(x_absmax, jnp.float32)
    w_absmax = jnp.asarray(w_absmax, jnp.float32)
    s = jnp.power(jnp.maximum(x_absmax, min_scale), alpha) / jnp.power(jnp.maximum(w_absmax, min_scale), 1 - alpha)
    s = jnp.where((x_absmax > 0) & (w_absmax > 0), s, 1.0)
    return jnp.maximum(s, min_scale)


def smooth_block(config, block: dict, block_stats: dict, alpha: float | dict, min_scale: float = 1e-5,
                 groups=None) -> tuple[dict, dict, dict]:
    """Fold smoothing factors into one float block -> (block, stats with smoothed absmax, factors per group).

    ``alpha`` is one number or a dict producer -> number. Groups whose
    consumers have no input statistics are left alone.
    """
    block_stats = {k: dict(v) for k, v in block_stats.items()}
    factors = {}
    for g in groups if groups is not None else folding.block_groups(config, block):
        keys = [f"{c}/kernel" for c in g.consumers]
        if not all(k in block_stats and "absmax" in block_stats[k] for k in keys):
            continue
        a = alpha.get(g.producer, SmoothQuantOptions.alpha) if isinstance(alpha, dict) else alpha
        s = _factors(config, block, block_stats, g, a, min_scale)
        block = folding.fold(config, block, g, s)
        rows = folding.expand_scales(config, g, s)
        for k in keys:
            for name in ("absmax", "sample"):
                if name in block_stats[k]:
                    block_stats[k][name] = block_stats[k][name] / rows
        factors[g.producer] = s
    return block, block_stats, factors


def _factors(config, block, block_stats, g, alpha, min_scale):
    x = jnp.max(jnp.stack([block_stats[f"{c}/kernel"]["absmax"] for c in g.consumers]), axis=0)
    xa = folding.reduce_to_scales(config, g, x, "max")
    wa = folding.reduce_to_scales(config, g, folding.group_weight_absmax(block, g), "max")
    return smoothing_factors(xa, wa, alpha, min_scale)


def _w8a8_error(config, block, block_stats, g, alpha, min_scale, rules):
    """Squared output error of the group's consumers under the recipe's W8A8, after smoothing with alpha."""
    s = _factors(config, block, block_stats, g, alpha, min_scale)
    rows = folding.expand_scales(config, g, s)
    err = 0.0
    for c in g.consumers:
        rule = rules[c]
        if rule is None:
            continue
        x = block_stats[f"{c}/kernel"]["sample"]
        w = get_path(block, f"{c}/kernel")
        ref = x @ w
        xs = fake_quant_act(x / rows, rule, block_stats[f"{c}/kernel"]["absmax"] / rows)
        err += float(jnp.sum((ref - xs @ quantize_dequantize(w * rows[:, None], rule.weight)) ** 2))
    return err


def search_alpha(config, block, block_stats, layer, recipe, grid, min_scale=1e-5) -> dict:
    """Per group, the alpha of ``grid`` with the lowest W8A8 output error on the calibration sample."""
    best = {}
    for g in folding.block_groups(config, block):
        keys = [f"{c}/kernel" for c in g.consumers]
        if not all(k in block_stats and "sample" in block_stats[k] for k in keys):
            continue
        rules = {c: quant_rule(recipe, layer, f"{c}/kernel") for c in g.consumers}
        if all(r is None for r in rules.values()):
            continue
        errs = [_w8a8_error(config, block, block_stats, g, a, min_scale, rules) for a in grid]
        best[g.producer] = float(grid[int(np.argmin(errs))])
    return best


def sequential(opts: SmoothQuantOptions) -> bool:
    return False  # statistics of the float model, as in the paper


def wants(opts: SmoothQuantOptions) -> tuple[str, ...]:
    return ("absmax", "sample") if opts.alpha == "auto" else ("absmax",)


def block_processor(config, recipe, opts: SmoothQuantOptions, info: dict):
    """process_block for calibrate: smooth the block, then RTN under the recipe (static scales from smoothed stats)."""
    info.setdefault("alpha", {})

    def process(layer, block, block_stats, inputs):
        del inputs
        if opts.alpha == "auto":
            alpha = search_alpha(config, block, block_stats, layer, recipe, opts.alpha_grid, opts.min_scale)
            info["alpha"][layer] = alpha
        else:
            alpha = float(opts.alpha)
        groups = [g for g in folding.block_groups(config, block)
                  if any(quant_rule(recipe, layer, f"{c}/kernel") is not None for c in g.consumers)]
        block, smoothed, _ = smooth_block(config, block, block_stats, alpha, opts.min_scale, groups)
        return rtn_block(block, layer, recipe, smoothed)

    return process


def parse_args(method_args: dict) -> SmoothQuantOptions:
    return options_from_args(SmoothQuantOptions, "smoothquant", method_args)
