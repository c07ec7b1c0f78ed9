"""The quantized KV cache's codes read as 32-bit words and made float16 MMA operands by bit patterns.

The cache stores int8 codes (or int4 codes two per byte) along the head dim, ``[..., T, D / per-byte]``.
Reinterpreted as int32 words (``as_words``: an XLA bitcast, no copy -- ``scripts/gpu_aot.py`` shows no
kernel for it), word ``w`` of a token holds channels ``P w + j``, lane ``j = 0 .. P-1`` (P = 4 bytes or
8 nibbles). A decode kernel loads a tile of words 32 bits at a time and makes each lane's float16 operands
by bit patterns (:func:`lane_asm`): byte or nibble ``j`` of two words moved into the halves of one register
(``prmt``, a shift for odd nibbles), its sign bit flipped and float16 1024.0's bits put above it (one
``lop3``: 1024 + 2^(bits-1) + code exactly), and that constant subtracted (one ``sub.f16x2``): two exact
codes as float16 in three or four instructions, none gathered a byte at a time from shared memory. (bf16's
8-bit significand cannot hold 256 codes above a constant; float16's 11 bits can.) :func:`channel_tile`
interleaves the lanes back into channel order (last-dim joins), so the dots see the head dim as stored.

Interpret mode and the tests compute the same bit patterns with jnp (:func:`lane_values`); a PTX emulator
checks the assembly against them bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import interleave_pairs

LANES = {8: 4, 4: 8}  # codes per 32-bit word
_WIDTH = {8: 8, 4: 4}  # bits per code
_SIGN = {8: 0x80, 4: 0x8}  # flips a two's complement code to offset binary (code + 2^(bits-1))
# float16 bits of 1024 + 2^(bits-1): OR-ed above an offset-binary code u (< 1024) it is 1024 + u exactly, and
# the same constant subtracted leaves the code
_MAGIC = {bits: 0x6400 | sign for bits, sign in _SIGN.items()}


def as_words(codes, bits: int):
    """``[..., D / per-byte]`` int8 / uint8 codes -> ``[..., D / LANES[bits]]`` int32 words (a bitcast)."""
    *lead, n = codes.shape
    return jax.lax.bitcast_convert_type(codes.reshape(*lead, n // 4, 4), jnp.int32)


def lane_values(words, j: int, bits: int):
    """Lane ``j`` of every word as its exact float16 code, by the bit patterns of :func:`lane_asm` (jnp)."""
    width = _WIDTH[bits]
    offset = ((words >> (width * j)) & ((1 << width) - 1)) ^ _SIGN[bits]
    magic = _MAGIC[bits]
    above = jax.lax.bitcast_convert_type((offset | (magic & ~_SIGN[bits])).astype(jnp.int16), jnp.float16)
    return above - jax.lax.bitcast_convert_type(jnp.int16(magic), jnp.float16)


def lane_asm(j: int, bits: int) -> str:
    """PTX for :func:`lane_values` on two words at once ($1, $2 -> one register of two float16, $0)."""
    width = _WIDTH[bits]
    byte, shift = divmod(j * width, 8)
    select = byte | ((4 + byte) << 8)  # d.b0 = $1.b[byte], d.b2 = $2.b[byte] (d.b1, d.b3: masked off below)
    mask = (1 << width) - 1
    pair = _MAGIC[bits] << 16 | _MAGIC[bits]
    return ("{\n.reg .b32 t, m;\n"
            f"prmt.b32 t, $1, $2, {select:#06x};\n"
            + (f"shr.b32 t, t, {shift};\n" if shift else "")
            # (t & mask) ^ magic per half: the code with its sign bit flipped, under 1024.0 (LUT of (a & b) ^ c)
            + f"lop3.b32 t, t, {mask << 16 | mask:#010x}, {pair:#010x}, 0x6A;\n"
            f"mov.b32 m, {pair:#010x};\n"
            "sub.f16x2 $0, t, m;\n}")


def lanes(words, bits: int, interpret: bool) -> list:
    """Every lane of a word tile as float16 operands: inline PTX on a GPU, :func:`lane_values` in interpret mode."""
    if interpret:
        return [lane_values(words, j, bits) for j in range(LANES[bits])]
    out = jax.ShapeDtypeStruct(words.shape, jnp.float16)
    return [plgpu.elementwise_inline_asm(lane_asm(j, bits), args=[words], constraints="=r,r,r", pack=2,
                                         result_shape_dtypes=[out])[0] for j in range(LANES[bits])]


def channel_tile(words, bits: int, interpret: bool):
    """A (rows, D / P) word tile -> its (rows, D) float16 codes in channel order: the lanes interleaved by a
    tree of last-dim joins (lane j = channel P w + j; the last join sets the lowest bit of the channel)."""
    parts = lanes(words, bits, interpret)
    while len(parts) > 1:
        half = len(parts) // 2
        parts = [interleave_pairs(parts[i], parts[i + half]) for i in range(half)]
    return parts[0]


__all__ = ["LANES", "as_words", "channel_tile", "lane_asm", "lane_values", "lanes"]
