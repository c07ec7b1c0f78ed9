"""Weight-only int4 matmul for prompts, reading the decode layout's words with the weights as Hopper's A operand.

Why another kernel: a prompt's product (hundreds to thousands of rows) is compute-bound, so the int4 weights only
need to reach the tensor cores as bf16 / f16 operands without slowing them. The checkpoint-layout dot kernel
(:mod:`pallas_kernels.weight_only`) took 0.27-0.34x bf16 at 512-4096 rows on an H200: it applies each scale group's
scale to a float32 partial product, so every K step waits for its wgmma to finish (sm_90 SASS: ``HGMMA`` then
``WARPGROUP.DEPBAR.LE gsb0, 0x0``). XLA's path (0.88-0.96x) first writes the dequantized weights in bf16.

Here the problem is transposed, ``y^T = dequantize(W)^T @ x^T``, as Hopper's mixed-input GEMMs do: the weights are
the dot's A operand, which wgmma reads from registers, so the dequantized tile never goes back to shared memory;
``x^T``, the B operand, streams through Triton's cp.async pipeline. Each weight is dequantized once per program
(reused by all of its ``bm`` token rows): the nibble becomes ``code_offset + value`` by bit patterns
(:func:`pallas_kernels.int4_words.nibble_asm`, two values per ``prmt`` + ``lop3``), minus ``code_offset + zero
point`` (exact), times the group's float32 scale, rounded once into x's dtype: the weights XLA's dequantize-then-dot
multiplies, bit for bit. The scales sit on the weights, not on the accumulator, so it runs uninterrupted over K; the
eight 16-row slices of a word block (:func:`~pallas_kernels.int4_words.pack_words`: slice ``j`` holds K rows ``16 j
.. 16 j + 15``) are joined into one ``(bn, 128)`` operand, one dot a word block. In sm_90 SASS
(``scripts/kernel_sass.py``, case ``wo_int4_m2048_words``: 2048 x 4096 x 11008, 256-row tiles) a word block is eight
``HGMMA.64x256x16`` with the A operand in registers, in two chains of four with one chain in flight
(``WARPGROUP.DEPBAR.LE gsb0, 0x1``), 478 instructions a thread (~950 issue cycles of 8 warps against ~2 050 of the
tensor cores' for its 4.2 M products), 254 registers, no spills, 137 KB of shared memory; XLA's own Triton (jaxlib
0.11.2, ``scripts/gpu_aot.py --prefill 2048 --sass``, a Llama-2-7B layer) compiles it to 448-452 instructions and
212-245 registers. The checkpoint-layout kernel's 819 instructions cover half the products and wait for each wgmma.
Not yet timed on a GPU.

It reads the words :func:`pallas_kernels.int4_words.int4_words_matmul` reads for decode steps, so one copy of the
weights could serve both. Half activations only (the weights become x's dtype).

Contract (as :func:`~pallas_kernels.int4_words.int4_words_matmul`):
  x        (M, K)              bfloat16 / float16
  words    (K'/8, N) int32     :func:`~pallas_kernels.int4_words.pack_words` of the int4 values
  w_scale  (G, N)              G = 1 (per channel) or ceil(K / group)
  w_zero_point (G, N) int8 or None; exact for zero points in [-120, 119] (int4 grids: [-8, 7])
  bias     (N,) or None
  -> y     (M, N) x.dtype
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import config, offsets
from pallas_kernels.blocks import Blocks
from pallas_kernels.common import (cdiv, compiler_params, dot, load_tile, next_pow2, span, split_refs, store_tile,
                                   weight_operands)
from pallas_kernels.int4_words import NIBBLES, SLICE, WORD_BLOCK, check_words, code_offset, nibble_operands

HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# 128 weight columns a program over 8 warps: 64 a warpgroup, wgmma's M (with 128 a warpgroup Triton moved the A
# operand through shared memory in sm_90 SASS: 700+ instructions a word block against ~300); bm token rows (wgmma's
# N, up to 256) from the rows (:func:`default_blocks`). Three stages of a 256-row x tile and a word block take
# 3 x 72 KB of shared memory; two at 256 rows leave room for the operand conversions.
DEFAULT_BN, DEFAULT_WARPS = 128, 8
WIDE_M = 1024  # from this many rows on, 256-row x tiles (half the dequantization per product)


def default_blocks(m: int, n: int) -> Blocks:
    """``bm`` token rows (16..256: 256 from :data:`WIDE_M` rows on), :data:`DEFAULT_BN` weight columns, one word
    block (128 K rows) a step."""
    bm = 256 if m >= WIDE_M else min(128, max(16, next_pow2(m)))
    return Blocks(bm, DEFAULT_BN, WORD_BLOCK, DEFAULT_WARPS, 2 if bm > 128 else 3)


def _joined(slices):
    """Eight (bn, 16) slices -> one (bn, 128) operand, slice ``j`` at columns ``16 j .. 16 j + 15``. Triton stacks
    two arrays at a time along a new last axis, so the slices pair up three times, (bn, 16, j0, j1, j2) with
    ``j = j0 + 2 j1 + 4 j2``, and one transpose puts the axes in K's order."""
    while len(slices) > 1:
        slices = [jnp.stack(pair, axis=-1) for pair in zip(slices[::2], slices[1::2])]
    (joined,) = slices
    bn = joined.shape[0]
    return jnp.transpose(joined, (0, 4, 3, 2, 1)).reshape(bn, WORD_BLOCK)


def _kernel(*refs, m, n, k, blocks, group, has_zp, has_bias, stacked, interpreted):
    layer, (x_ref, w_ref, ws_ref), zp_ref, b_ref, o_ref = split_refs(
        refs, stacked=stacked, inputs=3, has_zp=has_zp, has_bias=has_bias)
    bm, bn = blocks.bm, blocks.bn
    cdt = x_ref.dtype
    offset = code_offset(cdt)
    cols = span(pl.program_id(0) * bn, bn, n, in_bounds=n % bn == 0)  # the weights' columns: A's rows
    rows = span(pl.program_id(1) * bm, bm, m, in_bounds=m % bm == 0)  # x's rows: B's columns
    groups = ws_ref.shape[-2]
    word_blocks = cdiv(k, WORD_BLOCK)  # the words' padding past them (groups > a word block) holds no K row
    # scale rows past the last group (K' padding with groups shorter than a word block) load as 0
    scales_whole = group is None or word_blocks * WORD_BLOCK // group <= groups

    def column(ref, g, in_bounds):
        """Row ``g`` of a (G, N) ref, this program's columns, as a (bn, 1) float32 column."""
        return load_tile(ref, span(g, 1, groups, in_bounds=in_bounds), cols, 0, layer).T.astype(jnp.float32)

    def group_operands(g, in_bounds=scales_whole):
        """(offset + zero point as x's dtype, float32 scale) of scale group ``g``, (bn, 1) columns; per channel the
        scale comes after the loop (None)."""
        zp = column(zp_ref, g, in_bounds) if has_zp else 0.0
        return jnp.asarray(offset + zp).astype(cdt), None if group is None else column(ws_ref, g, in_bounds)

    fixed = group_operands(0, True) if group is None else None
    slices_per_group = None if group is None else max(1, group // SLICE)

    def body(kb, acc):
        words = load_tile(w_ref, span(kb * SLICE, SLICE, w_ref.shape[-2], in_bounds=True), cols, 0, layer).T
        slices, operands = [], fixed
        for j in range(NIBBLES):
            if group is not None and j % slices_per_group == 0:  # a scale group starts at this slice
                operands = group_operands((kb * WORD_BLOCK + j * SLICE) // group)
            shifted, scale = operands
            weights = nibble_operands(words, j, cdt, interpreted) - shifted  # value - zero point, exact
            # scaled in float32, rounded once: XLA's dequantized weights exactly (bf16 scales, ~2 instructions a
            # weight fewer in sm_90 SASS, moved a small random model's logits by up to 10 % of their scale)
            slices.append(weights if scale is None else (weights.astype(jnp.float32) * scale).astype(cdt))
        xt = load_tile(x_ref, rows, span(kb * WORD_BLOCK, WORD_BLOCK, k, in_bounds=k % WORD_BLOCK == 0))
        return acc + dot(_joined(slices), xt.T)

    acc = jax.lax.fori_loop(0, word_blocks, body, jnp.zeros((bn, bm), jnp.float32))
    if group is None:
        acc = acc * column(ws_ref, 0, True)
    if has_bias:
        acc = acc + load_tile(b_ref, cols, span(0, 1, 1, in_bounds=True), 0).astype(jnp.float32)
    store_tile(o_ref, rows, cols, acc.T.astype(o_ref.dtype))


def int4_words_prefill(x, words, w_scale, *, group: int | None = None, w_zero_point=None, bias=None,
                       blocks: Blocks | None = None, layer=None, interpret: bool | None = None):
    """``x @ dequantize(w)`` for int4 weights stored as :func:`~pallas_kernels.int4_words.pack_words` words, for
    prompt rows (see the module doc). ``layer``: the weights are stacks [L, ...], layer ``layer`` read in place.
    ``blocks``: ``bm`` token rows and ``bn`` weight columns a program (powers of two >= 16; ``bk`` is the word
    block), warps and stages; default :func:`default_blocks`."""
    name = "int4_words_prefill"
    check_words(name, x, words, w_scale, w_zero_point, group, layer)
    if jnp.dtype(x.dtype) not in HALF_DTYPES:
        raise ValueError(f"{name}: x must be bfloat16 or float16 (the weights become x's dtype), got {x.dtype}")
    m, k = x.shape
    n = words.shape[-1]
    blocks = blocks or default_blocks(m, n)
    if blocks.bk != WORD_BLOCK:
        raise ValueError(f"{name}: the K block is one word block ({WORD_BLOCK} rows), got {blocks.bk}")
    interpret = config.resolve_interpret(interpret)
    args = [x, *weight_operands(words, w_scale, w_zero_point)]
    if bias is not None:
        args.append(bias.astype(jnp.float32).reshape(n, 1))
    if layer is not None:
        args.insert(0, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)))
    body = functools.partial(_kernel, m=m, n=n, k=k, blocks=blocks, group=group, has_zp=w_zero_point is not None,
                             has_bias=bias is not None, stacked=layer is not None, interpreted=interpret)
    offsets.check(args, name)
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(cdiv(n, blocks.bn), cdiv(m, blocks.bm)),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name=name,
    )(*args)


__all__ = ["default_blocks", "int4_words_prefill"]
