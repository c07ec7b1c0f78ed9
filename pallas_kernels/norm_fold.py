"""An RMSNorm folded into the decode product that reads its output.

Why: a decoder layer's two norms feed only products (q/k/v, gate/up), and at a decode step's few rows a norm
is one to two launches of its own (XLA's one-block reduction, then the scaling; or ``pallas_kernels.rms_norm``)
among the ~13-15 of a layer. The product already reads every value of x, so it can take the norm's work:

    rms_norm(x) @ w  =  rsqrt(mean(x^2) + eps) * ((x * scale) @ w)

The kernel reads x raw, multiplies each tile by the norm's scale on its way into the dots, adds up the squares
of the same tiles, and scales its float32 rows by the norm factor at the end. Split-K programs each see part of
K: they write their partial sums of squares beside their partial products (the programs of the first column tile
only), and ``common.sum_splits`` applies the factor while it adds the splits -- XLA fuses that into the loop it
runs anyway (deviceless H100 compile), so the norm costs no launch at all. Where the kernel adds its splits
itself (``pallas_kernels.split_fixup``) no program's loop adds squares: the last program of each tile sums the
squares of x's whole rows (:func:`row_squares`) when it makes the finished tile.

Rounding: the reference rounds ``x * rsqrt(...) * scale`` to x's dtype once before the product; the fold rounds
``x * scale`` once instead and applies the row factor in float32 -- one rounding of each operand either way (closer
to float32 where the scale is a power of two, as initialized norms are). A scale stored in x's own dtype multiplies
in it (the same rounding, a cheaper loop): ``llmeq_jax.decode_layout`` stores a stacked norm's scale so where that
loses nothing.

Kernels that fold: ``float_matmul``, ``int4_words`` and ``int8_f16`` (``norm=``; the last multiplies x by the
scale in bf16, then makes its float16 operands as before). ``llmeq_jax.normed_rows`` hands a norm's
output to them unevaluated.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import load_tile, span, store_matmul, tile_mask


class NormFold(NamedTuple):
    """The RMSNorm a matmul kernel applies to its x: ``scale`` (K,) -- or a stack (L, K) whose row at the
    matmul's ``layer`` is read in place -- and ``eps``."""

    scale: jax.Array
    eps: float


def check(name: str, norm: NormFold, k: int, layer) -> None:
    """One clear error unless ``norm`` fits a product of K = ``k`` inputs (stacked where ``layer`` is given)."""
    want = (k,) if layer is None else (None, k)
    shape = tuple(norm.scale.shape)
    if len(shape) != len(want) or shape[-1] != k or not jnp.issubdtype(norm.scale.dtype, jnp.floating):
        raise ValueError(f"{name}: the folded norm's scale must be a float ({k},)"
                         f"{'' if layer is None else f' stack (L, {k}) (the weights are read at layer=)'}, "
                         f"got {norm.scale.dtype} {shape}")
    if not float(norm.eps) > 0:
        raise ValueError(f"{name}: the folded norm's eps must be > 0, got {norm.eps}")


def operand(norm: NormFold, layer) -> jax.Array:
    """The norm's scale as the kernel reads it: rows (1, K), or (L, 1, K) read at the layer; in its own dtype (a
    conversion here would be XLA's pass over the whole stack every layer: the kernel converts its tiles)."""
    scale = norm.scale
    return scale.reshape(1, -1) if layer is None else scale.reshape(scale.shape[0], 1, -1)


def fold_tile(xt, scale_ref, ks, layer, squared: bool = True):
    """(the x tile times the norm's scale, in x's dtype; the tile's rows' sums of squares (bm, 1) in float32, or
    None unless ``squared``). ``ks``: the tile's K :func:`~pallas_kernels.common.span`."""
    scale = load_tile(scale_ref, span(0, 1, 1, in_bounds=True), ks, 0, layer)
    xf = xt.astype(jnp.float32)
    squares = jnp.sum(xf * xf, axis=1, keepdims=True) if squared else None
    if scale.dtype == xt.dtype:
        # one rounding either way (a product of two bf16 / f16 values is exact in float32), but in x's dtype it is
        # one packed multiply a pair (sm_90 HMUL2) where float32 unpacks and repacks every value: 911 -> 735
        # instructions a K step of the word kernel (570 without a fold)
        return xt * scale, squares
    return (xf * scale.astype(jnp.float32)).astype(xt.dtype), squares


def run(loop, folded: bool, split: bool, squares_after: bool = False):
    """``loop(squared)``, a kernel's K loop, where the rows' squares are needed: everywhere without K splits (each
    program scales its rows), and with them only in the first column tile's programs, which write them
    (:func:`store`) -- the other programs run the loop without (the squares were a third of the folded word
    kernel's loop in sm_90 SASS). The loop's sums of squares come last in what it returns. ``squares_after``
    (split K finished by the kernel): no program's loop adds squares (:func:`row_squares` after it)."""
    if squares_after and split:
        return loop(False)
    if not (folded and split):
        return loop(folded)
    return jax.lax.cond(pl.program_id(1) == 0, lambda: loop(True), lambda: loop(False))


def row_squares(x_ref, rows, k: int, chunk: int = 128):
    """The sums of squares (bm, 1) float32 of x's rows ``rows`` (a span) over all K, read in ``chunk`` columns."""
    def add(i, total):
        xt = load_tile(x_ref, rows, span(i * chunk, chunk, k, in_bounds=k % chunk == 0), 0).astype(jnp.float32)
        return total + jnp.sum(xt * xt, axis=1, keepdims=True)

    return jax.lax.fori_loop(0, -(-k // chunk), add, jnp.zeros((rows[0].size, 1), jnp.float32))


def store(o_ref, b_ref, acc, sumsq, program, *, split: bool, has_bias: bool, k: int, eps: float,
          fixup=None, x_ref=None, act: str | None = None) -> None:
    """Write a folding program's float32 (bm, bn) result: split, its partial product and (first column tile)
    its rows' partial sums of squares ``sumsq`` (bm, 1) -- ``o_ref`` is then the pair of outputs; else the rows
    scaled by their norm factor (then :func:`~pallas_kernels.common.store_matmul`'s bias and cast). ``fixup``
    (``o_ref`` a ``split_fixup.Refs``): the kernel finishes the tile, the norm factor from the loop's squares
    without splits, else from x's rows (``x_ref``) summed by the tile's last program. ``act``: store_matmul's."""
    if fixup:
        def factor():
            squares = sumsq if not split else row_squares(x_ref, program.rows, k)
            return jax.lax.rsqrt(squares / k + eps)

        store_matmul(o_ref, b_ref, acc, program, split=split, has_bias=has_bias, factor=factor, act=act)
        return
    if not split:
        store_matmul(o_ref, b_ref, acc * jax.lax.rsqrt(sumsq / k + eps), program, split=False, has_bias=has_bias,
                     act=act)
        return
    o_ref, sumsq_ref = o_ref
    store_matmul(o_ref, b_ref, acc, program, split=True, has_bias=has_bias)
    rows, one = program.rows, span(0, 1, 1, in_bounds=True)
    split_index = pl.program_id(2)  # read outside the branch: interpret mode has no program ids inside one

    @pl.when(pl.program_id(1) == 0)
    def _():
        plgpu.store(sumsq_ref.at[split_index, rows[0], one[0]], sumsq, mask=tile_mask(rows, one))


def outputs(fold: bool, split: bool) -> int:
    """The output refs of a kernel launched by ``common.launch_matmul``: two where it folds a norm over split K."""
    return 2 if fold and split else 1


__all__ = ["NormFold", "check", "fold_tile", "operand", "outputs", "row_squares", "run", "store"]
