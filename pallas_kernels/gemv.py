"""Weight-only matrix-vector products for decode (M <= GEMV_MAX_ROWS): multiply and sum, no tensor-core dot.

Same contract and math as :func:`pallas_kernels.weight_only.weight_only_matmul` (int8 or nibble-packed
int4 weights, per-channel or per-group scales, zero points, bias), for a handful of rows.

Why a second formulation: at M = 1 the dot kernel pads x to a 16-row MMA tile and has Triton move
every dequantized weight tile into the MMA operand layout, gathering the bytes from shared memory one
at a time; on an H200 it streamed 0.98 TB/s, a fifth of the memory bandwidth. Compiled to SASS
(``scripts/kernel_sass.py``) its K loop issues about 5.5 instructions per weight each thread reads.

The design here, all of it chosen on that static count (not yet timed on a GPU):

* **A short K range per program, partial sums added atomically.** The grid is (N blocks, K ranges),
  each program two (K block, N block) tiles and one warp by default -- thousands of small programs,
  whose number rather than a software pipeline hides the memory latency -- and each adds its
  (1, N block) partial product into a float32 output with an atomic add. No shared memory, no
  cross-thread reduction: each thread holds whole columns of its tile, so the sum over K stays in its
  registers.
* **Four columns per 32-bit load.** The (rows, N) bytes are read as (rows, N / 4) int32 words (the same
  memory), so each thread's 16-byte load holds 4 words and no byte is extracted on its own: a code is
  shifted onto the low mantissa bits of the float32 128.0 (int4) or 256.0 (int8) and masked, its sign
  bit flipped, one bitcast from ``OFFSET + code`` (:func:`code_f32`). The four columns of a word are
  summed separately and interleaved back at the end (Triton joins two arrays at a time).
* **The offset and zero points come off once per program** through the block's sum of x (computed by
  XLA beside the kernel), as in the dot kernel; with float32 activations the offset is subtracted per
  value instead (exact), since 136 x |x| would cost the float32 sums about four bits.

Per weight each thread reads, the K loop issues 4.5 instructions (int4) / 4.9 (int8), against the dot
kernel's 5.5 / 7.1 and the earlier GEMV's 8.7 (which reduced across threads every K step); 128
registers (bn=128, bk=64, one warp, 4096x11008, sm_90). A modest static gain, still to be timed: off
by default. N not a multiple of 4 reads bytes instead of words (each byte widened on its own).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import offsets
from pallas_kernels.blocks import Blocks
from pallas_kernels.common import cdiv, compiler_params, load_tile, span, weight_operands

GEMV_MAX_ROWS = 4
# (bn, bk, warps): 128 output columns and 64 rows of K per block, one warp; two K blocks per program
# (a loop, so that ptxas keeps the bit-pattern constants in registers: one LOP3 per weight, not two).
DEFAULT_BLOCKS = (128, 64, 1)
DEFAULT_STEPS = 2
# float32 128.0 (int4) / 256.0 (int8): a code shifted onto its low mantissa bits adds its value.
_F32_BASE = {4: (0x43000000, 16, 0xF0000, 136.0), 8: (0x43800000, 15, 0x7F8000, 384.0)}


def code_offset(bits: int) -> float:
    """What :func:`code_f32` adds to every code: the float base plus the offset-binary bias."""
    return _F32_BASE[bits][3]


def code_f32(w, lo_bit: int, bits: int):
    """The signed ``bits``-wide code at bit ``lo_bit`` of int32 ``w`` -> float32 ``code_offset + code``.

    The field is moved onto the base's low mantissa bits (int4: 16..19, int8: 15..22), masked, and its
    sign bit flipped (two's complement -> offset binary): one shift and a mask/xor, no conversion."""
    base, target, mask, _ = _F32_BASE[bits]
    s = target - lo_bit
    v = w << s if s > 0 else (jax.lax.shift_right_logical(w, jnp.int32(-s)) if s < 0 else w)
    sign = 1 << (target + bits - 1)
    return jax.lax.bitcast_convert_type((v & mask) ^ (base | sign), jnp.float32)


def _dot_terms(xs, vals):
    """x_lane * values_lane summed over the lanes, elementwise (no ``0 +``: Python's sum() would add a
    zero tile, one more float add per weight in SASS)."""
    out = xs[0] * vals[0]
    for xa, va in zip(xs[1:], vals[1:]):
        out = out + xa * va
    return out


def _interleave4(q, bn: int):
    """Four (1, bn/4) rows -> (1, bn), column 4t + j from q[j][t] (Triton stacks two at a time)."""
    join = lambda a, b: jnp.stack([a, b], axis=-1).reshape(1, -1)  # noqa: E731
    return join(join(q[0], q[2]), join(q[1], q[3])).reshape(1, bn)


def _kernel(*refs, m, n, k, bits, bn, bk, group, has_zp, stacked, steps, words, fold):
    rest = list(refs)
    layer = rest.pop(0)[0] if stacked else None
    x_refs = [rest.pop(0) for _ in range(2 if bits == 4 else 1)]  # x's even/odd K columns (int4), or x
    xsum_ref = rest.pop(0) if (has_zp or fold) else None
    w_ref, ws_ref = rest.pop(0), rest.pop(0)
    zp_ref = rest.pop(0) if has_zp else None
    _, o_ref = rest  # the zeros operand, aliased to the output
    per_byte = 2 if bits == 4 else 1
    rows_w = bk // per_byte  # stored rows per K block
    whole_n, whole_k = n % bn == 0, k % bk == 0
    cols = span(pl.program_id(0) * bn, bn, n, in_bounds=whole_n)
    wcols = span(pl.program_id(0) * (bn // 4), bn // 4, n // 4, in_bounds=whole_n) if words else cols
    x_len = x_refs[0].shape[0] // m  # each row of x (its even or odd half) padded to whole K blocks

    def row_of(ref, g):
        return load_tile(ref, span(g, 1, ref.shape[-2], in_bounds=True), cols, 0, layer).astype(jnp.float32)

    def values(tile):
        """Per column group of the tile: the float32 values of each K lane (int4: even, odd)."""
        lanes = range(per_byte)
        if words:  # byte j of a word is column 4t + j
            return [[code_f32(tile, 8 * j + 4 * i, bits) for i in lanes] for j in range(4)]
        b = tile.astype(jnp.int32)
        return [[code_f32(b, 4 * i, bits) for i in lanes]]

    def block(kb, acc):
        g = (kb * bk) // group if group is not None else 0
        tile = load_tile(w_ref, span(kb * rows_w, rows_w, w_ref.shape[-2], in_bounds=whole_k), wcols, 0, layer)
        vals = values(tile)
        if not fold:  # exact per-value subtraction (float32 activations)
            vals = [[v - code_offset(bits) for v in group_vals] for group_vals in vals]
        shift = (code_offset(bits) if fold else 0.0) + (row_of(zp_ref, g) if has_zp else 0.0)
        scale = row_of(ws_ref, g)
        out = []
        for r in range(m):
            # x as columns (1-D loads broadcast: Triton gives them the weight tile's row layout)
            xs = [plgpu.load(x_ref.at[pl.ds(r * x_len + kb * rows_w, rows_w)]).astype(jnp.float32)[:, None]
                  for x_ref in x_refs]
            sums = [jnp.sum(_dot_terms(xs, group_vals), axis=0, keepdims=True) for group_vals in vals]
            part = _interleave4(sums, bn) if words else sums[0]
            if has_zp or fold:
                part = part - plgpu.load(xsum_ref.at[pl.ds(r, 1), pl.ds(kb, 1)]) * shift
            out.append(acc[r] + part * scale)
        return tuple(out)

    first = pl.program_id(1) * steps
    last = jnp.minimum(first + steps, cdiv(k, bk))
    acc = jax.lax.fori_loop(first, last, block, tuple(jnp.zeros((1, bn), jnp.float32) for _ in range(m)))
    for r in range(m):  # the output is padded to whole N blocks: no masks (interpret mode has none for atomics)
        plgpu.atomic_add(o_ref, (pl.ds(r, 1), cols[0]), acc[r])


def gemv_blocks(k: int, n: int, group: int | None) -> Blocks:
    """Default blocks: DEFAULT_BLOCKS, the K block within one group, N not past the next power of two."""
    bn, bk, warps = DEFAULT_BLOCKS
    bn = min(bn, 1 << max(4, (n - 1).bit_length()))
    bk = min(bk, group) if group is not None else min(bk, 1 << max(4, (k - 1).bit_length()))
    return Blocks(GEMV_MAX_ROWS, bn, bk, warps, 1)


def weight_only_gemv(x, wq, w_scale, *, bits, w_zero_point=None, bias=None, group=None, blocks=None, k_splits=None,
                     layer=None, interpret=False):
    """The GEMV formulation of ``weight_only_matmul`` (checked there): M <= GEMV_MAX_ROWS rows.

    ``blocks``: its bn, bk and num_warps are used. ``k_splits``: programs along K (default: one per
    DEFAULT_STEPS K blocks)."""
    m, k = x.shape
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"weight_only_gemv takes at most {GEMV_MAX_ROWS} rows, got M={m} (use the dot kernel)")
    n = wq.shape[-1]
    blocks = blocks or gemv_blocks(k, n, group)
    bn, bk = blocks.bn, blocks.bk
    if group is not None and group % bk:
        raise ValueError(f"weight_only_gemv: the K block ({bk}) must divide the group ({group})")
    if bits == 4 and bk % 2:
        raise ValueError(f"weight_only_gemv: int4 K blocks must be even, got {bk}")
    if bn % 4:
        raise ValueError(f"weight_only_gemv: the N block must be a multiple of 4, got {bn}")
    nblocks = cdiv(k, bk)
    steps = cdiv(nblocks, k_splits) if k_splits else min(DEFAULT_STEPS, nblocks)
    fold = jnp.dtype(x.dtype) != jnp.float32
    words = n % 4 == 0

    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nblocks * bk - k)))
    x_views = [xp[:, 0::2].reshape(-1), xp[:, 1::2].reshape(-1)] if bits == 4 else [xp.reshape(-1)]
    args = list(x_views)
    if w_zero_point is not None or fold:
        args.append(xp.reshape(m, nblocks, bk).sum(-1))  # each K block's sum of x: offsets come off once
    w = wq
    if words:  # the same bytes as int32 words, four columns each
        w = jax.lax.bitcast_convert_type(wq.reshape(*wq.shape[:-1], n // 4, 4), jnp.int32)
    args += weight_operands(w, w_scale, w_zero_point)
    if layer is not None:
        args = [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), *args]
    npad = cdiv(n, bn) * bn
    args.append(jnp.zeros((m, npad), jnp.float32))
    body = functools.partial(_kernel, m=m, n=n, k=k, bits=bits, bn=bn, bk=bk, group=group,
                             has_zp=w_zero_point is not None, stacked=layer is not None, steps=steps, words=words,
                             fold=fold)
    offsets.check(args, f"weight_only_int{bits}_gemv")
    y = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((m, npad), jnp.float32),
        grid=(cdiv(n, bn), cdiv(nblocks, steps)),
        input_output_aliases={len(args) - 1: 0},
        compiler_params=compiler_params(blocks.num_warps, 1),
        interpret=interpret,
        name=f"weight_only_int{bits}_gemv",
    )(*args)[:, :n]
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
