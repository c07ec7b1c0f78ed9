"""RMSNorm of a decode step's few rows in one kernel, its scale read in place from a stack of layers.

Why: at batch 1 XLA compiles ``x * rsqrt(mean(x^2) + eps) * scale`` to two kernels -- a one-block
reduction of the row to a scalar, then the scaling -- because its Triton normalization fusion (one
kernel, what batch 2 and up get) does not match a reduction whose other dims are all 1. A decoder
layer has two such norms, so four launches of a decode step's ~18 a layer are norms; here each is one.
Inside the scan over stacked blocks the norm's scale is a slice of a ``[L, K]`` stack: a custom call
given that slice has XLA copy it out (or address it through a dynamic-slice thunk, which keeps the
layer's kernels out of one command buffer), so the kernel takes the stack and the layer index, as the
matmul kernels do (``llmeq_jax.layer_slice``).

One program a row: the row (padded to a power of two, masked) in registers, its mean square in float32,
the scaled row written in the input's dtype -- the math of ``llmeq_jax.models.layers.RMSNorm``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import config
from pallas_kernels.common import FLOAT_DTYPES, compiler_params, load_tile, next_pow2, span, store_tile

MAX_ROWS = 16  # a decode step's rows; more rows are XLA's (one normalization fusion from 2 rows on)
MAX_K = 16384  # the row lives in registers: 16384 float32 values over 8 warps is 64 a thread


def can_use(x_shape, x_dtype) -> tuple[bool, str]:
    """(True, "") when the kernel takes an RMSNorm of ``x``, else (False, why)."""
    if len(x_shape) != 2:
        return False, f"x must be 2-D (rows, features), got {tuple(x_shape)}"
    if jnp.dtype(x_dtype) not in FLOAT_DTYPES:
        return False, f"x must be float32/bfloat16/float16, got {jnp.dtype(x_dtype).name}"
    if x_shape[0] > MAX_ROWS:
        return False, f"{x_shape[0]} rows (the kernel is for decode steps of <= {MAX_ROWS})"
    if x_shape[1] > MAX_K:
        return False, f"{x_shape[1]} features (at most {MAX_K})"
    return True, ""


def _kernel(*refs, k, eps, stacked):
    if stacked:
        layer_ref, x_ref, s_ref, o_ref = refs
        layer = layer_ref[0]
    else:
        (x_ref, s_ref, o_ref), layer = refs, None
    kp = next_pow2(k)
    row = span(pl.program_id(0), 1, x_ref.shape[0], in_bounds=True)
    cols = span(0, kp, k, in_bounds=kp == k)
    x = load_tile(x_ref, row, cols, 0).astype(jnp.float32)
    store_tile(o_ref, row, cols, normalize(x, s_ref, cols, k, eps, layer).astype(o_ref.dtype))


def normalize(x, scale_ref, cols, k: int, eps: float, layer=None):
    """Inside a kernel: the whole rows ``x`` (float32; columns past ``k`` zero) times ``rsqrt(mean(x^2) + eps)``
    times the norm's scale (``scale_ref`` (1, K), or a stack (L, 1, K) read at ``layer``), in float32 -- the norm's
    arithmetic, for every kernel that makes it (this one, ``token_codes``), to round as its output needs."""
    scale = load_tile(scale_ref, span(0, 1, 1, in_bounds=True), cols, 0, layer).astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / k + eps) * scale


def rms_norm(x, scale, eps: float, *, layer=None, interpret: bool | None = None):
    """``x * rsqrt(mean(x^2, -1) + eps) * scale`` for ``x`` (M, K), in float32, out in ``x``'s dtype.

    ``scale``: (K,) -- or with ``layer`` (an int32 scalar, traced or not) a stack (L, K) whose row ``layer``
    is read in place."""
    ok, why = can_use(x.shape, x.dtype)
    if not ok:
        raise ValueError(f"rms_norm: {why}")
    m, k = x.shape
    if scale.ndim != (1 if layer is None else 2) or scale.shape[-1] != k:
        want = f"({k},)" if layer is None else f"a stack (L, {k}) with layer="
        raise ValueError(f"rms_norm: scale must be {want}, got {scale.shape}")
    scale2 = scale.reshape(1, k) if layer is None else scale.reshape(scale.shape[0], 1, k)
    args = [x, scale2]
    if layer is not None:
        args = [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), *args]
    return pl.pallas_call(
        lambda *refs: _kernel(*refs, k=k, eps=float(eps), stacked=layer is not None),
        out_shape=jax.ShapeDtypeStruct((m, k), x.dtype),
        grid=(m,),
        compiler_params=compiler_params(4 if next_pow2(k) <= 4096 else 8, 1),
        interpret=config.resolve_interpret(interpret),
        name="rms_norm",
    )(*args)


def rms_norm_reference(x, scale, eps: float):
    """Pure-jnp reference (``models.layers.RMSNorm``'s math)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


__all__ = ["MAX_K", "MAX_ROWS", "can_use", "rms_norm", "rms_norm_reference"]
