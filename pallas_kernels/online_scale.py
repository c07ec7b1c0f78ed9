"""Online scale tracking (asynchronous quantization): EMA of the absmax, then quantize with it.

Contract:
  x      (R, C) float (rows = tokens, columns = channels)
  state  previous range delta_{t-1}: (C,) per channel, () per tensor, or None (first step)
  -> (q (R, C) int8, new_state, scale, zero_point)

  absmax_t = max |x| over the tile (rows, per channel; or everything, per tensor)
  delta_t  = alpha * delta_{t-1} + (1 - alpha) * max(absmax_t, eps)      (delta_0 = max(absmax_1, eps))
  scale    = delta_t / qmax, q = clip(round_half_even(x / scale), -qmax, qmax)

The grid is symmetric, so the returned zero point is all zeros (int8, the
scale's shape); it is returned so callers can build a QArray-like triple.
Values beyond the tracked range are clipped: that is the point of tracking a
smoothed range instead of the instantaneous one.

One program per block of columns (per channel), or a single program looping over
all column blocks (per tensor, where the absmax is global).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import config
from pallas_kernels.common import FLOAT_DTYPES, TINY, cdiv, compiler_params, load_tile, next_pow2, quantize_sym, span, store_tile


def _kernel(x_ref, s_ref, q_ref, ns_ref, *, r, c, br, bc, per_tensor, alpha, eps, has_state, qmax):
    n_r = cdiv(r, br)
    col_blocks = cdiv(c, bc) if per_tensor else 1
    first = 0 if per_tensor else pl.program_id(0)
    one = span(0, 1, 1)

    def cols_of(cb):
        return span((first + cb) * bc, bc, c)

    def tile(cb, rb):
        return load_tile(x_ref, span(rb * br, br, r), cols_of(cb), 0).astype(jnp.float32)

    def col_absmax(cb):
        return jax.lax.fori_loop(
            0, n_r, lambda rb, a: jnp.maximum(a, jnp.max(jnp.abs(tile(cb, rb)), axis=0, keepdims=True)),
            jnp.zeros((1, bc), jnp.float32),
        )

    if per_tensor:
        amax = jax.lax.fori_loop(0, col_blocks, lambda cb, a: jnp.maximum(a, jnp.max(col_absmax(cb))), jnp.float32(0))
        amax = jnp.full((1, 1), amax, jnp.float32)
        state_cols = one
    else:
        amax = col_absmax(0)
        state_cols = cols_of(0)
    observed = jnp.maximum(amax, eps)
    if has_state:
        new = alpha * load_tile(s_ref, one, state_cols, 0) + (1.0 - alpha) * observed
    else:
        new = observed
    # (1, 1) per tensor, (1, bc) per channel; stored before broadcasting (Triton has no `slice`).
    store_tile(ns_ref, one, state_cols, new)
    new = jnp.broadcast_to(new, (1, bc))
    scale = new / qmax

    def quantize_column_block(cb, _):
        def quantize_tile(rb, _):
            q = quantize_sym(tile(cb, rb), scale, qmax)
            store_tile(q_ref, span(rb * br, br, r), cols_of(cb), q.astype(jnp.int8))
            return 0

        # Nested loops, not i // n, i % n: jnp's scalar `%` fails the Triton lowering here.
        return jax.lax.fori_loop(0, n_r, quantize_tile, 0)

    jax.lax.fori_loop(0, col_blocks, quantize_column_block, 0)


def _check(x, state, per_channel, bits):
    if x.ndim != 2 or jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"online_quantize expects float x of shape (rows, channels), got {x.dtype} {x.shape}")
    if bits not in (4, 8):
        raise ValueError(f"online_quantize: bits={bits}, expected 4 or 8")
    want = (x.shape[1],) if per_channel else ()
    if state is not None and tuple(state.shape) != want:
        raise ValueError(f"online_quantize: state has shape {tuple(state.shape)}, expected {want}")


def online_quantize(
    x,
    state=None,
    *,
    alpha: float = 0.9,
    eps: float = TINY,
    per_channel: bool = True,
    bits: int = 8,
    block_rows: int = 32,
    block_cols: int = 128,
    interpret: bool | None = None,
):
    """Quantize ``x`` with an EMA-tracked range; returns (q int8, new_state, scale, zero_point)."""
    _check(x, state, per_channel, bits)
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"online_quantize: alpha={alpha} must be in [0, 1)")
    r, c = x.shape
    br = max(1, min(block_rows, next_pow2(r)))
    bc = max(1, min(block_cols, next_pow2(c)))
    state_cols = c if per_channel else 1
    s_in = jnp.zeros((1, state_cols), jnp.float32) if state is None else state.astype(jnp.float32).reshape(1, state_cols)
    kernel = functools.partial(
        _kernel, r=r, c=c, br=br, bc=bc, per_tensor=not per_channel, alpha=float(alpha), eps=float(eps),
        has_state=state is not None, qmax=float(2 ** (bits - 1) - 1),
    )
    q, new = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((r, c), jnp.int8), jax.ShapeDtypeStruct((1, state_cols), jnp.float32)),
        grid=(cdiv(c, bc) if per_channel else 1,),
        compiler_params=compiler_params(),
        interpret=config.resolve_interpret(interpret),
        name="online_quantize",
    )(x, s_in)
    new = new.reshape(c) if per_channel else new.reshape(())
    scale = new / (2 ** (bits - 1) - 1)
    return q, new, scale, jnp.zeros(scale.shape, jnp.int8)


def online_quantize_reference(x, state=None, *, alpha=0.9, eps=TINY, per_channel=True, bits=8):
    """Pure-jnp reference of :func:`online_quantize`."""
    _check(x, state, per_channel, bits)
    qmax = 2 ** (bits - 1) - 1
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=0) if per_channel else jnp.max(jnp.abs(xf))
    observed = jnp.maximum(amax, eps)
    new = observed if state is None else alpha * state.astype(jnp.float32) + (1.0 - alpha) * observed
    scale = new / qmax
    q = jnp.clip(jnp.round(xf / scale), -qmax, qmax).astype(jnp.int8)
    return q, new, scale, jnp.zeros(scale.shape, jnp.int8)
