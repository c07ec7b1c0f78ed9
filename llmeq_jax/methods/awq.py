"""AWQ (Lin et al., 2023): activation-aware per-input-channel scaling, then weight clipping, for low-bit weights.

Per scale group (producer -> consumers, :mod:`llmeq_jax.methods.folding`):

1. scale search: ``s = mean|x|^a`` (normalised so ``sqrt(max s * min s) = 1``)
   for ``a`` on an ``n_grid``-point grid in [0, 1); the chosen ``a`` minimises
   the group's output error on the calibration sample
   ``sum_c ||X W_c - (X / s) Q(s W_c)||^2`` (``a = 0`` is ``s = 1``, plain RTN,
   so the search never does worse than RTN on the sample). ``1/s`` is folded
   into the producer and ``s`` into the consumers' rows.
2. clip search: per quantization tile (group x output channel) the clip ratio
   of ``n_clip`` points in [``min_clip``, 1] with the lowest error
   ``||X_g (W_g - Q_r(W_g))||^2`` on the (scaled) sample.

Kernels with no exact producer (gpt2's ``fc_out``) get the clip search only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.quantize import Spec, quantize, quantize_dequantize, scale_from_range, tile_for
from llmeq_jax.core.rules import RecipeError, get_path, set_path
from llmeq_jax.methods import folding
from llmeq_jax.methods.blockwise import block_kernel_paths, option, options_from_args, quant_rule

@dataclasses.dataclass(frozen=True)
class AWQOptions:
    """AWQ's ``method_args``."""

    n_grid: int = option(20, (int,), lambda v: v >= 1, "a positive integer")  # scale exponents tried
    n_clip: int = option(20, (int,), lambda v: v >= 1, "a positive integer")  # clip ratios tried
    min_clip: float = option(0.5, (float,), lambda v: 0 < v <= 1, "a number in (0, 1]")
    clip: bool = option(True, (bool,), lambda v: True, "true or false")  # search a clip ratio per group
    # AWQ + GPTQ: after the scales are folded, quantize each kernel with GPTQ (act order, static
    # groups from the scaled kernel) on the Hessian of the scaled inputs instead of the clip search.
    gptq: bool = option(False, (bool,), lambda v: True, "true or false")
    damp: float = option(0.01, (float,), lambda v: 0 < v <= 10, "a number in (0, 10]")


def parse_args(method_args: dict) -> AWQOptions:
    return options_from_args(AWQOptions, "awq", method_args)


def check_rule(path: str, rule) -> None:
    """AWQ searches weight grids; a static activation scale would need a second calibration pass."""
    if rule.act_static:
        raise RecipeError(f"awq: {path}: static activation scales are not supported; use dynamic per-token "
                          "activations (act_static: false) or no act spec")
    check_spec(path, rule.weight)


def check_spec(path: str, spec: Spec) -> None:
    axis = spec.axis if spec.axis is not None else spec.default_axis
    if spec.granularity not in ("group", "channel") or (spec.granularity == "group" and axis % 2 != 0) or (
        spec.granularity == "channel" and axis % 2 != 1
    ):
        raise RecipeError(f"awq: {path}: needs groups along the input dim or per-output-channel weight scales, "
                          f"got {spec.describe()}")
    if spec.clip is not None:
        raise RecipeError(f"awq: {path}: clip={spec.clip!r} is not supported (AWQ searches its own clip); remove it")


@functools.partial(jax.jit, static_argnames=("specs",))
def _scaled_errors(x, kernels, candidates, *, specs):
    """Per candidate row factors ``r`` (rows of ``candidates``): ``sum_c ||X W_c - (X/r) Q(r W_c)||^2``.

    One compiled call for the whole grid: the float outputs ``X W_c`` once, the candidates in a
    ``lax.map`` (one at a time, so memory stays that of one candidate).
    """
    targets = [x @ w for w in kernels]

    def error(rows):
        xr = x / rows
        return sum(jnp.sum((t - xr @ quantize_dequantize(w * rows[:, None], sp)) ** 2)
                   for t, w, sp in zip(targets, kernels, specs))

    return jax.lax.map(error, candidates)


def search_scale(config, group, xs: jax.Array, x_mean: jax.Array, kernels: list[jax.Array], specs: list[Spec],
                 n_grid: int) -> tuple[jax.Array, float, list[float]]:
    """The factors (one per producer channel) minimising the group's output error, the chosen exponent, errors."""
    x_mean = folding.reduce_to_scales(config, group, jnp.asarray(x_mean, jnp.float32), "mean")
    exponents = np.arange(n_grid) / n_grid
    cands = []
    for a in exponents:
        s = jnp.power(jnp.maximum(x_mean, 1e-8), a)
        cands.append(s / jnp.sqrt(jnp.max(s) * jnp.min(s)))
    rows = jnp.stack([folding.expand_scales(config, group, s) for s in cands])
    errs = [float(e) for e in np.asarray(_scaled_errors(xs, tuple(kernels), rows, specs=tuple(specs)))]
    best = int(np.argmin(errs))
    return cands[best], float(exponents[best]), errs


@functools.partial(jax.jit, static_argnames=("spec", "ratios"))
def clip_scale(x: jax.Array, w: jax.Array, *, spec: Spec, ratios: tuple[float, ...]):
    """Per tile, the grid (scale, zero point) of the clip ratio with the lowest ``||X_g (W_g - Q(W_g))||^2``.

    The error of a group is ``d^T (X_g^T X_g) d`` per column (``d = W_g - Q(W_g)``): with the
    group's Gram matrix formed once, each ratio costs ``g`` (not the sample's token count)
    multiply-adds per weight.
    """
    from llmeq_jax.core.qarray import int_range

    k, n = w.shape
    tile = tile_for(spec, w.shape)
    g = tile[0]
    n_groups = -(-k // g)
    pad = n_groups * g - k
    wpad = jnp.pad(w, ((0, pad), (0, 0)))
    xpad = jnp.pad(x, ((0, 0), (0, pad))).reshape(x.shape[0], n_groups, g)
    gram = jnp.einsum("tgi,tgj->gij", xpad, xpad)  # [G, g, g]
    wg = wpad.reshape(n_groups, g, n)
    lo_full = jnp.min(wg, axis=1)  # [G, n]
    hi_full = jnp.max(wg, axis=1)
    amax = jnp.maximum(-lo_full, hi_full)
    qmin, qmax = int_range(spec.bits)

    def tile_err(ratio):
        if spec.symmetric:
            scale, zp = scale_from_range(None, amax * ratio, spec.bits, True)
        else:
            scale, zp = scale_from_range(lo_full * ratio, hi_full * ratio, spec.bits, False)
        q = jnp.round(wg / scale[:, None, :])
        if zp is None:
            deq = jnp.clip(q, -qmax, qmax) * scale[:, None, :]
        else:
            deq = (jnp.clip(q + zp[:, None, :], qmin, qmax) - zp[:, None, :]) * scale[:, None, :]
        d = wg - deq
        return jnp.sum(d * jnp.einsum("gij,gjn->gin", gram, d), axis=1), scale, zp  # [G, n]

    best_err, best_s, best_z = tile_err(ratios[0])
    for r in ratios[1:]:
        e, s, z = tile_err(r)
        better = e < best_err
        best_err = jnp.where(better, e, best_err)
        best_s = jnp.where(better, s, best_s)
        if z is not None:
            best_z = jnp.where(better, z, best_z)
    if spec.granularity == "channel":  # one tile spans all rows: G == 1 already
        return best_s.reshape(1, n), best_z
    return best_s, best_z


def quantize_clipped(x, w, rule, n_clip, min_clip, clip: bool):
    """QArray of ``w`` with AWQ's clip search (or plain RTN scales when ``clip`` is off)."""
    spec = rule.weight
    if not clip:
        return quantize(w, spec, act_spec=rule.act)
    ratios = tuple(float(r) for r in np.linspace(1.0, min_clip, n_clip))
    scale, zp = clip_scale(x, w, spec=spec, ratios=ratios)
    return quantize(w, spec, scale=scale, zero_point=zp, act_spec=rule.act)


def sequential(opts: AWQOptions) -> bool:
    return False  # scales and clips are searched on the float model's activations


def wants(opts: AWQOptions) -> tuple[str, ...]:
    return ("abs_sum", "count", "sample", "hessian") if opts.gptq else ("abs_sum", "count", "sample")


def scaled_hessian(hessian: jax.Array, rows: jax.Array) -> jax.Array:
    """``H`` of the inputs ``X / rows`` (what the scaled kernel sees): ``diag(1/rows) H diag(1/rows)``."""
    inv = 1.0 / rows
    return hessian * inv[:, None] * inv[None, :]


def quantize_gptq(hessian, w, rule, damp: float, path: str):
    """QArray of ``w`` by GPTQ (act order, static groups) on ``hessian``."""
    from llmeq_jax.methods import gptq
    opts = gptq.GPTQOptions(damp=damp, act_order=True, static_groups=True)
    q, scale, zp, _ = gptq.gptq_quantize(w, hessian, rule.weight, opts, path=path)
    return gptq.to_qarray(q, scale, zp, rule.weight, w.dtype, rule.act)


def block_processor(config, recipe, opts: AWQOptions, info: dict):
    info.setdefault("exponent", {})

    def process(layer, block, block_stats, inputs):
        del inputs
        samples = {rel: block_stats[rel]["sample"] for rel in block_stats}
        chosen = {}
        hessians = {rel: block_stats[rel]["hessian"] for rel in block_stats} if opts.gptq else {}
        for g in folding.block_groups(config, block):
            rels = [f"{c}/kernel" for c in g.consumers]
            rules = [quant_rule(recipe, layer, r) for r in rels]
            if any(r is None for r in rules) or not all(r in block_stats for r in rels):
                continue  # scale a group only when every consumer is quantized (else float ones pay for nothing)
            for r, rule in zip(rels, rules):
                check_rule(f"layers_{layer}/{r}", rule)
            st = block_stats[rels[0]]
            kernels = [get_path(block, r) for r in rels]
            s, a, _ = search_scale(config, g, samples[rels[0]], st["abs_sum"] / st["count"], kernels,
                                   [r.weight for r in rules], opts.n_grid)
            block = folding.fold(config, block, g, s)
            rows = folding.expand_scales(config, g, s)
            for r in rels:
                samples[r] = samples[r] / rows
                if r in hessians:
                    hessians[r] = scaled_hessian(hessians[r], rows)
            chosen[g.producer] = a
        info["exponent"][layer] = chosen
        for rel in block_kernel_paths(block):
            rule = quant_rule(recipe, layer, rel)
            if rule is None:
                continue
            check_rule(f"layers_{layer}/{rel}", rule)
            w = get_path(block, rel)
            if opts.gptq:
                q = quantize_gptq(hessians[rel], w, rule, opts.damp, f"layers_{layer}/{rel}")
            else:
                q = quantize_clipped(samples[rel], w, rule, opts.n_clip, opts.min_clip, opts.clip)
            block = set_path(block, rel, q)
        return block

    return process
