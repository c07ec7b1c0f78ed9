"""Weight-only matrix-vector products for decode (M <= GEMV_MAX_ROWS): multiply and sum, no tensor-core dot.

Same contract and math as :func:`pallas_kernels.weight_only.weight_only_matmul` (int8 or nibble-packed
int4 weights, per-channel or per-group scales, zero points, bias), for a handful of rows.

Why a second formulation: at M = 1 the dot kernel pads x to a 16-row MMA tile and has Triton move
every dequantized weight tile into the MMA operand layout (through shared memory); on an H200 it
reached 0.98 TB/s, a fifth of the memory bandwidth, bound by that per-tile work and not by bytes.
Here each program dequantizes its (K step, N block) weight tile straight to float32 by bit patterns
(``dequant_int4(..., "magic")``: no int->float conversion, exact) and, per row of x, multiplies it
by that row's slice of x laid out as a column and sums over K (``tl.sum``): the weight tile stays in
the registers it was loaded into. The K loop is split over programs as in the dot kernel, so a decode
product still fills the GPU.

Rows are handled one by one (static loop; Triton keeps each as a (1, N block) accumulator), so the
kernel is for M <= GEMV_MAX_ROWS. Zero points come off through each row's sum of x, as in the dot
kernel. Not yet timed on a GPU: ``weight_only_matmul(..., gemv=True)`` selects it; the default
stays the dot kernel until ``scripts/tune_weight_only.py`` measures it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.blocks import Blocks
from pallas_kernels.common import cdiv, launch_matmul, load_tile, span, split_pairs, store_tile, tile_mask
from pallas_kernels.weight_only import dequant_int4

GEMV_MAX_ROWS = 4
# (bn, bk, warps, stages) of the default blocks: 128 output columns per program, one scale group
# (or 128 rows of K) per loop step.
DEFAULT_BLOCKS = (128, 128, 4, 3)


def _column(v):
    """(1, s) -> (s, 1): the same elements in the same order (a reshape, which Triton lowers)."""
    return v.reshape(v.shape[1], 1)


def _kernel(*refs, m, n, k, bits, blocks, group, has_zp, has_bias, split_blocks, split, stacked):
    rest = list(refs)
    layer = rest.pop(0)[0] if stacked else None
    x_ref, w_ref, ws_ref = rest[:3]
    rest = rest[3:]
    zp_ref = rest.pop(0) if has_zp else None
    b_ref = rest.pop(0) if has_bias else None
    (o_ref,) = rest
    bn, bk = blocks.bn, blocks.bk
    sub = group if group is not None else bk  # one scale group per inner step
    steps = bk // sub
    whole_k = k % bk == 0
    cols = span(pl.program_id(1) * bn, bn, n, in_bounds=n % bn == 0)
    rows = [span(r, 1, m, in_bounds=True) for r in range(m)]
    first = pl.program_id(2) * split_blocks
    last = jnp.minimum(first + split_blocks, cdiv(k, bk))

    def row_of(ref, g, lay=None):  # one (1, bn) row of a per-group array
        return load_tile(ref, span(g, 1, ref.shape[-2], in_bounds=whole_k), cols, 0, lay).astype(jnp.float32)

    def group_part(k0, g):
        """Per row r of x: x[r, k0:k0+sub] @ (q - zp)[k0:k0+sub], a (1, bn) float32 row."""
        ks = span(k0, sub, k, in_bounds=whole_k)
        if bits == 8:
            w = (load_tile(w_ref, ks, cols, 0, layer).astype(jnp.float32),)
        else:
            packed = load_tile(w_ref, span(k0 // 2, sub // 2, w_ref.shape[-2], in_bounds=whole_k), cols, 0, layer)
            w = dequant_int4(packed, jnp.float32, "magic")  # (low, high): even and odd K rows, exact
        zp = row_of(zp_ref, g, layer) if has_zp else None
        parts = []
        for r in range(m):
            xr = load_tile(x_ref, rows[r], ks, 0).astype(jnp.float32)  # (1, sub)
            xs = (xr,) if bits == 8 else split_pairs(xr)
            part = sum(jnp.sum(_column(xa) * wa, axis=0, keepdims=True) for xa, wa in zip(xs, w))
            if has_zp:
                part = part - jnp.sum(xr, axis=1, keepdims=True) * zp
            parts.append(part)
        return parts

    def body(kb, acc):
        for j in range(steps):
            g = kb * steps + j
            parts = group_part(g * sub, g if group is not None else 0)
            scale = row_of(ws_ref, g, layer) if group is not None else None
            acc = tuple(a + (p * scale if scale is not None else p) for a, p in zip(acc, parts))
        return acc

    acc = jax.lax.fori_loop(first, last, body, tuple(jnp.zeros((1, bn), jnp.float32) for _ in range(m)))
    if group is None:
        acc = tuple(a * row_of(ws_ref, 0, layer) for a in acc)
    for r, a in enumerate(acc):
        if split:  # float32 partial sums; bias and the cast come after the splits are added
            plgpu.store(o_ref.at[pl.program_id(2), rows[r][0], cols[0]], a, mask=tile_mask(rows[r], cols))
            continue
        if has_bias:
            a = a + row_of(b_ref, 0)
        store_tile(o_ref, rows[r], cols, a.astype(o_ref.dtype))


def gemv_blocks(k: int, n: int, group: int | None) -> Blocks:
    """Default blocks: DEFAULT_BLOCKS, the K step one group (or fitted to K), N not past the next power of two."""
    bn, bk, warps, stages = DEFAULT_BLOCKS
    bn = min(bn, 1 << max(4, (n - 1).bit_length()))
    bk = group if group is not None else min(bk, 1 << max(5, (k - 1).bit_length()))
    return Blocks(GEMV_MAX_ROWS, bn, bk, warps, stages)


def weight_only_gemv(x, wq, w_scale, *, bits, w_zero_point=None, bias=None, group=None, blocks=None, k_splits=None,
                     layer=None, interpret=False):
    """The GEMV formulation of ``weight_only_matmul`` (checked there): M <= GEMV_MAX_ROWS rows."""
    m, k = x.shape
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"weight_only_gemv takes at most {GEMV_MAX_ROWS} rows, got M={m} (use the dot kernel)")
    n = wq.shape[-1]
    blocks = blocks or gemv_blocks(k, n, group)
    if group is not None and blocks.bk % group:
        raise ValueError(f"weight_only_gemv: the K block ({blocks.bk}) must be a multiple of the group ({group})")
    if bits == 4 and blocks.bk % 2:
        raise ValueError(f"weight_only_gemv: int4 K blocks must be even, got {blocks.bk}")
    args = [x, wq, w_scale.astype(jnp.float32)]
    if w_zero_point is not None:
        args.append(w_zero_point.astype(jnp.int8))
    # one program row covers every row of x (the grid's M extent is 1)
    blocks = dataclasses.replace(blocks, bm=GEMV_MAX_ROWS)
    return launch_matmul(_kernel, args, m=m, n=n, k=k, blocks=blocks, bias=bias, k_splits=k_splits, out_dtype=x.dtype,
                         interpret=interpret, name=f"weight_only_int{bits}_gemv", bits=bits, group=group,
                         has_zp=w_zero_point is not None, layer=layer)
