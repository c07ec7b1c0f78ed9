"""A float (bf16 / f16 / f32) matmul that reads one layer of a stacked weight in place, for decode.

Why: inside the ``lax.scan`` over stacked decoder blocks, a float kernel reaches XLA's dot as a
dynamic slice of the ``[L, K, N]`` stack, and XLA copies the slice out before the dot (it hands a
GEMM whole buffers unless its dynamic-slice fusion is on) -- at decode, where the step is the
weights' streaming, three passes over them (read, write, read) instead of one. On an H200 the bf16
model of Llama-2-7B shapes decoded at 90 tok/s, a third of what its bytes allow. The quantized kernels
already read their layer in place (``layer=``); this is the same for float kernels: ``x @ w[layer]``
tile by tile, split K when the (M, N) grid is small, float32 accumulation (TF32x3 for float32).

Taken on a GPU unless a measured dispatch table says XLA's slice-and-dot is faster (kernel ``float``,
``scripts/bench_kernels.py --kinds bf16_stack``): ``llmeq_jax.kernel_dispatch.linear_float``.

Contract: x (M, K), w (K, N) or a stack [L, K, N] with ``layer``, both of one float dtype -> (M, N).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import config, norm_fold, settings
from pallas_kernels.blocks import Blocks
from pallas_kernels.common import (
    FLOAT_DTYPES,
    MIN_DOT,
    dot,
    f32_dot_precision,
    launch_matmul,
    load_tile,
    matmul_program,
    next_pow2,
    span,
    split_refs,
    store_matmul,
)

# (bm, bn, bk, warps, stages) for decode rows: a 128 x 128 half-precision weight tile is 32 KB a stage.
DECODE_BLOCKS = (16, 128, 128, 4, 3)
MAX_ROWS = 16  # the rows this kernel is meant for (decode steps); larger M is XLA's GEMM's


def _kernel(*refs, m, n, k, blocks, has_bias, split_blocks, split, stacked, precision, eps=None, fixup=None):
    """``eps``: x is a norm's input, folded here (:mod:`pallas_kernels.norm_fold`; its scale is the third input)."""
    folded = eps is not None
    layer, (x_ref, w_ref, *scale_ref), _, b_ref, o_ref = split_refs(
        refs, stacked=stacked, inputs=2 + folded, has_zp=False, has_bias=has_bias,
        outputs=norm_fold.outputs(folded, split), fixup=fixup)
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    prog = matmul_program(m, n, k, blocks, split_blocks)

    def body(kb, carry, squared: bool):
        acc, sumsq = carry
        ks = span(kb * bk, bk, k, in_bounds=prog.whole_k)
        xt = load_tile(x_ref, prog.rows, ks, 0)
        if folded:
            xt, squares = norm_fold.fold_tile(xt, scale_ref[0], ks, layer, squared)
            sumsq = sumsq + squares if squared else sumsq
        return acc + dot(xt, load_tile(w_ref, ks, prog.cols, 0, layer), precision=precision), sumsq

    def loop(squared: bool):
        sumsq = jnp.zeros((bm, 1), jnp.float32) if folded else ()
        return jax.lax.fori_loop(prog.first, prog.last, functools.partial(body, squared=squared),
                                 (jnp.zeros((bm, bn), jnp.float32), sumsq))

    acc, sumsq = norm_fold.run(loop, folded, split, squares_after=bool(fixup))
    if folded:
        norm_fold.store(o_ref, b_ref, acc, sumsq, prog, split=split, has_bias=has_bias, k=k, eps=eps,
                        fixup=fixup, x_ref=x_ref)
    else:
        store_matmul(o_ref, b_ref, acc, prog, split=split, has_bias=has_bias)


def can_use(x_shape, x_dtype, w_dtype, rows_max: int = MAX_ROWS) -> tuple[bool, str]:
    """(True, "") when the kernel takes ``x @ w``, else (False, why)."""
    if len(x_shape) != 2:
        return False, f"x must be 2-D, got {tuple(x_shape)}"
    if jnp.dtype(x_dtype) not in FLOAT_DTYPES or jnp.dtype(x_dtype) != jnp.dtype(w_dtype):
        return False, f"x {jnp.dtype(x_dtype).name} and weights {jnp.dtype(w_dtype).name} must be one float dtype"
    if x_shape[0] > rows_max:
        return False, f"{x_shape[0]} rows (the kernel is for decode steps of <= {rows_max})"
    return True, ""


def float_matmul(x, w, *, bias=None, layer=None, norm: norm_fold.NormFold | None = None, blocks: Blocks | None = None,
                 k_splits: int | None = None, residual=None, interpret: bool | None = None):
    """``x @ w`` (``w[layer]`` of a stack [L, K, N], read in place) with float32 accumulation; with ``norm``,
    ``rms_norm(x) @ w`` (:mod:`pallas_kernels.norm_fold`; the norm's scale stacked like ``w``); with ``residual``
    (M, N), ``residual + x @ w``, added by the kernel where it finishes the product itself
    (``pallas_kernels.split_fixup``; setting ``reduce``), else after it."""
    lead = 1 if layer is not None else 0
    if x.ndim != 2 or w.ndim != 2 + lead or x.shape[1] != w.shape[lead]:
        raise ValueError(f"float_matmul expects x (M, K) and w (K, N){' stacked [L, K, N] with layer=' if lead else ''};"
                         f" got {x.shape} and {w.shape}")
    ok, why = can_use(x.shape, x.dtype, w.dtype, rows_max=x.shape[0])
    if not ok:
        raise ValueError(f"float_matmul: {why}")
    m, k = x.shape
    n = w.shape[-1]
    if norm is not None:
        norm_fold.check("float_matmul", norm, k, layer)
    bm, bn, bk, warps, stages = DECODE_BLOCKS
    chosen = settings.of("float_matmul", m)
    own = Blocks(bm if m <= bm else min(64, next_pow2(m)), max(MIN_DOT, min(bn, next_pow2(n))),
                 max(MIN_DOT, min(bk, next_pow2(k))), warps, stages)
    blocks = blocks or chosen.blocks(own)
    interpret = config.resolve_interpret(interpret)
    precision = f32_dot_precision(interpret) if jnp.dtype(x.dtype) == jnp.float32 else None
    args, fold = [x, w], {}
    if norm is not None:
        args, fold = [x, w, norm_fold.operand(norm, layer)], dict(eps=float(norm.eps), fold_eps=float(norm.eps))
    return launch_matmul(_kernel, args, m=m, n=n, k=k, blocks=blocks, bias=bias,
                         k_splits=k_splits or chosen.k_splits, out_dtype=x.dtype, interpret=interpret,
                         name="float_matmul", layer=layer, programs=chosen.programs,
                         precision=precision, residual=residual, fixup=chosen.reduce != "xla", **fold)


__all__ = ["DECODE_BLOCKS", "MAX_ROWS", "can_use", "float_matmul"]
