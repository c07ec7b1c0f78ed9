"""llama.cpp's quantized blocks read as our integer grids, so a GGUF model can stay quantized on load.

Each block type below is a uniform grid per block of consecutive input features of one row, so its
tensors become QArrays holding the file's own integers: nothing is dequantized and quantized again,
the model computes what the file stores, in its bytes.

  type   block                    x =                       QArray
  Q8_0   32                       d * q                     int8 symmetric, groups of 32
  Q4_0   32                       d * (u - 8)               int4 symmetric, q = u - 8
  Q5_0   32                       d * (u - 16)              int5 symmetric, q = u - 16
  Q4_1   32                       d * u + m                 int4, q = u - 8, zero point -8 - m / d
  Q5_1   32                       d * u + m                 int5, q = u - 16, zero point -16 - m / d
  Q4_K   256 = 8 sub-blocks of 32  d sc_j * u - dmin mn_j    int4, groups of 32, scale d sc_j
  Q5_K   as Q4_K, 5-bit u                                   int5, groups of 32
  Q6_K   256 = 16 sub-blocks of 16 d sc_j * (u - 32)        int6 symmetric, groups of 16
  Q3_K   256 = 16 sub-blocks of 16 d sc_j * q, q in -4..3     int3 symmetric, groups of 16
  Q2_K   256 = 16 sub-blocks of 16 d sc_j * u - dmin mn_j    int2, q = u - 2, groups of 16

``d``, ``m``, ``dmin`` are float16; ``sc``/``mn`` 6-bit unsigned (Q4_K, Q5_K), 4-bit unsigned (Q2_K),
6-bit minus 32 (Q3_K) or int8 (Q6_K); Q3_K's and Q6_K's scales may be negative (dequantizing does not
care). The asymmetric types' zero points are
floats (``m / d`` is not an integer): ``QArray.dequantize`` and the CPU kernels take
``(q - zp) * scale`` in float32 as for integer zero points. int2 / int3 values are packed as
``quantize`` packs them (the decode layout widens them to int4 for the native kernels). Other types
(the IQ family, ...) have no entry here: the loader dequantizes them.

The block layouts are ggml's (``ggml-common.h``); the decoders are checked value for value against
``gguf.quants.dequantize`` in the tests.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.qarray import QArray, pack


@dataclasses.dataclass(frozen=True)
class BlockGrid:
    """A quantized ``(rows, cols)`` tensor as integers: ``x = (q - zero_point) * scale`` per group.

    ``q`` (rows, cols) int8 signed in the ``bits``-bit range; ``scale`` and ``zero_point`` (rows,
    cols / group) float32; ``zero_point`` None for symmetric types.
    """

    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    bits: int
    group: int

    def dequantize(self) -> np.ndarray:
        per_value = lambda a: np.repeat(a, self.group, axis=1)  # noqa: E731 - one line, used twice
        q = self.q.astype(np.float32)
        if self.zero_point is not None:
            q = q - per_value(self.zero_point)
        return q * per_value(self.scale)

    def kernel(self, dtype) -> QArray:
        """Our ``(in, out)`` kernel of this ``(out, in)`` grid: groups of ``group`` along ``in``, int2-4
        values packed along it (as ``quantize`` packs a grouped kernel)."""
        return self._qarray(dtype, axis=0)

    def table(self, dtype) -> QArray:
        """Our ``(rows, cols)`` embedding table of this grid: scales per row and group along ``cols``,
        int2-4 values packed along them (as ``rules.quantize_table`` lays a table out: rows stay whole)."""
        return self._qarray(dtype, axis=1)

    def _qarray(self, dtype, axis: int) -> QArray:
        """The grid as a QArray whose groups run along ``axis``: 0 transposes it, 1 keeps it."""
        orient = (lambda a: a.T) if axis == 0 else (lambda a: a)  # noqa: E731 - applied to three arrays
        q = orient(self.q)
        tile = (self.group, 1) if axis == 0 else (1, self.group)
        return QArray(
            qvalue=pack(jnp.asarray(q), self.bits, axis=axis),
            scale=jnp.asarray(orient(self.scale)),
            zero_point=None if self.zero_point is None else jnp.asarray(orient(self.zero_point)),
            bits=self.bits, shape=tuple(q.shape), tile=tile, dtype=jnp.dtype(dtype), pack_axis=axis,
        )

    def rows(self, order: np.ndarray) -> "BlockGrid":
        """The same grid with its rows in ``order`` (llama.cpp's Q/K row permutation, undone)."""
        return dataclasses.replace(self, q=self.q[order], scale=self.scale[order],
                                   zero_point=None if self.zero_point is None else self.zero_point[order])


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block, as float32 (nb, 1)."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float32)


def _halves(qs: np.ndarray) -> np.ndarray:
    """Bytes (nb, 16) -> 32 nibbles: value j is byte j's low nibble, value j + 16 its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes of high bits (nb, 4) -> (nb, 32) values 0 or 16 (bit j of the little-endian word)."""
    word = np.ascontiguousarray(qh).view("<u4").astype(np.uint32)  # (nb, 1)
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes (nb, 12) -> 8 six-bit scales and 8 six-bit mins, each (nb, 8).

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales / mins 4-7 take
    their low 4 bits from bytes 8-11 (low / high nibble) and their top 2 bits from the top of
    bytes 0-3 / 4-7."""
    p = packed.astype(np.uint8)
    lo_sc, lo_mn, tail = p[:, 0:4], p[:, 4:8], p[:, 8:12]
    sc = np.concatenate([lo_sc & 63, (tail & 0x0F) | ((lo_sc >> 6) << 4)], axis=1)
    mn = np.concatenate([lo_mn & 63, (tail >> 4) | ((lo_mn >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _asymmetric(u: np.ndarray, scale: np.ndarray, low: np.ndarray, bits: int, group: int,
                unit: np.ndarray | None = None) -> BlockGrid:
    """``x = scale * u + low`` per group, u unsigned ``bits``-bit: q = u - 2^(bits-1), zp = -2^(bits-1) - low / scale.

    A group with a zero scale holds the constant ``low``: its codes become the lowest one, its scale
    ``unit`` (default: ``low``, or 1 where ``low`` is 0) and its zero point ``low / unit`` below them, so it
    dequantizes to ``low``. K-quants pass their super-block scale as ``unit`` (``dmin`` where ``d`` is 0): the
    group's scale is then one sub-block step like its neighbours', which keeps a super-block's scales int8
    multiples of one step (``decode_layout.scale_codes``)."""
    half = 1 << (bits - 1)
    q = u.astype(np.int16) - half
    zero = scale == 0
    zp = -half - low / np.where(zero, 1.0, scale)  # zero-scale groups: set below
    if np.any(zero):
        q = np.where(np.repeat(zero, group, axis=1), -half, q)
        if unit is None:
            unit = np.where(low != 0, low, 1.0)
        unit = np.broadcast_to(unit, scale.shape)
        zp = np.where(zero, -half - low / np.where(zero, unit, 1.0), zp)
        scale = np.where(zero, unit, scale)
    return BlockGrid(q.astype(np.int8), scale.astype(np.float32), zp.astype(np.float32), bits, group)


def _k_unit(d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    """The scale a K-quant's zero-scale sub-block takes (``_asymmetric``'s ``unit``): ``d``, or ``dmin``
    where ``d`` is 0, or 1 where both are."""
    return np.where(d != 0, d, np.where(dmin != 0, dmin, 1.0))


def decode_q8_0(b: np.ndarray) -> BlockGrid:
    return BlockGrid(np.ascontiguousarray(b[:, 2:34]).view(np.int8), _f16(b, 0), None, 8, 32)


def decode_q4_0(b: np.ndarray) -> BlockGrid:
    q = _halves(b[:, 2:18]).astype(np.int16) - 8
    return BlockGrid(q.astype(np.int8), _f16(b, 0), None, 4, 32)


def decode_q5_0(b: np.ndarray) -> BlockGrid:
    u = _halves(b[:, 6:22]) | _fifth_bits(b[:, 2:6])
    return BlockGrid((u.astype(np.int16) - 16).astype(np.int8), _f16(b, 0), None, 5, 32)


def decode_q4_1(b: np.ndarray) -> BlockGrid:
    return _asymmetric(_halves(b[:, 4:20]), _f16(b, 0), _f16(b, 2), 4, 32)


def decode_q5_1(b: np.ndarray) -> BlockGrid:
    u = _halves(b[:, 8:24]) | _fifth_bits(b[:, 4:8])
    return _asymmetric(u, _f16(b, 0), _f16(b, 2), 5, 32)


def _k_quant(b: np.ndarray, u: np.ndarray, bits: int) -> BlockGrid:
    """Q4_K / Q5_K: super-block scales d, dmin and six-bit sub-block scales / mins at bytes 0-15."""
    sc, mn = _k_scales(b[:, 4:16])
    d, dmin = _f16(b, 0), _f16(b, 2)
    return _asymmetric(u, d * sc, -dmin * mn, bits, 32, _k_unit(d, dmin))


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes (nb, 128) -> 256 nibbles: for each 32-byte chunk, its low nibbles are
    one sub-block of 32 values and its high nibbles the next."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, 256)


def decode_q4_k(b: np.ndarray) -> BlockGrid:
    return _k_quant(b, _k_nibbles(b[:, 16:144]), 4)


def decode_q5_k(b: np.ndarray) -> BlockGrid:
    # Sub-block s takes its fifth bit from bit s of each of the 32 high-bit bytes (value l of the sub-block: byte l).
    qh = b[:, 16:48].reshape(-1, 1, 32)
    fifth = ((qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4  # (nb, 8, 32)
    return _k_quant(b, _k_nibbles(b[:, 48:176]) | fifth.reshape(-1, 256).astype(np.uint8), 5)


def decode_q6_k(b: np.ndarray) -> BlockGrid:
    """Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, float16 d.

    Each half of 128 values reads 64 low-nibble bytes ``ql`` and 32 high bytes ``qh``: its four
    quarters of 32 take (ql[0:32] low, ql[32:64] low, ql[0:32] high, ql[32:64] high) nibbles and
    bit pairs 0-1, 2-3, 4-5, 6-7 of qh."""
    ql = b[:, 0:128].reshape(-1, 2, 1, 2, 32)  # (nb, half, -, which 32 bytes, l)
    qh = b[:, 128:192].reshape(-1, 2, 1, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # (nb, half, nibble, which, l): quarter = 2 nibble + which
    pair = np.arange(4, dtype=np.uint8).reshape(1, 1, 2, 2, 1) * 2
    u = low | (((qh >> pair) & 3) << 4)
    q = u.reshape(-1, 256).astype(np.int16) - 32
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return BlockGrid(q.astype(np.int8), _f16(b, 208) * scales, None, 6, 16)


def _two_bit_planes(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 64 bytes (nb, 64) of 2-bit fields -> 256 values: each 32-byte half gives 128, its bit
    pairs 0-1, 2-3, 4-5, 6-7 in turn 32 values each (value l of a run: byte l)."""
    shift = np.arange(0, 8, 2, dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shift) & 3).reshape(-1, 256)


def decode_q2_k(b: np.ndarray) -> BlockGrid:
    """Q2_K: 16 bytes of 4-bit scale / min pairs (low / high nibble), 64 bytes of 2-bit values, float16 d
    and dmin: x = d sc_j * u - dmin mn_j in 16 groups of 16."""
    sc = (b[:, 0:16] & 0x0F).astype(np.float32)
    mn = (b[:, 0:16] >> 4).astype(np.float32)
    d, dmin = _f16(b, 80), _f16(b, 82)
    return _asymmetric(_two_bit_planes(b[:, 16:80]), d * sc, -dmin * mn, 2, 16, _k_unit(d, dmin))


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes (nb, 12) -> 16 signed scales (six bits, minus 32): scale i takes its low 4 bits
    from byte i % 8 (low nibble for i < 8, high for i >= 8) and its top 2 bits from byte 8 + i % 4, bits
    2 (i // 4) and up."""
    p = packed.astype(np.uint8)
    i = np.arange(16)
    low = (p[:, i % 8] >> (4 * (i // 8)).astype(np.uint8)) & 0x0F
    high = (p[:, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 3
    return ((low | (high << 4)).astype(np.int16) - 32).astype(np.float32)


def decode_q3_k(b: np.ndarray) -> BlockGrid:
    """Q3_K: 32 bytes of high bits, 64 bytes of 2-bit values, 12 bytes of 6-bit scales, float16 d:
    x = d sc_j * q in 16 groups of 16, q = low 2 bits - 4 where the high bit is clear (int3, -4..3).
    Value v takes its high bit from bit v // 32 of byte v % 32."""
    hbit = (b[:, 0:32].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = _two_bit_planes(b[:, 32:96]).astype(np.int16) - 4 * (1 - hbit.reshape(-1, 256).astype(np.int16))
    return BlockGrid(q.astype(np.int8), _f16(b, 108) * _q3_k_scales(b[:, 96:108]), None, 3, 16)


# GGML type name -> (values per block, bytes per block, decoder).
DECODERS = {
    "Q8_0": (32, 34, decode_q8_0),
    "Q4_0": (32, 18, decode_q4_0),
    "Q5_0": (32, 22, decode_q5_0),
    "Q4_1": (32, 20, decode_q4_1),
    "Q5_1": (32, 24, decode_q5_1),
    "Q4_K": (256, 144, decode_q4_k),
    "Q5_K": (256, 176, decode_q5_k),
    "Q6_K": (256, 210, decode_q6_k),
    "Q3_K": (256, 110, decode_q3_k),
    "Q2_K": (256, 84, decode_q2_k),
}


def keeps(type_name: str) -> bool:
    """Whether tensors of this GGML type can stay quantized (their integers read as a :class:`BlockGrid`)."""
    return type_name in DECODERS


def decode(raw: np.ndarray, type_name: str, rows: int, cols: int) -> BlockGrid:
    """A ``(rows, cols)`` tensor's bytes (as the GGUF reader gives them) as a :class:`BlockGrid`."""
    per_block, nbytes, decoder = DECODERS[type_name]
    if cols % per_block:
        raise ValueError(f"a {type_name} row of {cols} values is not a whole number of {per_block}-value blocks")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, nbytes)
    if blocks.shape[0] != rows * cols // per_block:
        raise ValueError(f"{type_name} data holds {blocks.shape[0]} blocks; ({rows}, {cols}) needs "
                         f"{rows * cols // per_block}")
    grid = decoder(blocks)
    groups = cols // grid.group
    return BlockGrid(grid.q.reshape(rows, cols), grid.scale.reshape(rows, groups),
                     None if grid.zero_point is None else grid.zero_point.reshape(rows, groups),
                     grid.bits, grid.group)
