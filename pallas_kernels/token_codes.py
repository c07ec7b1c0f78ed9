"""A decode step's activations quantized per token for the W8A8 kernel in one launch, the RMSNorm before them too.

Why: a W8A8 product quantizes its x per token (``w8a8.quantize_rows``: the row's absmax, a division, rounding to
int8). XLA does that in its own fusions before the kernel, and at a decode step's few rows each product paid three
launches for it -- the absmax's one-block reduction, the scale, the conversion -- and a product after an RMSNorm
two more for the norm (``scripts/gpu_aot.py``, Llama-2-7B rtn-w8a8 decode on an H100: 21 launches a layer, 16 of
them XLA's small fusions). Here one program a row holds the row in registers, applies the norm where one is given
(its scale read in place from the stacked blocks, as ``pallas_kernels.rms_norm``), rounds it to x's dtype -- the
norm's output as the model would have written it -- and writes the row's int8 codes and its scale.

The math is ``w8a8.quantize_rows`` of ``rms_norm(x)`` (or of x): ``scale = max(absmax, tiny) / 127``,
``codes = clip(round_half_even(v / scale), -127, 127)``; with ``fp8``, E4M3 codes (FP8 W8A8 on sm_89+):
``scale = max(absmax, tiny) / 448`` and ``v / scale`` saturated at +-448 and converted to E4M3, stored as its bit
patterns in int8 (``fp8grid.encode``: the conversion rounds to nearest even, Triton's ``cvt.rn.satfinite`` on a GPU).
The norm's sum of squares is added in another order than XLA's, so a value within an ulp of a rounding boundary can
take the neighbouring code (tests). Dynamic per-token scales only: a static activation scale keeps XLA's quantization.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from llmeq_jax.core import fp8grid
from pallas_kernels import config, norm_fold, rms_norm
from pallas_kernels.common import TINY, compiler_params, div_rn, load_tile, next_pow2, round_half_even, span, store_tile
from pallas_kernels.w8a8 import QMAX, quantize_rows

MAX_ROWS = rms_norm.MAX_ROWS  # a decode step's rows (the row in registers, one program each)


def can_use(x_shape, x_dtype) -> tuple[bool, str]:
    """(True, "") when the kernel takes ``x``: a decode step's rows, the whole row in registers (the norm kernel's
    limits)."""
    return rms_norm.can_use(x_shape, x_dtype)


def _kernel(*refs, k, eps, stacked, normed, fp8, interpreted):
    layer = None
    if stacked:
        layer_ref, *refs = refs
        layer = layer_ref[0]
    x_ref, *scale_ref, q_ref, s_ref = refs
    kp = next_pow2(k)
    row = span(pl.program_id(0), 1, x_ref.shape[0], in_bounds=True)
    cols = span(0, kp, k, in_bounds=kp == k)
    x = load_tile(x_ref, row, cols, 0).astype(jnp.float32)
    if normed:  # rounded to x's dtype as the norm's output is
        x = rms_norm.normalize(x, scale_ref[0], cols, k, eps, layer).astype(x_ref.dtype).astype(jnp.float32)
    # XLA's arithmetic, step for step: its simplifier makes ``absmax / top`` a product with the float32 reciprocal,
    # and divides x by the scale as IEEE does (Triton's own ``/`` is within 2 ulp: common.div_rn)
    sx = jnp.maximum(jnp.max(jnp.abs(x), axis=1, keepdims=True), TINY) * _reciprocal(fp8grid.MAX if fp8 else QMAX)
    ratio = div_rn(x, sx, interpreted)
    if fp8:  # E4M3 bit patterns, XLA's encoding (saturated, then the conversion's rounding to nearest even)
        codes = fp8grid.encode(ratio)
    else:
        codes = jnp.clip(round_half_even(ratio), -QMAX, QMAX).astype(jnp.int8)
    store_tile(q_ref, row, cols, codes)
    store_tile(s_ref, row, span(0, 1, 1, in_bounds=True), sx)


def _reciprocal(top: float) -> jax.Array:
    """``1 / top`` rounded to float32 as XLA folds it."""
    return jnp.float32(np.float32(1) / np.float32(top))


def token_codes(x, *, norm: norm_fold.NormFold | None = None, layer=None, fp8: bool = False,
                interpret: bool | None = None):
    """(codes int8 (M, K), scale float32 (M, 1)) of ``x`` (M, K) quantized per token -- of ``rms_norm(x)`` with
    ``norm`` (its scale (K,), or with ``layer`` an int32 scalar a stack (L, K) read at that layer); ``fp8``: the
    codes are E4M3 bit patterns (FP8 W8A8)."""
    ok, why = can_use(x.shape, x.dtype)
    if not ok:
        raise ValueError(f"token_codes: {why}")
    m, k = x.shape
    args = [x]
    if norm is not None:
        norm_fold.check("token_codes", norm, k, layer)
        args.append(norm_fold.operand(norm, layer))
    elif layer is not None:
        raise ValueError("token_codes: layer= reads a stacked norm's scale; without norm= there is none to read")
    if layer is not None:
        args = [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), *args]
    eps = float(norm.eps) if norm is not None else 0.0
    interpreted = config.resolve_interpret(interpret)
    return pl.pallas_call(
        lambda *refs: _kernel(*refs, k=k, eps=eps, stacked=layer is not None, normed=norm is not None, fp8=fp8,
                              interpreted=interpreted),
        out_shape=(jax.ShapeDtypeStruct((m, k), jnp.int8), jax.ShapeDtypeStruct((m, 1), jnp.float32)),
        grid=(m,),
        compiler_params=compiler_params(4 if next_pow2(k) <= 4096 else 8, 1),
        interpret=interpreted,
        name="token_codes",
    )(*args)


def token_codes_reference(x, norm: norm_fold.NormFold | None = None, fp8: bool = False):
    """XLA's way: the norm (``rms_norm_reference``), then ``w8a8.quantize_rows``."""
    if norm is not None:
        x = rms_norm.rms_norm_reference(x, norm.scale, norm.eps)
    return quantize_rows(x, fp8=fp8)


__all__ = ["MAX_ROWS", "can_use", "token_codes", "token_codes_reference"]
