"""Row-major kernels for decoding: quantized ``(in, out)`` kernels stored as ``(out, in)``.

A decode step multiplies one activation row per sequence by every weight, so its
speed is how fast the weights stream through the cores. The native row-major
kernels (:func:`llmeq_jax.native.row_major_matmul`) compute each output as one
contiguous integer dot product, so every thread reads whole weight rows in order;
the checkpoint's ``(in, out)`` layout would make them read a short piece of every
row instead. :func:`for_decode` transposes the quantized kernels and wraps each in a
:class:`RowMajorKernel` that ``ops.linear`` recognises. ``generate`` calls it once per
params, outside its jitted decode loop, through ``generate.decode_params``, and keeps
the copy for the most recent params (``generate.release_decode_layout`` frees it); the
loop reads that copy on every token, and the loop's own ``for_decode`` call leaves
laid-out params as they are (``for_decode`` is idempotent). Checkpoints, prefill and
perplexity keep the ``(in, out)`` layout.

Linears that read the same input (q/k/v, gate/up) are then fused into one
row-major kernel (their rows stacked, :data:`FUSED_LINEARS`): one native call and
one activation quantization instead of three or two. Each output row is still its
own dot product, so the fused outputs equal the separate ones exactly.

Prefill and perplexity (many rows) keep the ``(in, out)`` layout for quantized kernels (but for W8A8
ones on a GPU, which the W8A8 kernel reads K-major at every row count: :func:`w8a8_kmajor`); there
too one wider product beats two or three narrow ones (YNNPACK on SmolLM2's gate/up:
[512, 576] x [576, 3072] ran 117 GFLOP/s, [576, 1536] 91), and a quantized group
quantizes its activations once. :func:`for_prefill` joins a group's float kernels, or
its quantized ones of one codes layout, along the outputs, once, outside the jit. Where the
AVX-512 float GEMM runs (``native.avx512()``), it also packs every float kernel into 32-column
panels (:class:`PanelKernel`), the layout that GEMM streams at the FMA ports' pace
(``native.panel_matmul``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.qarray import QArray, is_packed, pack, unpack


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaleCodes:
    """A row-major kernel's scales ``(out, groups)`` as int8 ``codes`` times float32 ``steps``, one step per
    ``groups / steps.shape[-1]`` consecutive groups of a row: ``codes * steps`` (each step repeated over its
    groups) equals the float scales exactly (:func:`scale_codes`). A stack [L, ...] like its kernel."""

    codes: jax.Array
    steps: jax.Array

    def scales(self) -> jax.Array:
        """The float32 scales these codes stand for."""
        per_step = self.codes.shape[-1] // self.steps.shape[-1]
        return self.codes.astype(jnp.float32) * jnp.repeat(self.steps, per_step, axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowMajorKernel:
    """An ``(in, out)`` kernel whose QArray ``w`` is stored transposed, ``(out, in)``.

    ``codes``: ``w``'s scales again as :class:`ScaleCodes` (:func:`compact_scales`), which the native
    weight-only kernel reads instead of ``w.scale``; every other path reads ``w``.

    ``split``: ``w.qvalue`` holds int2-int6 codes as :func:`split_codes` bytes (:func:`split_rows`), which
    only the native kernel reads; every other path reads :meth:`qarray`. ``w.bits`` is then the split codes'
    width: 2 or 3 where the kernel's int4 slots held 2- or 3-bit values (GGUF Q2_K / Q3_K).

    ``paired``: a SwiGLU's joined gate/up kernel with its outputs (``w``'s rows) paired, gate ``i`` at ``2 i`` and
    up ``i`` at ``2 i + 1`` (:func:`pair_swiglu`): ``ops.swiglu`` runs it."""

    w: QArray
    codes: ScaleCodes | None = None
    split: bool = dataclasses.field(default=False, metadata=dict(static=True))
    paired: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """The kernel's logical ``(in, out)`` shape (what ``ops.linear`` checks)."""
        n, k = self.w.shape
        return k, n

    def qarray(self) -> QArray:
        """``w`` with its codes stored as a QArray stores them (joined again where ``split``; 2- and 3-bit
        codes in int4 slots, as :func:`transpose_kernel` leaves them)."""
        if not self.split:
            return self.w
        qvalue = joined_qvalue(self.w.qvalue, self.w.bits, self.w.shape[1])
        return dataclasses.replace(self.w, qvalue=qvalue, bits=max(self.w.bits, 4))


class _Int4Layout:
    """What the GPU decode layouts of an int4 QArray ``w`` share: the kernel's logical shape and its scales'
    group, whatever the layout of its codes."""

    @property
    def shape(self) -> tuple[int, int]:
        """The kernel's logical ``(in, out)`` shape (what ``ops.linear`` checks)."""
        return self.w.shape

    @property
    def group(self) -> int | None:
        """The scales' group size along ``in`` (None: one scale per output column)."""
        return scale_group(self.w)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4WordKernel(_Int4Layout):
    """An ``(in, out)`` int4 kernel whose codes are stored as 32-bit words of eight ``in`` values
    (:func:`pallas_kernels.int4_words.pack_words`, ``(in'/8, out)`` int32) for the GPU decode kernel
    that reads them: ``w.qvalue`` holds the words; scales, zero points, shape and tile are the
    original QArray's (a stack [L, ...] too). ``paired``: a SwiGLU's joined gate/up kernel with its output
    columns paired, gate ``i`` at ``2 i`` and up ``i`` at ``2 i + 1`` (:func:`pair_swiglu`): ``ops.swiglu`` runs it."""

    w: QArray
    paired: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def packed(self) -> QArray:
        """The same kernel with its codes two per byte along ``in`` again (for XLA's path)."""
        from pallas_kernels.int4_words import unpack_words

        return dataclasses.replace(self.w, qvalue=pack(unpack_words(self.w.qvalue, self.w.shape[0]), 4, axis=-2))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4RowKernel(_Int4Layout):
    """An ``(in, out)`` int4 kernel whose codes are stored ``(out, in)`` as ``jnp.int4``, each output's ``in`` values
    contiguous (:func:`pallas_kernels.decode_hopper.transpose_codes`), for the Mosaic GPU decode kernel that
    reads them as wgmma's A operand: ``w.qvalue`` holds them; scales, zero points, shape and tile are the original
    QArray's (a stack [L, ...] too)."""

    w: QArray

    def packed(self) -> QArray:
        """The same kernel with its codes two per byte along ``in`` again (for XLA's path)."""
        codes = jnp.swapaxes(self.w.qvalue, -1, -2).astype(jnp.int8)
        return dataclasses.replace(self.w, qvalue=pack(codes, 4, axis=-2))


# Values a scale step covers (ScaleCodes): a GGUF K-quant's super-block, 8 sub-blocks of 32 or 16 of 16.
SCALE_STEP_VALUES = 256

# compact_scales leaves kernels whose groups are longer than this: their float scales are a small part of
# their bytes (4 bytes a group of 64 int4 values: an eighth) and nothing we load stores them as codes.
SCALE_CODES_MAX_GROUP = 32


def _dyadic_codes(s: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Integer codes and steps of float32 values ``s`` [..., blocks, S]: per block the largest float step
    that divides every value (a greatest common divisor of the values as integers times one power of two,
    negative where that keeps the codes in int8); None when a block's values would need codes outside
    [-128, 127]."""
    bits = np.ascontiguousarray(s, np.float32).view(np.int32)
    field = (bits >> 23) & 0xFF  # s = m 2^e exactly: the 24-bit significand (23 stored bits, implicit 1)
    m = np.where(field > 0, (bits & 0x7FFFFF) | 0x800000, bits & 0x7FFFFF).astype(np.int64)
    m = np.where(bits < 0, -m, m)
    e = np.maximum(field, 1).astype(np.int64) - 150
    nonzero = m != 0
    low = np.where(nonzero, e, np.iinfo(np.int64).max).min(axis=-1, keepdims=True)
    low = np.where(nonzero.any(axis=-1, keepdims=True), low, 0)
    shift = np.where(nonzero, e - low, 0)
    if shift.size and shift.max() > 38:  # values 2^38 apart in one block: no int8 codes reach both
        return None
    ints = m << shift
    g = np.gcd.reduce(ints, axis=-1, keepdims=True)
    g = np.where(g == 0, 1, g)
    codes = ints // g
    # a block reaching +128 fits int8 with a negative step (Q6_K: a negative d times a code of -128)
    flip = codes.max(axis=-1, keepdims=True) > 127
    codes, g = np.where(flip, -codes, codes), np.where(flip, -g, g)
    if codes.size and (codes.min() < -128 or codes.max() > 127):
        return None
    return codes.astype(np.int8), np.ldexp(g.astype(np.float64), low)[..., 0].astype(np.float32)


def scale_codes(scale, per_step: int, rows_at_once: int = 4096) -> ScaleCodes | None:
    """``scale`` (..., rows, groups) float32 as :class:`ScaleCodes` with one step per ``per_step`` groups,
    when int8 codes times float32 steps give every scale exactly; else None.

    A GGUF K-quant's scales are such codes by construction (``d * sc_j``: a float16 super-block scale
    times six- or eight-bit sub-block scales), which this finds again from the float32 scales alone
    (their per-block greatest common divisor); RTN's float scales almost never are. Checked value by
    value: the kernel reading the codes computes exactly what it computes from the float scales."""
    a = np.asarray(scale)
    if a.dtype != np.float32 or a.ndim < 2 or a.shape[-1] % per_step or not np.isfinite(a).all():
        return None
    flat = a.reshape(-1, a.shape[-1] // per_step, per_step)
    codes, steps = [], []
    for r0 in range(0, flat.shape[0], rows_at_once):  # bounded temporaries (int64 copies)
        part = flat[r0:r0 + rows_at_once]
        found = _dyadic_codes(part)
        if found is None:
            return None
        c, st = found
        if not np.array_equal(c.astype(np.float32) * st[..., None], part):
            return None
        codes.append(c)
        steps.append(st)
    lead = a.shape[:-1]
    return ScaleCodes(jnp.asarray(np.concatenate(codes).reshape(a.shape)),
                      jnp.asarray(np.concatenate(steps).reshape(*lead, a.shape[-1] // per_step)))


def _kernel_scale_codes(w: QArray) -> ScaleCodes | None:
    """:func:`scale_codes` of a weight-only row-major kernel with groups of at most
    :data:`SCALE_CODES_MAX_GROUP` values along ``in`` that whole super-blocks tile, else None."""
    group = w.tile[1]
    groups = w.scale.shape[-1]
    if w.act_spec is not None or groups == 1 or group > SCALE_CODES_MAX_GROUP or SCALE_STEP_VALUES % group:
        return None
    per_step = SCALE_STEP_VALUES // group
    if groups % per_step or isinstance(w.scale, jax.core.Tracer):
        return None
    return scale_codes(w.scale, per_step)


def compact_scales(params):
    """``params`` (laid out by :func:`for_decode` for the native kernels, concrete arrays) with each
    :class:`RowMajorKernel` whose scales are int8 codes times one float step per super-block
    (:func:`scale_codes`) carrying them as :class:`ScaleCodes`, which the native weight-only kernel
    reads instead: a byte a group where a float scale takes four. GGUF K-quant files kept quantized
    (Q6_K: 1.25 -> 1.08 bytes a weight; Q4_K: scales 0.125 -> 0.047) are what this finds. The
    float scales stay beside the codes for every other path (a quarter byte a value at groups of 16)."""

    def convert(leaf):
        if not isinstance(leaf, RowMajorKernel) or leaf.codes is not None:
            return leaf
        codes = _kernel_scale_codes(leaf.w)
        return leaf if codes is None else dataclasses.replace(leaf, codes=codes)

    return jax.tree_util.tree_map(convert, params, is_leaf=lambda a: isinstance(a, (RowMajorKernel, QArray)))


# Codes the native AVX-512 VNNI kernel reads split (split_codes): 2-6 bits a value in its own order.
SPLIT_BITS = (2, 3, 4, 5, 6)
SPLIT_BLOCK = 64  # values a split block holds
# int4 codes are split only in groups of at most this many values (Q4_*, Q2_K / Q3_K in int4 slots), for
# decode loops of at most SPLIT_INT4_MAX_ROWS rows: there the int4 tile ended a group every 32 values and the
# split tile ran 1.12-1.23x it (one matrix), 1.06-1.16x end to end at batch 1; at groups of 128 it measured the
# same on 4096-11008-row matrices and 0.83-0.92x on SmolLM2-135M end to end (batch 8 / 1), and at batch 8 in
# groups of 32 0.94-1.03x. int5 / int6 codes, a quarter to three eighths fewer bytes, are split at any size.
SPLIT_INT4_MAX_GROUP = 32
SPLIT_INT4_MAX_ROWS = 4


def split_block_bytes(bits: int) -> int:
    """Bytes of one split block of :data:`SPLIT_BLOCK` ``bits``-bit values: their low bits, then high bits."""
    return SPLIT_BLOCK * bits // 8


def _split_low_bits(bits: int) -> int:
    """Bits of a split code in its block's first part: nibbles for int4-int6, 2-bit crumbs for int2 / int3."""
    return 4 if bits >= 4 else 2


# Values a split row interleaves for the VNNI tile's int32 lanes (split_codes): a K-quant super-block.
SPLIT_CHUNK = 256


def _interleave(values: jax.Array, inverse: bool = False) -> jax.Array:
    """Each whole :data:`SPLIT_CHUNK` values along the last axis reordered so that position ``64b + 4i + j``
    holds value ``16i + 4b + j`` (``inverse``: back); the last ``K % 256`` stay as they are."""
    lead, k = values.shape[:-1], values.shape[-1]
    whole = k // SPLIT_CHUNK * SPLIT_CHUNK
    order = (4, 16, 4) if inverse else (16, 4, 4)  # stored [b, i, j] / in order [i, b, j]
    chunks = jnp.swapaxes(values[..., :whole].reshape(*lead, whole // SPLIT_CHUNK, *order), -3, -2)
    chunks = chunks.reshape(*lead, whole)
    return jnp.concatenate([chunks, values[..., whole:]], axis=-1)


def _bit_planes(u: jax.Array, width: int) -> jax.Array:
    """``u`` (``[..., 64]``, each value ``width`` bits) as ``8 * width`` bytes: byte ``j``, bits ``width * t``
    up, holds value ``j + 8 * width * t``."""
    per = 8 * width
    planes = u.reshape(*u.shape[:-1], 8 // width, per)  # [..., t, j]
    return sum(planes[..., t, :] << (width * t) for t in range(8 // width))


def _from_bit_planes(b: jax.Array, width: int) -> jax.Array:
    """:func:`_bit_planes`' inverse: ``[..., 8 * width]`` bytes -> ``[..., 64]`` values."""
    return jnp.concatenate([(b >> (width * t)) & ((1 << width) - 1) for t in range(8 // width)], axis=-1)


def split_codes(values: jax.Array, bits: int) -> jax.Array:
    """int2-int6 codes ``(..., K)`` (int8, K a multiple of 64) as split rows ``(..., K / 64 * 8 * bits)``
    uint8, the native VNNI tile's layout. Values are stored unsigned (``u = v + 2^(bits-1)``); each whole
    256 of a row lane-interleaved (position ``64b + 4i + j`` holds value ``16i + 4b + j``, so an int32 lane
    of the tile's sums gathers 16 consecutive values over four blocks); then each block of 64 positions is
    its values' low ``l`` bits (``l = 4`` for int4-int6, 2 for int2 / int3) in ``8l`` bytes (byte ``j``,
    bits ``l*t`` up: position ``j + 8l*t``) and their high ``h = bits - l`` bits in ``8h`` bytes (byte
    ``j``, bits ``h*t`` up: position ``j + 8h*t``), which the tile turns back into one byte a value with a
    broadcast and a shift or rotation a qword (llama.cpp's K-quants also keep low and high bits apart, in
    their own orders)."""
    if bits not in SPLIT_BITS or values.shape[-1] % SPLIT_BLOCK:
        raise ValueError(f"split_codes: int2-int6 codes with a last dim that is a multiple of {SPLIT_BLOCK}, "
                         f"got int{bits} of shape {values.shape}")
    low_bits = _split_low_bits(bits)
    lead, k = values.shape[:-1], values.shape[-1]
    u = (_interleave(values).astype(jnp.int32) + (1 << (bits - 1))).reshape(*lead, k // SPLIT_BLOCK, SPLIT_BLOCK)
    parts = [_bit_planes(u & ((1 << low_bits) - 1), low_bits)]
    if bits > low_bits:
        parts.append(_bit_planes(u >> low_bits, bits - low_bits))
    return jnp.concatenate(parts, axis=-1).astype(jnp.uint8).reshape(
        *lead, k // SPLIT_BLOCK * split_block_bytes(bits))


def join_codes(split: jax.Array, bits: int, k: int) -> jax.Array:
    """The int8 codes ``(..., k)`` of :func:`split_codes`' bytes."""
    low_bits = _split_low_bits(bits)
    lead = split.shape[:-1]
    b = split.astype(jnp.int32).reshape(*lead, k // SPLIT_BLOCK, split_block_bytes(bits))
    u = _from_bit_planes(b[..., :8 * low_bits], low_bits)
    if bits > low_bits:
        u = u | (_from_bit_planes(b[..., 8 * low_bits:], bits - low_bits) << low_bits)
    return _interleave((u - (1 << (bits - 1))).astype(jnp.int8).reshape(*lead, k), inverse=True)


def split_qvalue(qvalue: jax.Array, bits: int, k: int, split_bits: int | None = None) -> jax.Array:
    """A row-major kernel's stored codes (..., N, Kb) (int4 two a byte along ``in``, else int8) as
    :func:`split_codes` bytes of ``split_bits`` (default ``bits``) a value."""
    values = unpack(qvalue, bits, qvalue.ndim - 1, k) if is_packed(bits) else qvalue
    return split_codes(values, split_bits or bits)


def joined_qvalue(split: jax.Array, bits: int, k: int) -> jax.Array:
    """:func:`split_qvalue`'s inverse: the codes as a row-major kernel stores them (2- and 3-bit codes in
    int4 slots, as :func:`transpose_kernel` leaves them)."""
    values = join_codes(split, bits, k)
    stored = max(bits, 4)
    return pack(values, stored, values.ndim - 1) if is_packed(stored) else values


def split_tile_takes(w: QArray) -> bool:
    """Whether the native kernel's split tile takes the row-major weight-only ``w``: int2-int6 codes,
    ``in`` a multiple of 64, groups of 16-256 values that divide 256, or multiples of 256 (or one scale a row)."""
    k, group = w.shape[1], w.tile[1]
    return (w.bits in SPLIT_BITS and w.act_spec is None and w.grid == "uniform" and k % SPLIT_BLOCK == 0
            and (group >= k or (group >= 16 and (SPLIT_CHUNK % group == 0 or group % SPLIT_CHUNK == 0))))


def _worth_splitting(w: QArray, rows: int) -> bool:
    """Whether :func:`split_rows` splits ``w`` for a decode loop of ``rows`` rows: int5 / int6 whenever the split
    tile takes them, int4 slots in groups of at most :data:`SPLIT_INT4_MAX_GROUP` for at most
    :data:`SPLIT_INT4_MAX_ROWS` rows."""
    if w.bits == 4 and (w.tile[1] > SPLIT_INT4_MAX_GROUP or rows > SPLIT_INT4_MAX_ROWS):
        return False
    return split_tile_takes(w)


@functools.partial(jax.jit, static_argnums=1)
def _int4_code_range(qvalue: jax.Array, k: int) -> jax.Array:
    values = unpack(qvalue, 4, qvalue.ndim - 1, k)
    return jnp.stack([values.min(), values.max()])


def narrowest_split_bits(w: QArray) -> int:
    """The split width of a row-major kernel's codes: ``w.bits``, or for int4 slots the fewest bits (2-4)
    that hold every code -- GGUF Q2_K / Q3_K weights load as 2- / 3-bit values and reach the row-major
    kernels widened to int4 (:func:`transpose_kernel`), where split rows keep them in 2 / 3 bits."""
    if w.bits != 4:
        return w.bits
    lo, hi = (int(v) for v in _int4_code_range(w.qvalue, w.shape[1]))
    return next(b for b in (2, 3, 4) if -(1 << (b - 1)) <= lo and hi < (1 << (b - 1)))


_split_jit = jax.jit(split_qvalue, static_argnums=(1, 2, 3))


def split_rows(params, rows: int = 1):
    """``params`` (laid out by :func:`for_decode` for the native kernels) with each weight-only int4-int6
    :class:`RowMajorKernel` the native AVX-512 VNNI kernel can read split holding its codes as
    :func:`split_codes` bytes: int5 / int6 in 0.625 / 0.75 bytes a value instead of 1 (GGUF Q5_0 / Q5_1 /
    Q5_K / Q6_K kept quantized, int5 / int6 recipes), int4 in the same half byte as before but in the
    order the split tile reads (Q4_0 / Q4_1 / Q4_K, int4 recipes), and int4 slots that hold 2- or 3-bit
    values (GGUF Q2_K / Q3_K) in 0.25 / 0.375 bytes a value (:func:`narrowest_split_bits`). Unchanged
    without that tile (no AVX-512 VNNI, or native off): the AVX2 tiles read the stored codes. The stored
    codes are not kept: :meth:`RowMajorKernel.qarray` joins them again for the other paths. ``rows``: the
    decode loop's rows a step (:func:`_worth_splitting`)."""
    from llmeq_jax import native

    if not native.vnni():
        return params

    def convert(leaf):
        if not isinstance(leaf, RowMajorKernel) or leaf.split or not _worth_splitting(leaf.w, rows):
            return leaf
        bits = narrowest_split_bits(leaf.w)
        qvalue = _split_jit(leaf.w.qvalue, leaf.w.bits, leaf.w.shape[1], bits)
        return RowMajorKernel(dataclasses.replace(leaf.w, qvalue=qvalue, bits=bits), leaf.codes, split=True)

    return jax.tree_util.tree_map(convert, params, is_leaf=lambda a: isinstance(a, (RowMajorKernel, QArray)))


def scale_group(w: QArray) -> int | None:
    """The group size along ``in`` of an ``(in, out)`` kernel's scales, None when one scale covers
    the whole input dim (per output column or per tensor)."""
    return None if w.scale.shape[-2] == 1 else w.tile[0]


def int4_word_kernel(w: QArray) -> Int4WordKernel:
    """The :class:`Int4WordKernel` of a 2-D int4 ``(in, out)`` QArray packed along ``in``."""
    from pallas_kernels.int4_words import pack_words

    if len(w.shape) != 2 or w.bits != 4 or w.pack_axis != 0 or w.grid != "uniform":
        raise ValueError(f"int4_word_kernel expects a 2-D uniform int4 kernel packed along its input dim, got {w!r}")
    return Int4WordKernel(dataclasses.replace(w, qvalue=pack_words(w.values(), scale_group(w))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PanelKernel:
    """A float ``(in, out)`` kernel packed into column panels: ``panels[c // 32, :, c % 32]`` is
    column ``c`` (:func:`pack_panels`); the last panel is zero-padded past ``features``.

    ``swiglu``: a SwiGLU MLP's joined gate/up kernel, ``(in, 2 * features)``, packed by
    :func:`pack_swiglu_panels`; ``ops.swiglu`` runs it (``silu(x @ gate) * (x @ up)``, ``features``
    outputs), ``ops.linear`` does not take it."""

    panels: jax.Array
    features: int = dataclasses.field(metadata=dict(static=True))
    swiglu: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """The kernel's logical ``(in, out)`` shape (gate and up side by side for ``swiglu``)."""
        return self.panels.shape[1], self.features * (2 if self.swiglu else 1)


def _column_panels(w: jax.Array, width: int) -> jax.Array:
    """``w`` (in, n) zero-padded to whole ``width``-column panels: [ceil(n / width), in, width] float32."""
    k, n = w.shape
    p = -(-n // width)
    padded = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, p * width - n)))
    return padded.reshape(k, p, width).transpose(1, 0, 2)


def pack_panels(w: jax.Array) -> PanelKernel:
    """The :class:`PanelKernel` of a float ``(in, out)`` kernel (float32 panels)."""
    from llmeq_jax.native import PANEL_COLS

    if w.ndim != 2:
        raise ValueError(f"pack_panels expects a 2-D (in, out) kernel, got shape {w.shape}")
    return PanelKernel(_column_panels(w, PANEL_COLS), w.shape[1])


def pack_swiglu_panels(gate_up: jax.Array) -> PanelKernel:
    """The ``swiglu`` :class:`PanelKernel` of a joined ``(in, 2 I)`` gate/up kernel (gate first):
    each panel holds 16 gate columns then the 16 matching up columns."""
    from llmeq_jax.native import PANEL_COLS

    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"pack_swiglu_panels expects an (in, 2 * intermediate) kernel, got shape {gate_up.shape}")
    i = gate_up.shape[1] // 2
    half = PANEL_COLS // 2
    gate, up = _column_panels(gate_up[:, :i], half), _column_panels(gate_up[:, i:], half)
    return PanelKernel(jnp.concatenate([gate, up], axis=-1), i, swiglu=True)


def unpack_panels(panels: jax.Array, features: int, *, swiglu: bool = False) -> jax.Array:
    """The ``(in, out)`` float kernel packed in ``panels`` (the inverse of :func:`pack_panels`, or of
    :func:`pack_swiglu_panels`: ``(in, 2 * features)``, gate then up)."""
    p, k, cols = panels.shape
    if not swiglu:
        return panels.transpose(1, 0, 2).reshape(k, p * cols)[:, :features]
    half = cols // 2
    gate = panels[..., :half].transpose(1, 0, 2).reshape(k, p * half)[:, :features]
    up = panels[..., half:].transpose(1, 0, 2).reshape(k, p * half)[:, :features]
    return jnp.concatenate([gate, up], axis=1)


def _transposed(w: QArray, qvalue, bits: int, pack_axis: int) -> QArray:
    """``w`` with its two axes swapped: ``qvalue`` given, scales, zero points and tiles transposed."""
    return QArray(
        qvalue=qvalue,
        scale=w.scale.T,
        zero_point=None if w.zero_point is None else w.zero_point.T,
        act_scale=w.act_scale,
        bits=bits,
        shape=(w.shape[1], w.shape[0]),
        tile=(w.tile[1], w.tile[0]),
        dtype=w.dtype,
        pack_axis=pack_axis,
        act_spec=w.act_spec,
        grid=w.grid,
    )


def widen_to_int4(w: QArray) -> QArray:
    """A 2- or 3-bit QArray as the same values in int4 slots (two per byte along the same axis), else ``w``.

    The native kernels read int8 or int4 two per byte; a 2- or 3-bit value is an int4 value, so the
    widened QArray dequantizes to exactly the same array, at a third more bytes than eight 3-bit
    values in three bytes (twice four 2-bit values in one). Checkpoints and the quantized tree keep
    the narrow packing.
    """
    if w.bits not in (2, 3):
        return w
    return dataclasses.replace(w, qvalue=pack(w.values(), 4, w.pack_axis), bits=4)


def transpose_kernel(w: QArray) -> QArray:
    """The ``(out, in)`` QArray of an ``(in, out)`` one: same codes, scales and zero points.

    Sub-byte values are re-packed along ``in`` (``pack_axis=1``), the layout the
    row-major kernels and ``ops.linear_nk`` read; 2- and 3-bit values into int4 slots
    (:func:`widen_to_int4`), which those kernels read.
    """
    if len(w.shape) != 2:
        raise ValueError(f"transpose_kernel expects a 2-D kernel, got shape {w.shape}")
    values = w.values().T
    bits = 4 if w.bits in (2, 3) else w.bits
    qvalue = pack(values, bits, axis=1) if is_packed(bits) else values
    return _transposed(w, qvalue, bits, pack_axis=1)


def kernel_view(w: QArray) -> QArray:
    """An ``(in, out)`` QArray with the values of the ``(out, in)`` ``w`` (unpacked to int8 storage).

    For the XLA fallbacks: dequantizing it gives exactly ``dequantize(w).T``.
    """
    bits = 8 if is_packed(w.bits) else w.bits  # int8 storage of the same values
    return _transposed(w, w.values().T, bits, pack_axis=0)


def _is_kernel(path) -> bool:
    last = path[-1] if path else None
    return getattr(last, "key", getattr(last, "name", None)) == "kernel"


# Fused name -> the sibling linears (same input) whose rows it stacks, in output order.
# A model block asks for the fused name first (models.layers.parallel_linears).
FUSED_LINEARS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def _decode_part(module) -> RowMajorKernel | Int4WordKernel | None:  # Int4RowKernel: made after fusing
    if not isinstance(module, dict) or set(module) - {"kernel", "bias"}:
        return None
    kernel = module.get("kernel")
    return kernel if isinstance(kernel, (RowMajorKernel, Int4WordKernel)) else None


def _stackable(ws: list[QArray], axis: int = 0) -> bool:
    """Whether the 2-D QArrays can be one, stacked along ``axis`` (their output dim): same codes
    layout and input width, scales per output index, no static activation scale."""
    first = ws[0]
    same = all(
        (w.bits, w.tile, w.dtype, w.pack_axis, w.act_spec, w.grid, w.shape[1 - axis], w.zero_point is None)
        == (first.bits, first.tile, first.dtype, first.pack_axis, first.act_spec, first.grid, first.shape[1 - axis],
            first.zero_point is None)
        for w in ws
    )
    # Per-tensor scales (tile[axis] == outputs) and static activation scales belong to one linear each;
    # codes packed along the stacking axis would need every part to fill whole bytes.
    packed_along = is_packed(first.bits) and first.pack_axis == axis
    return same and first.tile[axis] == 1 and not packed_along and all(w.act_scale is None for w in ws)


def stack_quantized(ws: list[QArray], axis: int = 0) -> QArray:
    """One QArray holding ``ws`` one after another along ``axis`` (see :func:`_stackable`)."""
    first = ws[0]
    zero_point = None if first.zero_point is None else jnp.concatenate([w.zero_point for w in ws], axis=axis)
    shape = list(first.shape)
    shape[axis] = sum(w.shape[axis] for w in ws)
    return dataclasses.replace(
        first,
        qvalue=jnp.concatenate([w.qvalue for w in ws], axis=axis),
        scale=jnp.concatenate([w.scale for w in ws], axis=axis),
        zero_point=zero_point,
        shape=tuple(shape),
    )


def stack_rows(ws: list[QArray]) -> QArray:
    """One ``(sum out, in)`` QArray whose rows are those of ``ws`` in order (see :func:`_stackable`)."""
    return stack_quantized(ws, axis=0)


def _fuse_siblings(tree: dict) -> dict:
    out = dict(tree)
    for fused, names in FUSED_LINEARS.items():
        parts = [_decode_part(tree.get(n)) for n in names]
        if any(p is None for p in parts) or len({type(p) for p in parts}) != 1:
            continue
        # row-major kernels stack their (out, in) rows; word kernels their (in'/8, out) columns
        axis = 0 if isinstance(parts[0], RowMajorKernel) else 1
        if not _stackable([p.w for p in parts], axis):
            continue
        biases = [tree[n].get("bias") for n in names]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            continue
        out[fused] = {"kernel": type(parts[0])(stack_quantized([p.w for p in parts], axis))}
        if biases[0] is not None:
            out[fused]["bias"] = jnp.concatenate(biases)
        for n in names:
            del out[n]
    return out


def fuse_linears(params):
    """``params`` with each compatible group of :data:`FUSED_LINEARS` row-major (or int4 word) kernels
    stacked into one."""
    if not isinstance(params, dict):
        return params
    return _fuse_siblings({k: fuse_linears(v) for k, v in params.items()})


# On a GPU, decode steps with at most this many rows read int8 weights K-major (see for_decode).
GPU_KMAJOR_MAX_ROWS = 16


def decode_target(rows: int) -> str | None:
    """Which decode kernels a decode loop of ``rows`` rows per step would use: "native" (CPU row-major),
    "pallas" (the Pallas kernels' K-major int8 and int4-word paths: a GPU, or interpret mode with native
    off), or None."""
    from llmeq_jax import native, ops
    from pallas_kernels import config

    if 0 < rows <= ops.row_major_max_rows(w8a8=False) and native.enabled():
        return "native"
    if 0 < rows <= GPU_KMAJOR_MAX_ROWS and config.kernels_available():
        return "pallas"
    return None


def _candidate(target: str, leaf: QArray, rows: int) -> bool:
    """Whether the ``target`` kernels may take ``leaf`` (an (in, out) kernel) stored row-major."""
    from llmeq_jax import kernel_dispatch

    if target == "native":  # the last word is native.supports_row_major's, on the transposed kernel
        from llmeq_jax import ops

        return (leaf.grid == "uniform" and not (is_packed(leaf.bits) and leaf.pack_axis != 0)
                and rows <= ops.row_major_max_rows(w8a8=leaf.act_spec is not None))
    # Pallas: int8-stored codes (W8A8 int8/fp8, int8 weight-only) that a kernel would take. Their
    # N-major bytes are gathered one at a time into MMA operands (scripts/kernel_sass.py: W8A8 at
    # M = 16 issues 4.3x the instructions of the K-major loop). Packed int4 weight-only kernels go
    # to the word layout (2.1-2.5 instructions per weight against 5.4). Both only where that kernel takes the
    # product (kernel_dispatch.kernel_takes: the table's measured or inferred path, else on a GPU not a small
    # product); otherwise XLA's path reads the product in the layout it has.
    kind, _ = kernel_dispatch.plan((rows, leaf.shape[0]), leaf.dtype, leaf, leaf.act_spec)
    if kind is None:
        return False
    # a plan for packed codes is weight-only int4 (plan refuses int2/int3 and packed W8A8)
    measured_as = "int4_words" if is_packed(leaf.bits) else f"{kind}_nk"
    group = scale_group(leaf)
    # K-major int8 codes are also what the Mosaic GPU decode kernel reads: where a table measured it faster than
    # the Triton kernel and XLA's path, XLA's verdict over the Triton kernel does not keep them (in, out)
    return kernel_dispatch.kernel_takes(measured_as, rows, leaf.dtype, leaf, group) or (
        not is_packed(leaf.bits) and kernel_dispatch.hopper_decode_takes(rows, leaf.dtype, leaf, group, kind))


def _xla_reads_rows(target: str, leaf: QArray) -> bool:
    """Whether a GPU decode step's product that no Pallas kernel takes (a small one) is stored K-major for XLA:
    int4 weight-only codes, which ``ops.linear_nk_xla`` then reads in place in one row reduction over ``in``.
    As stored, ``(in, out)`` with the nibbles packed along ``in``, XLA wrote each step's ``x * q`` as float32 before
    reducing it (8x the codes' bytes; ``scripts/gpu_aot.py``, SmolLM2-135M). int8 codes stay as stored (XLA
    reduces them in place)."""
    from pallas_kernels import config

    return (target == "pallas" and config.on_gpu() and is_packed(leaf.bits) and leaf.grid == "uniform"
            and leaf.act_spec is None and leaf.tile[1] in (1, leaf.shape[1]))


def for_decode(params, rows: int):
    """``params`` with every quantized kernel that the decode loop's kernels read in another layout
    wrapped as a :class:`RowMajorKernel` or an :class:`Int4WordKernel` (siblings fused,
    :func:`fuse_linears`). On a CPU: what the native row-major kernels take, up to
    ``ops.row_major_max_rows`` rows. Where the Pallas kernels run (a GPU), up to
    :data:`GPU_KMAJOR_MAX_ROWS` rows: int8-stored kernels, which the W8A8 and weight-only kernels then
    read K-major as stored, and int4 weight-only kernels as words (``pallas_kernels.int4_words``; a SwiGLU's
    joined gate/up kernel paired where the kernel gates it: :func:`pair_swiglu`); a weight-only kernel whose product
    is faster through the float model's path (``kernel_dispatch.dequantized_decode_wins``: a small one, or as a
    table measured) dequantized into its float dtype once (its float bytes in this copy). Unchanged otherwise.
    Idempotent: params laid out already come back as they are (same leaves).
    ``generate.decode_params`` calls it once per params, jitted, outside the decode loop, and keeps the
    copy (one more copy of the quantized kernels) for the most recent params, batch size and kernel
    switches; the loop calls it again, a no-op on that copy, so a loop handed the checkpoint's layout
    still gets the decode one."""
    from llmeq_jax import kernel_dispatch, native
    from llmeq_jax.models import stacked  # not at import time: the models import this module

    target = decode_target(rows)
    if target is None:
        return params
    if stacked.is_stacked(params):  # the same conversion for every stacked block (vmapped over the layer axis)
        blocks = jax.vmap(lambda block: for_decode(block, rows))(params[stacked.BLOCKS])
        rest = {k: v for k, v in params.items() if k != stacked.BLOCKS}
        return {**for_decode(rest, rows), stacked.BLOCKS: blocks}

    def convert(path, leaf):
        if not (isinstance(leaf, QArray) and _is_kernel(path) and len(leaf.shape) == 2):
            return leaf
        if target == "pallas" and kernel_dispatch.dequantized_decode_wins(rows, leaf):
            return leaf.dequantize(leaf.dtype)  # the float model's path: faster than any over the codes here
        if not _candidate(target, leaf, rows):
            return RowMajorKernel(transpose_kernel(leaf)) if _xla_reads_rows(target, leaf) else leaf
        if target == "pallas" and is_packed(leaf.bits):
            return int4_word_kernel(leaf)
        w = transpose_kernel(leaf)
        if target == "native" and native.supports_row_major(w, leaf.act_spec) is not None:
            return leaf
        return RowMajorKernel(w)

    if target == "pallas":
        params = _join_small_siblings(params, rows)
    converted = jax.tree_util.tree_map_with_path(convert, params, is_leaf=lambda a: isinstance(a, QArray))
    fused = fuse_linears(converted)
    if target != "pallas":
        return fused
    fused = _rows_for_hopper(fused, rows)
    return pair_swiglu(fused) if _gates_in_kernel() else fused


def _gates_in_kernel() -> bool:
    """Whether a GPU's decode word kernels gate a SwiGLU's product as they finish it (:func:`pair_swiglu`): where
    they finish their products themselves (``pallas_kernels.split_fixup``: not yet run on a GPU, so only where
    ``LLMEQ_UNCHECKED_KERNELS`` names it)."""
    from pallas_kernels import config, hardware_checked

    return config.on_gpu() and hardware_checked.allowed("split_fixup")


def narrow_norm_scales(params, dtype):
    """Stacked ``params`` with each norm's scale stored in ``dtype`` (the activations') where that loses nothing,
    else as they are. A decode step's norms folded into their products (``pallas_kernels.norm_fold``) multiply x by
    the scale in x's dtype where the scale has it -- the same single rounding as in float32, a cheaper loop (sm_90:
    911 -> 735 instructions a K step of the int4 word kernel) -- and loaders keep a bf16 checkpoint's norm scales
    in float32. Host-side: one comparison a scale (``generate.decode_params``, once per params)."""
    from llmeq_jax.models import stacked  # not at import time: the models import this module

    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or not stacked.is_stacked(params):
        return params

    def narrow(path, leaf):
        if not stacked.is_norm_scale(path, leaf) or leaf.dtype == dtype:
            return leaf
        narrowed = leaf.astype(dtype)
        return narrowed if bool(jnp.array_equal(narrowed.astype(leaf.dtype), leaf)) else leaf

    return {**params, stacked.BLOCKS: jax.tree_util.tree_map_with_path(narrow, params[stacked.BLOCKS])}


def pair_swiglu(params):
    """``params`` with every SwiGLU's joined gate/up kernel (``gate_up_proj``, gate then up along its outputs) that a
    decode kernel can gate -- an :class:`Int4WordKernel`, or an int8-stored :class:`RowMajorKernel`: weight-only (the
    float16-operand and K-major int8 kernels) or W8A8 (int8 or E4M3 codes: the W8A8 kernel) -- stored ``paired``:
    outputs interleaved, gate ``i`` then up ``i``, so that each of the kernel's column tiles holds both halves of its
    outputs and gates them where it finishes the product (``pallas_kernels.common.swiglu_pairs``; ``ops.swiglu``) --
    no launch for the activation. Codes, scales and zero points move together (a stack [L, ...] too); other leaves
    come back as they are."""
    def walk(tree):
        if not isinstance(tree, dict):
            return tree
        out = {k: walk(v) for k, v in tree.items()}
        module = out.get("gate_up_proj")
        if isinstance(module, dict) and "bias" not in module and _pairable(module.get("kernel")):
            out["gate_up_proj"] = {**module, "kernel": _paired(module["kernel"])}
        return out

    return walk(params)


def _pairable(kernel) -> bool:
    """Whether :func:`pair_swiglu` pairs ``kernel``'s outputs: a decode kernel that gates paired tiles reads it."""
    if isinstance(kernel, Int4WordKernel):
        return not kernel.paired and kernel.shape[1] % 2 == 0
    return (isinstance(kernel, RowMajorKernel) and not kernel.paired and not kernel.split and kernel.codes is None
            and kernel.w.bits == 8 and kernel.shape[1] % 2 == 0)


def _paired(kernel):
    """``kernel`` (:func:`_pairable`) with its outputs interleaved, gate ``i`` then up ``i``: along the last axis of
    an ``(in, out)`` word kernel's arrays, along ``w``'s rows (axis -2) of a row-major one's."""
    axis = -1 if isinstance(kernel, Int4WordKernel) else -2

    def pair(a):
        if a is None or a.shape[axis] == 1:  # None, or one scale for every output
            return a
        moved = jnp.moveaxis(a, axis, -1)
        half = moved.shape[-1] // 2
        paired = jnp.stack([moved[..., :half], moved[..., half:]], axis=-1).reshape(moved.shape)
        return jnp.moveaxis(paired, -1, axis)

    w = kernel.w
    w = dataclasses.replace(w, qvalue=pair(w.qvalue), scale=pair(w.scale), zero_point=pair(w.zero_point))
    return dataclasses.replace(kernel, w=w, paired=True)


def _rows_for_hopper(params, rows: int):
    """``params`` with every int4 word kernel (fused siblings included) whose decode product a dispatch table
    measured faster through the Mosaic GPU decode kernel than through both the word kernel and XLA's path
    (``kernel_dispatch.hopper_decode_takes``) stored as that kernel's rows, an :class:`Int4RowKernel`."""
    from llmeq_jax import kernel_dispatch
    from pallas_kernels.decode_hopper import transpose_codes
    from pallas_kernels.int4_words import unpack_words

    def convert(leaf):
        if not (isinstance(leaf, Int4WordKernel) and not leaf.paired  # paired columns: for the word kernel's gate
                and kernel_dispatch.hopper_decode_takes(rows, leaf.w.dtype, leaf.w, leaf.group)):
            return leaf
        codes = unpack_words(leaf.w.qvalue, leaf.w.shape[0])
        return Int4RowKernel(dataclasses.replace(leaf.w, qvalue=transpose_codes(codes)))

    def walk(tree):  # the param dicts only: every other leaf comes back as it is (the same object)
        return {k: walk(v) for k, v in tree.items()} if isinstance(tree, dict) else convert(tree)

    return walk(params)


def _join_small_siblings(params, rows: int):
    """``params`` with each :data:`FUSED_LINEARS` group of quantized kernels that the Pallas kernels would not
    all take one by one, but would take joined, joined (``(in, sum out)``, before :func:`for_decode`'s
    conversion). A GPU leaves products under ``kernel_dispatch.MIN_KERNEL_WEIGHTS`` to XLA: a grouped-query
    model's k and v projections (Llama-3-8B: 4096 x 1024 each) stayed apart from q, three products and their
    outputs three operands of the step's attention, where one q/k/v kernel makes one."""
    if not isinstance(params, dict):
        return params
    out = {k: _join_small_siblings(v, rows) for k, v in params.items()}
    for fused, names in FUSED_LINEARS.items():
        modules = [out.get(n) for n in names]
        if not all(isinstance(m, dict) and not set(m) - {"kernel", "bias"} for m in modules):
            continue
        ws = [m.get("kernel") for m in modules]
        biases = [m.get("bias") for m in modules]
        if not (all(isinstance(w, QArray) and len(w.shape) == 2 for w in ws) and _stackable(ws, axis=1)) or \
                (any(b is None for b in biases) and not all(b is None for b in biases)):
            continue
        joined = stack_quantized(ws, axis=1)
        if all(_candidate("pallas", w, rows) for w in ws) or not _candidate("pallas", joined, rows):
            continue  # converted one by one and fused after (fuse_linears), or left to XLA
        out[fused] = {"kernel": joined} | ({} if biases[0] is None else {"bias": jnp.concatenate(biases)})
        for n in names:
            del out[n]
    return out


# for_prefill packs float kernels into panels only while they hold at most this many bytes in all:
# the packed copy lives beside the caller's params during an evaluation.
PREFILL_PACK_MAX_BYTES = 2 << 30

# for_prefill fuses a group only while its summed outputs stay at or under this: past it the
# separate products are already wide enough to run at full speed, and the fused copy of a large
# model's kernels would cost gigabytes.
PREFILL_FUSE_MAX_OUT = 4096


def _prefill_kernel(module) -> jax.Array | QArray | None:
    """The ``(in, out)`` kernel of a linear module for_prefill may fuse: float, or quantized on a uniform grid."""
    if not isinstance(module, dict) or set(module) - {"kernel", "bias"}:
        return None
    kernel = module.get("kernel")
    if isinstance(kernel, QArray):
        return kernel if len(kernel.shape) == 2 and kernel.grid == "uniform" else None
    return kernel if isinstance(kernel, jax.Array) and kernel.ndim == 2 else None


def _fused_prefill_kernel(kernels: list) -> jax.Array | QArray | None:
    """``kernels`` side by side as one ``(in, sum out)`` kernel, or None when they cannot be one."""
    if sum(k.shape[1] for k in kernels) > PREFILL_FUSE_MAX_OUT:
        return None
    if all(isinstance(k, QArray) for k in kernels):
        return stack_quantized(kernels, axis=1) if _stackable(kernels, axis=1) else None
    if any(isinstance(k, QArray) for k in kernels) or len({(k.shape[0], k.dtype) for k in kernels}) != 1:
        return None
    return jnp.concatenate(kernels, axis=1)


def _fuse_for_prefill(params):
    """``params`` with each fusable :data:`FUSED_LINEARS` group joined (see :func:`for_prefill`)."""
    if not isinstance(params, dict):
        return params
    out = {k: _fuse_for_prefill(v) for k, v in params.items()}
    for fused, names in FUSED_LINEARS.items():
        kernels = [_prefill_kernel(out.get(n)) for n in names]
        if any(k is None for k in kernels):
            continue
        kernel = _fused_prefill_kernel(kernels)
        biases = [out[n].get("bias") for n in names]
        if kernel is None or (any(b is None for b in biases) and not all(b is None for b in biases)):
            continue
        out[fused] = {"kernel": kernel}
        if biases[0] is not None:
            out[fused]["bias"] = jnp.concatenate(biases)
        for n in names:
            del out[n]
    return out


def _float_kernels(params) -> list[jax.Array]:
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda a: isinstance(a, QArray))
    return [a for path, a in leaves if _is_kernel(path) and isinstance(a, jax.Array) and a.ndim == 2
            and a.dtype == jnp.float32]


def pack_float_kernels(params):
    """``params`` with every float32 ``(in, out)`` kernel packed as a :class:`PanelKernel`; a joined
    SwiGLU ``gate_up_proj`` kernel (the only user of that name, ``models.llama.SwiGLU``) as a
    ``swiglu`` one."""

    def convert(path, leaf):
        if _is_kernel(path) and isinstance(leaf, jax.Array) and leaf.ndim == 2 and leaf.dtype == jnp.float32:
            names = [getattr(k, "key", None) for k in path]
            return pack_swiglu_panels(leaf) if "gate_up_proj" in names else pack_panels(leaf)
        return leaf

    return jax.tree_util.tree_map_with_path(convert, params, is_leaf=lambda a: isinstance(a, QArray))


# The rows a prompt's W8A8 product is planned for (kernel_dispatch.plan): the W8A8 kernels' limits do not
# depend on rows past a decode step's.
PROMPT_PLAN_ROWS = 2048


def prompt_target() -> str | None:
    """Which kernels a prompt's quantized products go to: "native" (CPU), "pallas" (the Pallas kernels: a GPU, or
    interpret mode with native off), or None (XLA)."""
    from llmeq_jax import native
    from pallas_kernels import config

    if native.enabled():
        return "native"
    return "pallas" if config.kernels_available() else None


def w8a8_kmajor(params):
    """``params`` with every W8A8 kernel (int8 or FP8 codes with an activation spec) that the W8A8 kernel takes
    stored K-major, as a :class:`RowMajorKernel` -- the layout decode steps read on a GPU (:func:`for_decode`),
    here for a prompt's many rows. Hopper's int8 and FP8 wgmma take K-major operands only: given ``(in, out)``
    codes, the kernel transposed every weight per call from ``w8a8.TRANSPOSE_MIN_M`` rows on (inside a scanned
    prompt, a Llama-2-7B layer's 193 MiB read and written before its products), and below that gathered the
    N-major bytes one at a time (H200, 4096 x 11008: K-major 1.04x / 1.10x bf16 at 512 / 2048 rows, the
    ``(in, out)`` kernel 0.24-0.99x). XLA's W8A8 path reads the K-major codes as they are too (one dot over
    their last axis). Other kernels are left as they are."""
    from llmeq_jax import kernel_dispatch  # not at import time: it imports this module

    def convert(path, leaf):
        if not (isinstance(leaf, QArray) and _is_kernel(path) and len(leaf.shape) == 2 and leaf.act_spec is not None
                and not is_packed(leaf.bits)):
            return leaf
        kind, _ = kernel_dispatch.plan((PROMPT_PLAN_ROWS, leaf.shape[0]), leaf.dtype, leaf, leaf.act_spec)
        return RowMajorKernel(transpose_kernel(leaf)) if kind in ("w8a8", "fp8_w8a8") else leaf

    return jax.tree_util.tree_map_with_path(convert, params, is_leaf=lambda a: isinstance(a, QArray))


def _prompt_takes_words(leaf: QArray) -> bool:
    """Whether a prompt's product with the int4 weight-only kernel ``leaf`` (``(in, out)``, or its words) goes to
    the prompt kernel over words (``kernel_dispatch.prompt_words_take`` at :data:`PROMPT_PLAN_ROWS` rows), unless
    the Mosaic GPU kernel over the packed codes measured faster still (``kernel_dispatch.hopper_beats_words``)."""
    from llmeq_jax import kernel_dispatch  # not at import time: it imports this module

    args = (PROMPT_PLAN_ROWS, leaf.dtype, leaf, scale_group(leaf))
    return kernel_dispatch.prompt_words_take(*args) and not kernel_dispatch.hopper_beats_words(*args)


def words_for_prompts(params):
    """``params`` with every int4 weight-only kernel whose prompt products go to the prompt kernel over words
    (:func:`_prompt_takes_words`: where a dispatch table measured ``pallas_kernels.int4_words_prefill`` faster
    than XLA's path) stored as words, an :class:`Int4WordKernel` -- the layout a GPU's decode steps read
    (:func:`for_decode`), so that one copy of the weights can serve both (:func:`serves_prompts`). The others
    are left as they are (XLA's path reads the packed codes)."""
    from llmeq_jax import kernel_dispatch  # not at import time: it imports this module

    def convert(path, leaf):
        if not (isinstance(leaf, QArray) and _is_kernel(path) and len(leaf.shape) == 2 and is_packed(leaf.bits)
                and leaf.act_spec is None):
            return leaf
        kind, _ = kernel_dispatch.plan((PROMPT_PLAN_ROWS, leaf.shape[0]), leaf.dtype, leaf, None)
        return int4_word_kernel(leaf) if kind == "weight_only" and _prompt_takes_words(leaf) else leaf

    return jax.tree_util.tree_map_with_path(convert, params, is_leaf=lambda a: isinstance(a, QArray))


def serves_prompts(params) -> bool:
    """Whether params laid out by :func:`for_decode` are what a prompt should run on too: where the Pallas
    kernels run, when the only block kernels the layout changed are W8A8 ones (K-major, as :func:`w8a8_kmajor`
    lays them out for prompts) and int4 words whose prompt products go to the prompt kernel over them (as
    :func:`words_for_prompts` lays them out). ``generate`` then fills the cache from the decode layout: no
    per-call transpose of the checkpoint's W8A8 codes and no other copy. Weight-only kernels laid out for decode
    rows only (K-major int8, words XLA would take at a prompt's rows) are not for a prompt -- but for the LM
    head's, which a prompt runs on its last position only (``forward_step(last_only=True)``)."""
    if prompt_target() != "pallas":
        return False
    is_laid = lambda a: isinstance(a, (RowMajorKernel, Int4WordKernel))  # noqa: E731
    laid = [(path, a) for path, a in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_laid) if is_laid(a)]
    blocks = [a for path, a in laid if "lm_head" not in jax.tree_util.keystr(path)]
    return bool(blocks) and all(isinstance(a, RowMajorKernel) and a.w.act_spec is not None
                                or isinstance(a, Int4WordKernel) and _prompt_takes_words(a.w) for a in blocks)


def for_prefill(params):
    """The prefill / perplexity layout of ``params``, made once, outside the jit (it copies kernels):

    * each :data:`FUSED_LINEARS` group of ``(in, out)`` kernels (all float with the same input
      width and dtype, or all quantized with the same codes layout and per-output scales; biases
      on all or none; at most :data:`PREFILL_FUSE_MAX_OUT` outputs together) joined into one
      kernel, which the model blocks then run as one product (``models.layers.parallel_linears``):
      one activation quantization and one wider GEMM instead of two or three;
    * where the Pallas kernels run (:func:`prompt_target`: a GPU), W8A8 kernels stored K-major
      (:func:`w8a8_kmajor`), int4 kernels whose prompt products a dispatch table sends to the prompt kernel over
      words as words (:func:`words_for_prompts`), and their groups joined whatever their width (the copy is made
      anyway);
    * where the native AVX-512 float GEMM runs (``native.avx512()``, native kernels on, one
      device: ``native.prefill_kernels_ok``) and the
      float32 kernels hold at most :data:`PREFILL_PACK_MAX_BYTES`, each packed as a
      :class:`PanelKernel`, which ``ops.linear`` sends to ``native.panel_matmul``; a tied
      model's float32 token table also gets a packed copy as the head's ``lm_head`` (the
      lookup keeps reading the table).

    Outputs are unchanged up to float summation order (each column is the same dot product with
    the same scales)."""
    from llmeq_jax import native
    from llmeq_jax.models import stacked  # not at import time: the models import this module

    if stacked.is_stacked(params):
        raise ValueError("for_prefill: the blocks are stacked already; apply for_prefill before "
                         "models.stacked.stack_blocks")
    target = prompt_target()
    if target == "native":  # the native weight-only kernels read int4 slots, not 2- or 3-bit packings
        params = jax.tree_util.tree_map(lambda a: widen_to_int4(a) if isinstance(a, QArray) else a, params,
                                        is_leaf=lambda a: isinstance(a, QArray))
    if target == "pallas":
        params = words_for_prompts(w8a8_kmajor(params))
    fused = fuse_linears(_fuse_for_prefill(params))  # fuse_linears joins the K-major and word groups, of any width
    if not (target == "native" and native.avx512() and native.prefill_kernels_ok()):
        return fused
    table = _tied_head_table(fused)
    kernels = _float_kernels(fused) + ([] if table is None else [table])
    if sum(a.size * a.dtype.itemsize for a in kernels) > PREFILL_PACK_MAX_BYTES:
        return fused
    packed = pack_float_kernels(fused)
    if table is not None:  # models.model.head runs an lm_head when the tree has one
        packed = {**packed, "lm_head": {"kernel": pack_panels(table.T)}}
    return packed


def _tied_head_table(params) -> jax.Array | None:
    """The float32 token table a tied model's head multiplies by (its tree has no ``lm_head``), else None."""
    if not isinstance(params, dict) or "lm_head" in params:
        return None
    table = params.get("embed", {}).get("embedding") if isinstance(params.get("embed"), dict) else None
    return table if isinstance(table, jax.Array) and table.ndim == 2 and table.dtype == jnp.float32 else None


__all__ = ["FUSED_LINEARS", "Int4RowKernel", "Int4WordKernel", "PREFILL_FUSE_MAX_OUT", "PREFILL_PACK_MAX_BYTES",
           "PROMPT_PLAN_ROWS",
           "PanelKernel", "RowMajorKernel", "SCALE_STEP_VALUES", "SPLIT_BITS", "ScaleCodes", "compact_scales",
           "decode_target", "for_decode", "for_prefill", "fuse_linears", "int4_word_kernel", "join_codes",
           "kernel_view", "narrowest_split_bits", "pack_float_kernels", "pack_panels", "pack_swiglu_panels",
           "pair_swiglu", "prompt_target", "scale_codes", "scale_group", "serves_prompts", "split_codes", "split_rows",
           "split_tile_takes", "stack_quantized", "stack_rows", "transpose_kernel", "unpack_panels", "w8a8_kmajor",
           "widen_to_int4", "words_for_prompts"]
