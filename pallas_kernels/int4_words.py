"""Weight-only int4 matmul for decode, reading the weights as 32-bit words of eight K values.

Why another layout: the checkpoint's int4 codes are two per byte along K, ``(K/2, N)``. Compiled for
Hopper, the dot kernel (:mod:`pallas_kernels.weight_only`) receives those bytes in the MMA operand
layout one at a time from shared memory (``LDS.U8``: Triton moves the operand conversion ahead of
the dequantization, onto the narrowest type) and spends about 5.4 instructions per weight each
thread reads -- on an H200, int4 decode ran at 0.66 TB/s, barely faster than bf16. Marlin's answer is
a layout made once so that every register holds whole MMA fragments; this is the part of it that
Pallas on Triton can express:

* **Words of eight K values.** :func:`pack_words` stores a K block of 128 rows as 16 rows of int32
  words, ``(K/8, N)``: nibble ``j`` of word row ``i`` holds K row ``128 b + 16 j + i``, as an
  offset-binary code (value + 8). The K block is then eight 16-row slices, one per nibble position,
  and each slice is one MMA K step: ``x[:, 16 j : 16 j + 16] @ nibble_j(words)``. Operands come from
  shared memory as 32-bit loads (eight weights each), never bytes.
* **Two values per three instructions.** In the MMA operand layout a thread holds the words of two
  adjacent K rows; inline PTX (:func:`nibble_operands`, ``pack=2``) gathers nibble ``j`` of both with one
  ``prmt``, shifts odd nibbles down, and one ``lop3`` ORs them into the mantissas of a bf16/f16
  ``MAGIC`` pair: one register holding both operands, no conversion (ptxas shares the ``prmt`` between
  the two nibbles of a byte).
* **The offset comes off once per scale group** through x's sums over the group:
  ``x @ (MAGIC + 8 + q - zp)`` minus ``(MAGIC + 8 + zp) * sum(x)``. A second chain of dots against a
  constant tile of ones gives the sums in the accumulator's layout, every column alike (ptxas issues it
  once per warp: 8 more MMAs a K step); no separate pass over x, no subtraction per weight.

Compiled for sm_90 (``scripts/kernel_sass.py``, 4096 x 11008, group 128, bf16 x, M = 1..16): the K loop
issues 2.1 instructions per weight with the 256-column tiles it takes there (155 registers), 2.5 with
128 columns (96 registers; the default below 8192 outputs), against 5.4 for the dot kernel and 4.5 for
the GEMV; no byte loads from shared memory. On an H200 (docs/kernels.md): 0.97-1.82x bf16 at M = 1.

Contract:
  x        (M, K)              float32 / bfloat16 / float16
  words    (K'/8, N) int32     :func:`pack_words` of the int4 values, K' = K padded to whole K steps
  w_scale  (G, N)              G = 1 (per channel) or ceil(K / group)
  w_zero_point (G, N) int8 or None
  bias     (N,) or None
  -> y     (M, N) x.dtype
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import config, norm_fold, settings
from pallas_kernels.blocks import Blocks
from pallas_kernels.common import (
    FLOAT_DTYPES,
    cdiv,
    dot,
    f32_dot_precision,
    is_pow2,
    launch_matmul,
    load_tile,
    matmul_program,
    next_pow2,
    one_layer,
    span,
    split_refs,
    store_matmul,
    weight_operands,
)

WORD_BLOCK = 128  # K rows per block of 16 word rows
NIBBLES = 8  # K values per int32 word
SLICE = WORD_BLOCK // NIBBLES  # K rows per nibble position in a block: one MMA K step
# (bf16/f16 bit pattern, its value) per half dtype: MAGIC | u is MAGIC + u exactly for u < 16.
_HALF_MAGIC = {jnp.dtype(jnp.bfloat16): (0x4300, 128.0), jnp.dtype(jnp.float16): (0x6400, 1024.0)}
_F32_MAGIC = 0x4B000000  # 2^23: float32 takes the exact code u (MAGIC + u - 2^23)
# (bm, bn, warps, stages) for the decode rows this layout is made for; WIDE_BN columns from WIDE_N outputs
# on: 256-column tiles issue 2.1 instructions per weight against 2.5 (sm_90 SASS), and from 8192 columns
# their grid (with the K splits) still covers an H100's 132 SMs; narrower, 128 columns fill it better.
DEFAULT_TILE = (16, 128, 4, 3)
WIDE_N, WIDE_BN = 8192, 256


def k_step(group: int | None) -> int:
    """K rows per step of the kernel's loop (and the padding unit of :func:`pack_words`): a word
    block, or a whole scale group where groups are longer."""
    return max(WORD_BLOCK, group or WORD_BLOCK)


def word_rows(k: int, group: int | None) -> int:
    """Rows of the words array for K input rows: K padded to whole K steps, eight values a word."""
    step = k_step(group)
    return cdiv(k, step) * step // NIBBLES


def pack_words(values, group: int | None = None):
    """(K, N) int4 values (-8..7, any integer dtype; or a stack [L, K, N]) -> int32 words
    (``word_rows(K, group)``, N): nibble ``j`` of word row ``16 b + i`` is K row ``128 b + 16 j + i``
    as the code value + 8. K is padded with zero values up to whole K steps."""
    *lead, k, n = values.shape
    codes = (values.astype(jnp.int32) + 8) & 15
    padded = word_rows(k, group) * NIBBLES
    codes = jnp.pad(codes, [(0, 0)] * len(lead) + [(0, padded - k), (0, 0)], constant_values=8)
    codes = codes.reshape(*lead, padded // WORD_BLOCK, NIBBLES, SLICE, n)
    shifts = (4 * jnp.arange(NIBBLES, dtype=jnp.int32)).reshape(NIBBLES, 1, 1)
    # the nibbles occupy disjoint bits: their sum is their OR (uint32 so that bit 31 may be set)
    words = jnp.sum(codes.astype(jnp.uint32) << shifts.astype(jnp.uint32), axis=-3, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.int32).reshape(*lead, padded // NIBBLES, n)


def unpack_words(words, k: int):
    """Inverse of :func:`pack_words`: (K'/8, N) words -> (K, N) int8 values (stacks too)."""
    *lead, rows, n = words.shape
    shifts = (4 * jnp.arange(NIBBLES, dtype=jnp.int32)).reshape(NIBBLES, 1, 1)
    codes = (words.reshape(*lead, rows // SLICE, 1, SLICE, n) >> shifts) & 15
    return (codes.reshape(*lead, rows * NIBBLES, n)[..., :k, :] - 8).astype(jnp.int8)


def code_offset(cdt) -> float:
    """What :func:`nibbles` adds to every value: its MAGIC plus the code offset 8 (float32: 8)."""
    half = _HALF_MAGIC.get(jnp.dtype(cdt))
    return (half[1] if half else 0.0) + 8.0


def nibbles(words, j: int, cdt):
    """Nibble ``j`` of every word as ``cdt``: ``code_offset(cdt) + value``, by bit patterns (jnp)."""
    if jnp.dtype(cdt) == jnp.float32:
        bits = ((words >> (4 * j)) & 15) | _F32_MAGIC
        return jax.lax.bitcast_convert_type(bits, jnp.float32) - float(1 << 23)
    magic, _ = _HALF_MAGIC[jnp.dtype(cdt)]
    bits = (((words >> (4 * j)) & 15) | magic).astype(jnp.int16)
    return jax.lax.bitcast_convert_type(bits, cdt)


def nibble_asm(j: int, cdt) -> str:
    """PTX for :func:`nibbles` on two words at once ($1, $2 -> one register of two ``cdt`` values, $0):
    ``prmt`` puts byte ``j // 2`` of each word into the low byte of each half, odd nibbles shift down
    by 4, and ``lop3`` (``(a & b) | c``, LUT 0xEA) keeps the nibbles and ORs in the MAGIC pair."""
    byte = j // 2
    select = byte | (4 << 4) | ((4 + byte) << 8) | (4 << 12)  # d.b0 = $1.b[byte], d.b2 = $2.b[byte]
    magic = _HALF_MAGIC[jnp.dtype(cdt)][0]
    shift = "shr.b32 t, t, 4;\n" if j % 2 else ""
    return (f"{{\n.reg .b32 t;\nprmt.b32 t, $1, $2, {select:#06x};\n{shift}"
            f"lop3.b32 $0, t, 0x000F000F, {magic << 16 | magic:#010x}, 0xEA;\n}}")


def nibble_operands(words, j: int, cdt, interpret: bool):
    """:func:`nibbles` by inline PTX on a GPU (half dtypes); interpret mode and float32 run the jnp form."""
    if interpret or jnp.dtype(cdt) == jnp.float32:
        return nibbles(words, j, cdt)
    out = jax.ShapeDtypeStruct(words.shape, cdt)
    return plgpu.elementwise_inline_asm(nibble_asm(j, cdt), args=[words], constraints="=r,r,r", pack=2,
                                        result_shape_dtypes=[out])[0]


def _kernel(*refs, m, n, k, blocks, group, has_zp, has_bias, split_blocks, split, stacked, precision, interpreted,
            epilogue, eps=None, fixup=None, act=None):
    folded = eps is not None  # x is a norm's input, folded here (pallas_kernels.norm_fold; its scale: 4th input)
    layer, (x_ref, w_ref, ws_ref, *scale_ref), zp_ref, b_ref, o_ref = split_refs(
        refs, stacked=stacked, inputs=3 + folded, has_zp=has_zp, has_bias=has_bias,
        outputs=norm_fold.outputs(folded, split), fixup=fixup)
    bm, bn, bk = blocks.bm, blocks.bn, blocks.bk
    cdt = x_ref.dtype
    offset = code_offset(cdt)
    # the offset (and zero point) come off per sum block: a scale group, or the K step (per channel)
    sum_block = group or bk
    slices_per_sum = sum_block // SLICE
    # sum blocks past K (K' padding, groups < a word block) have no scale row: masked loads give 0
    scales_whole = cdiv(k, bk) * bk // sum_block == ws_ref.shape[-2] or group is None
    prog = matmul_program(m, n, k, blocks, split_blocks)
    rows, cols, first, last = prog.rows, prog.cols, prog.first, prog.last
    # the words cover K padded to whole k_steps; a K step of several (blocks.bk) may run past them
    whole_words = w_ref.shape[-2] * NIBBLES % bk == 0

    def row_of(ref, g, in_bounds, lay=None):
        return load_tile(ref, span(g, 1, ref.shape[-2], in_bounds=in_bounds), cols, 0, lay).astype(jnp.float32)

    # The scale and zero-point rows of the scale groups of step kb, read one step ahead (carried through
    # the loop): Triton's pipeliner stages only the loads that feed dots, and read where they are used,
    # these rows were synchronous global loads in every iteration of the compiled loop (sm_90 SASS:
    # LDG.E.64 and LDG.E.U16 between the MMAs), each a memory latency per K step. Groups are powers of
    # two >= 32, so whole groups tile the K step (k_step).
    per_step = bk // sum_block if group is not None else 0  # scale groups per K step
    zp_fixed = row_of(zp_ref, 0, True, layer) if has_zp and group is None else None  # per channel: one row

    def step_rows(kb):
        """(scale row, zero-point row or None) of each scale group of step ``kb``, clamped into the split."""
        kb = jnp.minimum(kb, last - 1)  # the step after the split's last: re-read its rows (never used)
        return tuple((row_of(ws_ref, kb * per_step + i, scales_whole, layer),
                      row_of(zp_ref, kb * per_step + i, scales_whole, layer) if has_zp else None)
                     for i in range(per_step))

    ones = jnp.ones((SLICE, bn), cdt)  # a constant B operand: x @ ones is x's row sums in every column

    # epilogue="mma": a group's scale and zero-point rows reach the accumulator's layout as products with a
    # constant (bm, 16) tile whose first column is ones: each row is loaded as a 16-row tile (the other rows
    # masked) that feeds a dot, like x and the words, so Triton stages it through its cp.async pipeline, and
    # the product lands in the MMA layout -- no layout conversion through shared memory, no synchronous
    # global load (the "rows" epilogue: two conversions, four BAR.SYNC an iteration; this one: two, the
    # pipeline's own, in sm_90 SASS). The rows come as x's dtype (the wrapper converts them): exact for the
    # zero points, the scales rounded to bf16 / f16 (as torchao's int4 weight-only kernel keeps them).
    if epilogue == "mma":
        groups_total = ws_ref.shape[-2]
        pick = (jax.lax.broadcasted_iota(jnp.int32, (bm, SLICE), 1) == 0).astype(cdt)  # ones in column 0

        def group_rows(g):
            """(scale, zero point or None) of scale group ``g`` as (bm, bn) tiles in the accumulator's layout."""
            def picked(ref):
                lane = jax.lax.broadcasted_iota(jnp.int32, (SLICE,), 0)
                row = load_tile(ref, (pl.ds(g, SLICE), (lane < 1) & (g < groups_total)), cols, 0, layer)
                return dot(pick, row, precision=precision)

            return picked(ws_ref), picked(zp_ref) if has_zp else None

    def finish_sum(part, xs, acc, scale=None, zp=None):
        """acc + a sum block's product with the offset (and zero point) taken off through x's sums,
        times its group's ``scale`` row (per channel: the scale comes after the loop)."""
        zp = zp_fixed if group is None else zp
        part = part - xs * (offset + (zp if has_zp else 0.0))
        return acc + (part if group is None else part * scale)

    def body(kb, carry, squared: bool):
        acc, rows_now, sumsq = carry
        if epilogue == "mma":  # each group's rows loaded where used (pipelined), nothing carried
            rows_now, rows_next = tuple(group_rows(kb * per_step + i) for i in range(per_step)), ()
        else:
            rows_next = step_rows(kb + 1)
        part = xs = None
        for b in range(bk // WORD_BLOCK):  # static: the word blocks of one K step
            w_rows = span((kb * (bk // WORD_BLOCK) + b) * SLICE, SLICE, w_ref.shape[-2], in_bounds=whole_words)
            words = load_tile(w_ref, w_rows, cols, 0, layer)
            for j in range(NIBBLES):
                t = b * NIBBLES + j  # the slice's index in the step
                k0 = kb * bk + t * SLICE
                ks = span(k0, SLICE, k, in_bounds=prog.whole_k)
                xt = load_tile(x_ref, rows, ks, 0)
                if folded:  # x's sums below are of the folded operand too: they take the offsets off its product
                    xt, squares = norm_fold.fold_tile(xt, scale_ref[0], ks, layer, squared)
                    sumsq = sumsq + squares if squared else sumsq
                # two accumulator chains (Triton folds each ``acc + dot`` into the MMA)
                term = dot(xt, nibble_operands(words, j, cdt, interpreted), precision=precision)
                part = term if part is None else part + term
                sums = dot(xt, ones, precision=precision)
                xs = sums if xs is None else xs + sums
                if (t + 1) % slices_per_sum == 0:  # a sum block (scale group, or the step) ends here
                    acc = finish_sum(part, xs, acc, *(rows_now[(t + 1) // slices_per_sum - 1] if per_step else ()))
                    part = xs = None
        return acc, rows_next, sumsq

    def loop(squared: bool):
        carried = () if epilogue == "mma" else step_rows(first)
        sumsq = jnp.zeros((bm, 1), jnp.float32) if folded else ()
        return jax.lax.fori_loop(first, last, functools.partial(body, squared=squared),
                                 (jnp.zeros((bm, bn), jnp.float32), carried, sumsq))

    acc, _, sumsq = norm_fold.run(loop, folded, split, squares_after=bool(fixup))
    if group is None:
        acc = acc * row_of(ws_ref, 0, True, layer)
    if folded:
        norm_fold.store(o_ref, b_ref, acc, sumsq, prog, split=split, has_bias=has_bias, k=k, eps=eps,
                        fixup=fixup, x_ref=x_ref, act=act)
    else:
        store_matmul(o_ref, b_ref, acc, prog, split=split, has_bias=has_bias, act=act)


def check_words(name: str, x, words, w_scale, w_zero_point, group, layer) -> None:
    """The checks of a kernel over :func:`pack_words` words, naming ``name`` in its errors."""
    if layer is not None:
        words, w_scale, w_zero_point = one_layer(name, words, w_scale, w_zero_point, layer)
    if x.ndim != 2 or words.ndim != 2:
        raise ValueError(f"{name} expects 2-D x and words (a stack [L, ...] with layer=); got {x.shape}, {words.shape}")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"{name}: x must be float32/bfloat16/float16, got {x.dtype}")
    if group is not None and not (is_pow2(group) and group >= SLICE * 2):
        raise ValueError(f"{name}: group size must be a power of two >= {SLICE * 2}, got {group}")
    k = x.shape[1]
    want = word_rows(k, group)
    if words.dtype != jnp.int32 or words.shape[0] != want:
        raise ValueError(f"{name}: words for K={k} (group {group}) must be int32 with {want} rows "
                         f"(pack_words), got {words.dtype} {words.shape}")
    groups = 1 if group is None else cdiv(k, group)
    if w_scale.shape != (groups, words.shape[1]):
        raise ValueError(f"{name}: w_scale has shape {w_scale.shape}, expected {(groups, words.shape[1])}")
    if w_zero_point is not None and w_zero_point.shape != w_scale.shape:
        raise ValueError(f"{name}: zero point shape {w_zero_point.shape} != scale shape {w_scale.shape}")


def default_blocks(m: int, n: int, group: int | None) -> Blocks:
    """16-row tiles for decode (M <= 16), up to 64 rows beyond; 128 columns (256 from WIDE_N outputs on);
    one K step per iteration."""
    bm, bn, warps, stages = DEFAULT_TILE
    bn = WIDE_BN if n >= WIDE_N else bn
    return Blocks(bm if m <= bm else min(64, next_pow2(m)), bn, k_step(group), warps, stages)


EPILOGUES = ("rows", "mma")


def int4_words_matmul(x, words, w_scale, *, group: int | None = None, w_zero_point=None, bias=None,
                      blocks: Blocks | None = None, k_splits: int | None = None, layer=None,
                      norm: norm_fold.NormFold | None = None, epilogue: str | None = None,
                      residual=None, act: str | None = None, interpret: bool | None = None):
    """``x @ dequantize(w)`` for int4 weights stored as :func:`pack_words` words (see the module doc).

    ``layer`` (an int32 scalar): ``words``, ``w_scale`` and the zero point are stacks [L, ...] and
    layer ``layer`` is read in place. ``blocks.bk`` is :func:`k_step` of the group, or that times a power
    of two (several word blocks per iteration of the K loop: fewer iterations, more bytes per pipeline
    stage); the K loop is split over programs when the (M, N) grid is small (as in the dot kernel).

    ``epilogue``: how a scale group's scale and zero-point rows reach the accumulator -- "rows" (float32
    scales, loaded one K step ahead and converted to the accumulator's layout) or "mma" (the rows in x's
    dtype, loaded where used as products with a constant tile: no layout conversion; see the kernel). With
    half activations "mma" rounds the scales to x's dtype; which is faster is for a GPU to say. Default:
    "rows", or a :mod:`pallas_kernels.settings` override's (as for ``blocks`` and ``k_splits``).

    ``norm``: ``rms_norm(x) @ dequantize(w)`` (:mod:`pallas_kernels.norm_fold`; the norm's scale stacked like the
    words where ``layer`` is given). ``residual`` (M, N): ``residual + x @ dequantize(w)``, added by the kernel where
    it finishes the product itself (``pallas_kernels.split_fixup``; setting ``reduce``), else after it. ``act``
    "swiglu": a SwiGLU's joined gate/up kernel with its columns paired (``llmeq_jax.decode_layout.pair_swiglu``),
    ``silu(gate) * up`` out (M, N / 2), gated by the kernel where it finishes the product."""
    check_words("int4_words_matmul", x, words, w_scale, w_zero_point, group, layer)
    m, k = x.shape
    if norm is not None:
        norm_fold.check("int4_words_matmul", norm, k, layer)
    n = words.shape[-1]
    chosen = settings.of("int4_words", m)
    blocks = blocks or chosen.blocks(default_blocks(m, n, group))
    k_splits = k_splits or chosen.k_splits
    epilogue = epilogue or chosen.epilogue or "rows"
    step = k_step(group)
    if blocks.bk % step or not is_pow2(blocks.bk // step):
        raise ValueError(f"int4_words_matmul: the K block must be {step} (k_step(group={group})) times a power of "
                         f"two, got {blocks.bk}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"int4_words_matmul: epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    interpret = config.resolve_interpret(interpret)
    args = [x, *weight_operands(words, w_scale, w_zero_point)]
    if epilogue == "mma" and group is not None:  # scales and zero points as x's dtype: dot operands beside x
        args[2:] = [a.astype(x.dtype) for a in args[2:]]
    fold = {}
    if norm is not None:  # the norm's scale after the kernel's three inputs, before the zero points
        args.insert(3, norm_fold.operand(norm, layer))
        fold = dict(eps=float(norm.eps), fold_eps=float(norm.eps))
    return launch_matmul(_kernel, args, m=m, n=n, k=k, blocks=blocks, bias=bias, k_splits=k_splits, out_dtype=x.dtype,
                         interpret=interpret, name="int4_words_matmul", layer=layer, programs=chosen.programs,
                         group=group, has_zp=w_zero_point is not None, precision=f32_dot_precision(interpret) if
                         jnp.dtype(x.dtype) == jnp.float32 else None, interpreted=interpret, epilogue=epilogue,
                         residual=residual, fixup=chosen.reduce != "xla", act=act, **fold)


def int4_words_reference(x, words, w_scale, *, group: int | None = None, w_zero_point=None, bias=None):
    """Pure-jnp reference: the words unpacked, then per-group dots on integer weights (f32 accumulation)."""
    from pallas_kernels.weight_only import weight_only_reference

    k = x.shape[1]
    q = unpack_words(words, k)
    return weight_only_reference(x, q, w_scale, bits=8, w_zero_point=w_zero_point, bias=bias, group=group)


def _per_k(rows, group: int | None, blocks: int):
    """Per-group rows ``(G, N)`` (scales or zero points) broadcastable against the words' values laid out
    ``[blocks, NIBBLES, SLICE, N]`` (K row ``WORD_BLOCK b + SLICE j + i``)."""
    n = rows.shape[-1]
    if group is None:
        return rows.reshape(1, 1, 1, n)
    if group >= WORD_BLOCK:  # a group spans whole word blocks
        return jnp.repeat(rows, group // WORD_BLOCK, axis=0)[:blocks].reshape(blocks, 1, 1, n)
    per_block = WORD_BLOCK // group  # groups of SLICE * (group / SLICE) rows: nibble j is in group j // (group / SLICE)
    rows = jnp.pad(rows, ((0, blocks * per_block - rows.shape[0]), (0, 0)))
    return jnp.repeat(rows.reshape(blocks, per_block, n), group // SLICE, axis=1).reshape(blocks, NIBBLES, 1, n)


def int4_words_xla(x, words, w_scale, *, group: int | None = None, w_zero_point=None, bias=None, layer=None):
    """``x @ dequantize(w)`` for :func:`pack_words` words by XLA ops, written for XLA's reduction emitter: each
    word's eight nibbles by shifts and masks, times the group's scale (less its zero point), times x, summed over
    K in one expression. Arguments as :func:`int4_words_matmul` (``layer``: stacks read at that layer); float32
    arithmetic, the result in x's dtype.

    What XLA makes of it depends on the shape (deviceless compiles for an H200, M = 1): one reduction kernel over
    the words at 4096 x 11008 / 12288 / 22016 and a fused two-stage one at 11008 x 4096, but at 4096 x 4096 the
    dequantized product written out (67 MB) before the sum, and inside the scan over stacked blocks one layer's
    words copied out of the stack. ``scripts/bench_kernels.py`` times it (kind ``w4_xla_words``) as a measure of
    what XLA's reduction can stream; no dispatch path takes it."""
    check_words("int4_words_xla", x, words, w_scale, w_zero_point, group, layer)
    if layer is not None:
        words, w_scale, w_zero_point = (None if a is None else jax.lax.dynamic_index_in_dim(a, layer, 0, False)
                                        for a in (words, w_scale, w_zero_point))
    (m, k), (rows, n) = x.shape, words.shape
    blocks = rows // SLICE
    shifts = (4 * jnp.arange(NIBBLES, dtype=jnp.int32)).reshape(1, NIBBLES, 1, 1)
    codes = ((words.reshape(blocks, 1, SLICE, n) >> shifts) & 15).astype(jnp.float32) - 8.0
    if w_zero_point is not None:
        codes = codes - _per_k(w_zero_point.astype(jnp.float32), group, blocks)
    w = codes * _per_k(w_scale.astype(jnp.float32), group, blocks)
    xs = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, rows * NIBBLES - k))).reshape(m, blocks, NIBBLES, SLICE)
    y = jnp.sum(xs[..., None] * w[None], axis=(1, 2, 3))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


__all__ = ["EPILOGUES", "WORD_BLOCK", "check_words", "code_offset", "int4_words_matmul", "int4_words_reference",
           "int4_words_xla", "k_step", "nibble_asm", "nibble_operands", "nibbles", "pack_words", "unpack_words",
           "word_rows"]
