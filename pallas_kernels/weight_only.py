"""Weight-only matmul for int8 and packed int4 weights, dequantized in registers.

Contract (``(in, out)`` weights):
  x        (M, K)            float32 / bfloat16 / float16
  wq       (K, N) int8       (bits=8), or
           (ceil(K/2), N) uint8 (bits=4): byte = (v[2i] & 0xF) | ((v[2i+1] & 0xF) << 4),
                             two's complement nibbles packed along K (QArray layout)
  w_scale  (G, N) float32    G = 1 (per channel) or ceil(K / group)
  w_zero_point (G, N) int8 or None
  bias     (N,) or None
  -> y     (M, N) x.dtype

Math: y = sum_g (x_g @ (q_g - zp_g)) * s_g (+ bias), with the integer weights
converted to x's dtype in registers (exact: |q - zp| <= 255 fits bf16/fp16) and
float32 accumulation. No full-precision copy of the weight is ever written.

For int4 the kernel does not interleave the two nibbles of a byte back into
K order (Triton cannot stack along a non-last axis); it splits the x tile into
its even and odd K columns instead and runs two dots: x_even @ low + x_odd @ high.

Float32 activations use TF32x3 dots on the GPU (``common.f32_dot_precision``): a
default-precision float32 dot ran as single-pass TF32 on an H100 with jax 0.11.2.
Small (M, N) grids (decode) split the K loop over several programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import config
from pallas_kernels.blocks import Blocks, matmul_blocks
from pallas_kernels.common import (
    FLOAT_DTYPES,
    cdiv,
    dot,
    f32_dot_precision,
    high_nibble,
    is_pow2,
    launch_matmul,
    load_tile,
    low_nibble,
    span,
    split_pairs,
    store_tile,
)

SUPPORTED_BITS = (4, 8)


def _kernel(*refs, m, n, k, bits, blocks, group, has_zp, has_bias, split_blocks, split, precision):
    x_ref, w_ref, ws_ref = refs[:3]
    rest = list(refs[3:])
    zp_ref = rest.pop(0) if has_zp else None
    b_ref = rest.pop(0) if has_bias else None
    (o_ref,) = rest
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    cdt = x_ref.dtype  # dot operand dtype: integer weights are exact in it
    prec = precision if jnp.dtype(cdt) == jnp.float32 else None
    rows = span(pl.program_id(0) * bm, bm, m)
    cols = span(pl.program_id(1) * bn, bn, n)
    first = pl.program_id(2) * split_blocks
    last = jnp.minimum(first + split_blocks, cdiv(k, bk))

    def row_of(ref, g):
        return load_tile(ref, span(g, 1, ref.shape[0]), cols, 0).astype(jnp.float32)

    def body(kb, acc):
        xt = load_tile(x_ref, rows, span(kb * bk, bk, k), 0)
        zp = row_of(zp_ref, kb if group is not None else 0).astype(jnp.int32) if has_zp else 0
        if bits == 8:
            wt = load_tile(w_ref, span(kb * bk, bk, k), cols, 0).astype(jnp.int32)
            part = dot(xt, (wt - zp).astype(cdt), precision=prec)
        else:
            half = bk // 2
            packed = load_tile(w_ref, span(kb * half, half, w_ref.shape[0]), cols, 0).astype(jnp.int32)
            x_even, x_odd = split_pairs(xt)
            part = dot(x_even, (low_nibble(packed) - zp).astype(cdt), precision=prec) + dot(
                x_odd, (high_nibble(packed) - zp).astype(cdt), precision=prec
            )
        if group is None:
            return acc + part
        return acc + part * row_of(ws_ref, kb)

    acc = jax.lax.fori_loop(first, last, body, jnp.zeros((bm, bn), jnp.float32))
    if group is None:
        acc = acc * row_of(ws_ref, 0)
    if split:  # a float32 partial sum; bias and the cast come after the splits are added
        (rs, rm), (cs, cm) = rows, cols
        plgpu.store(o_ref.at[pl.program_id(2), rs, cs], acc, mask=rm[:, None] & cm[None, :])
        return
    if has_bias:
        acc = acc + row_of(b_ref, 0)
    store_tile(o_ref, rows, cols, acc.astype(o_ref.dtype))


def _check(x, wq, w_scale, w_zero_point, bits, group):
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"weight_only_matmul: bits={bits} is not supported; expected one of {SUPPORTED_BITS}")
    if x.ndim != 2 or wq.ndim != 2:
        raise ValueError(f"weight_only_matmul expects 2-D x and wq; got {x.shape} and {wq.shape}")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"weight_only_matmul: x must be float32/bfloat16/float16, got {x.dtype}")
    k = x.shape[1]
    want_rows, want_dtype = (k, jnp.int8) if bits == 8 else (cdiv(k, 2), jnp.uint8)
    if wq.shape[0] != want_rows or wq.dtype != want_dtype:
        raise ValueError(
            f"weight_only_matmul: int{bits} weights for K={k} must be {jnp.dtype(want_dtype).name} with "
            f"{want_rows} rows, got {wq.dtype} {wq.shape}"
        )
    groups = 1 if group is None else cdiv(k, group)
    if w_scale.shape != (groups, wq.shape[1]):
        raise ValueError(f"weight_only_matmul: w_scale has shape {w_scale.shape}, expected {(groups, wq.shape[1])}")
    if w_zero_point is not None and w_zero_point.shape != w_scale.shape:
        raise ValueError(f"weight_only_matmul: zero point shape {w_zero_point.shape} != scale shape {w_scale.shape}")
    if group is not None and not (is_pow2(group) and group >= 32):
        raise ValueError(f"weight_only_matmul: group size must be a power of two >= 32, got {group}")


def weight_only_matmul(
    x,
    wq,
    w_scale,
    *,
    bits: int,
    w_zero_point=None,
    bias=None,
    group: int | None = None,
    blocks: Blocks | None = None,
    k_splits: int | None = None,
    interpret: bool | None = None,
):
    """``x @ dequantize(w)`` with the weight dequantized tile by tile in registers.

    When the (M, N) tile grid is too small to fill the GPU (decode), the K loop is
    split over ``k_splits`` programs (default :func:`common.splits_for`) whose float32
    partial sums are added afterwards.
    """
    _check(x, wq, w_scale, w_zero_point, bits, group)
    m, k = x.shape
    n = wq.shape[1]
    # int4 splits the K tile in halves that feed dots: each half needs >= 16.
    blocks = blocks or matmul_blocks(m, n, k, group, min_bk=32 if bits == 4 else 16)
    if group is not None and blocks.bk != group:
        raise ValueError(f"weight_only_matmul: with per-group scales the K block must equal the group ({group})")
    interpret = config.resolve_interpret(interpret)
    args = [x, wq, w_scale.astype(jnp.float32)]
    if w_zero_point is not None:
        args.append(w_zero_point.astype(jnp.int8))
    return launch_matmul(_kernel, args, m=m, n=n, k=k, blocks=blocks, bias=bias, k_splits=k_splits, out_dtype=x.dtype,
                         interpret=interpret, name=f"weight_only_int{bits}_matmul", bits=bits, group=group,
                         has_zp=w_zero_point is not None, precision=f32_dot_precision(interpret))


def unpack_int4_rows(wq, k: int):
    """(ceil(K/2), N) packed bytes -> (K, N) int8 values (reference-side unpacking)."""
    b = wq.astype(jnp.int32)
    v = jnp.stack([low_nibble(b), high_nibble(b)], axis=1).reshape(-1, wq.shape[1])
    return v[:k].astype(jnp.int8)


def weight_only_reference(x, wq, w_scale, *, bits, w_zero_point=None, bias=None, group=None):
    """Pure-jnp reference of the kernel's math: per-group dots on integer weights, f32 accumulation."""
    _check(x, wq, w_scale, w_zero_point, bits, group)
    k = x.shape[1]
    q = wq if bits == 8 else unpack_int4_rows(wq, k)
    g = k if group is None else group
    y = jnp.zeros((x.shape[0], q.shape[1]), jnp.float32)
    for gi, k0 in enumerate(range(0, k, g)):
        qi = q[k0 : k0 + g].astype(jnp.int32)
        if w_zero_point is not None:
            qi = qi - w_zero_point[gi].astype(jnp.int32)
        part = jax.lax.dot(x[:, k0 : k0 + g], qi.astype(x.dtype), preferred_element_type=jnp.float32)
        y = y + part * w_scale[gi]
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def can_use(x_shape, x_dtype, bits: int, k: int, group: int | None) -> tuple[bool, str]:
    """(True, "") when the kernel takes this product, else (False, why)."""
    if bits not in SUPPORTED_BITS:
        return False, f"int{bits} weights (kernels exist for {SUPPORTED_BITS})"
    if len(x_shape) != 2 or x_shape[1] != k:
        return False, f"x must be (M, {k}), got {tuple(x_shape)}"
    if jnp.dtype(x_dtype) not in FLOAT_DTYPES:
        return False, f"activation dtype {jnp.dtype(x_dtype).name} is not float32/bfloat16/float16"
    if group is not None and not (is_pow2(group) and group >= 32):
        return False, f"group size {group} is not a power of two >= 32"
    return True, ""
