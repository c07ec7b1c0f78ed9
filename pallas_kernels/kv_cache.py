"""Decode attention over the quantized KV cache's store (``llmeq_jax.kv.cache.QuantKVCache``).

The store, ``[B, H_kv, T, D]`` with codes packed along head_dim:
  int8    int8 ``[B, H_kv, T, D]``
  int4    uint8 ``[B, H_kv, T, D/2]``, byte = (v[2i] & 0xF) | ((v[2i+1] & 0xF) << 4)
          (the core's ``qarray.pack`` order)
keys per channel (KVQuant: one grid per head and dim, over tokens), values per
token (one grid per head and token, over dims); asymmetric grids, value =
(code - qmin) * scale + lo, float16 per-token value grids, keys optionally stored
before RoPE. The cache's float attention sinks can enter the kernel's softmax (``sinks=``: split 0 starts
from them); its float window stays outside: the kernel returns the log-sum-exp of its scores so the cache
merges the two.

``store_decode_attention`` runs one query token per head (GQA: H_q = G * H_kv), dequantizing
inside the kernel by folding the grids: q . (c * s_k + o_k) = (q * s_k) . c + q . o_k,
and p . (c * s_v + o_v) = (p * s_v) . c + sum(p * o_v). Pre-RoPE keys cannot be
folded (the rotation depends on the slot): they are dequantized and rotated per tile.
A bfloat16/float16 query over post-RoPE keys (head_dim / lanes >= 16) reads the codes as 32-bit words
instead of bytes (``kv_words``: the store bitcast, each tile's codes made exact float16 operands by inline
PTX, the float side scaled into float16's range by powers of two): no byte gathered from shared memory,
1.5 instructions per code to convert. Float32 queries keep exact three-part bf16 dots over the bytes.
The tokens are split into ranges, one program each (flash decoding), so that a
long cache with few heads still fills the GPU; the partial results are merged
by a small jnp step.

(A symmetric int8/int4 cache with its own append kernel, ``kv_append`` / ``decode_attention``,
lived here until nothing in the package used it; the ``_Layout`` fields ``shift``/``v_lo``
still describe both grids.)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from llmeq_jax.core.qarray import int_range, unpack
from llmeq_jax.core.rope import apply_rope, reduced_angle
from llmeq_jax.kv.grid import dequantize_grid
from pallas_kernels import config, hardware_checked, kv_words, offsets
from pallas_kernels.common import (
    FLOAT_DTYPES,
    MIN_DOT,
    TARGET_PROGRAMS,
    TINY,
    cdiv,
    check_int_scalar,
    compiler_params,
    f32_dot_precision,
    fit_splits,
    high_nibble,
    interleave_pairs,
    is_pow2,
    low_nibble,
    next_pow2,
    span,
    split_pairs,
)
from jax.experimental.pallas import triton as plgpu
from pallas_kernels.split_merge import NEG_INF, merge_splits, sink_carry
from pallas_kernels.weight_only import dequant_int4_asm, int4_offset

SUPPORTED_BITS = (4, 8)


def min_head_dim(bits: int) -> int:
    """int4 dots run on half the head dim (even/odd nibbles), and dot dims must be >= 16.

    Seen on an H100 (jax 0.11.2): int4 decode with head_dim 16 (8-wide dots) compiled and
    ran but returned wrong values (error ~2e-2 of the output's scale); interpret mode was exact.
    """
    return MIN_DOT * (2 if bits == 4 else 1)


def _qmax(bits):
    return float(2 ** (bits - 1) - 1)


def _rows_at(ref, b, h, rows, mask_rows, other=0):
    """Masked load of rows ``rows`` (a pl.ds) of ref[b, h] -> (size, last dim)."""
    return plgpu.load(ref.at[b, h, rows, :], mask=mask_rows[:, None], other=other)


def _check_cache(k_cache, v_cache, v_scale, bits, d):
    """Shapes and dtypes of one layer's store (``jax.ShapeDtypeStruct``s or arrays)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"KV cache: bits={bits} is not supported; expected one of {SUPPORTED_BITS}")
    stored_d, dtype = (d, jnp.int8) if bits == 8 else (d // 2, jnp.uint8)
    bsz, h, t = k_cache.shape[:3]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.shape != (bsz, h, t, stored_d) or c.dtype != dtype:
            raise ValueError(
                f"KV cache: {name} must be {jnp.dtype(dtype).name} {(bsz, h, t, stored_d)} for int{bits}, "
                f"head_dim {d}; got {c.dtype} {c.shape}"
            )
    if v_scale.shape != (bsz, h, t, 1):
        raise ValueError(f"KV cache: v_scale must be {(bsz, h, t, 1)}, got {v_scale.shape}")
    if not (is_pow2(d) and d >= min_head_dim(bits)):
        raise ValueError(f"KV cache kernels need a power-of-two head_dim >= {min_head_dim(bits)} for int{bits}, got {d}")


def check_key_grid(k_scale, k_lo, bsz, h, d, layers: int | None = None, name: str = "store_decode_attention"):
    """The key grid's scale and lo: one layer's (1 or B, H, 1, D), or with ``layers`` (a stacked store's) every
    layer's too, the two alike; else one clear error (naming the function ``name`` where they differ)."""
    if k_lo.shape != k_scale.shape:
        raise ValueError(f"{name}: k_lo {k_lo.shape} differs from k_scale {k_scale.shape}")
    grid = k_scale.shape[1:] if layers is not None and k_scale.ndim == 5 and k_scale.shape[0] == layers \
        else k_scale.shape
    if len(grid) != 4 or grid[0] not in (1, bsz) or grid[1:] != (h, 1, d):
        every = f" (or every layer's ({layers}, 1 or {bsz}, {h}, 1, {d}))" if layers is not None else ""
        raise ValueError(f"KV cache: k_scale must be (1 or {bsz}, {h}, 1, {d}){every}, got {k_scale.shape}")


def _one_layer(name, stores, layer):
    """Check the ``layer=`` form (every store a stack [L, ...] of one length, ``layer`` an integer scalar) and
    return one layer's shapes, for the checks that follow (nothing is sliced: the kernel reads the stack)."""
    if layer is None:
        return stores
    if len({a.shape[0] if a.ndim else None for a in stores}) != 1 or any(a.ndim < 2 for a in stores):
        raise ValueError(f"{name}: with layer=, k_codes, v_codes, v_scale and v_lo must be stacks [L, ...] of one "
                         f"length, got {[tuple(a.shape) for a in stores]}")
    check_int_scalar(name, "layer", layer)
    return [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in stores]


# --------------------------------------------------------------------------- decode attention


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What the decode kernel reads (static: part of the compiled kernel).

    bits:   4 or 8 (codes packed along head_dim as in the module docstring).
    shift:  codes are stored minus this: dequantized = (code - shift) * scale + lo
            (0 for the symmetric cache, the signed qmin for the asymmetric store).
    v_lo:   values carry a per-token minimum ``lo`` (asymmetric grid).
    masked: an ``allowed`` [B, T] mask says which slots the query reads.
    rope:   keys are stored before RoPE; the kernel rotates each by its slot's position.
    stacked: codes and value grids are every layer's stack [L, ...]; the first ref is the layer index.
    sinks:  float keys / values of this many extra tokens (the cache's attention sinks, keys post-RoPE) enter
            split 0's softmax as its starting carry, with a [B, sinks] mask of the ones the query sees.
    words:  the codes come as int32 words and the query side lane-major (``kv_words``): float16 operands
            made from 32-bit loads, one dot per lane (half-precision queries, post-RoPE keys).
    grid_stacked: the key grid is every layer's [L, 1 or B, H, 1, D], read at the layer index (``stacked``).
    """

    bits: int
    shift: int = 0
    v_lo: bool = False
    masked: bool = False
    rope: bool = False
    stacked: bool = False
    words: bool = False
    sinks: int = 0
    grid_stacked: bool = False

    @property
    def halves(self) -> int:
        # RoPE pairs channel i with i + D/2: the kernel reads the two halves as separate tiles.
        return 2 if self.rope else 1


def _lanes(x, bits):
    """Float tile (rows, channels) -> the channel groups the packed codes split into."""
    return list(split_pairs(x)) if bits == 4 else [x]


def _code_lanes(c, bits):
    """Stored code tile -> int32 codes per channel group (even/odd nibbles for int4)."""
    c = c.astype(jnp.int32)
    return [low_nibble(c), high_nibble(c)] if bits == 4 else [c]


# What each int4 dot operand carries: the codes become bf16 by bit patterns (weight_only's "fold":
# code + 136, no int -> float conversion; converting compiled to I2F, at a quarter of the float rate,
# two per stored byte -- scripts/kernel_sass.py), and the 136 comes off through sums of the float side.
# On a GPU the bit patterns come from weight_only's inline PTX (dequant="asm": two nibbles per lop3; the
# 32K decode loop compiled for sm_90 went from 1752 to 1387 instructions); interpret mode runs "fold".
# Float32 queries (three bf16 parts) take the offset off every code before the dot instead (exact in bf16):
# carried through, it makes the float32 accumulators ~20x larger than the attention they hold -- the suspected
# cause of the two int4 float32 cases that missed the 1e-5 tolerance by 2.3x on an H200 with exact scores
# (docs/kernels.md; not re-run on a GPU since).
INT4_FOLD = int4_offset(jnp.bfloat16)


def _int4_fold(bits: int, parts: int) -> float:
    """The offset the int4 dot operands still carry (see INT4_FOLD): none for float32 queries or int8."""
    return INT4_FOLD if bits == 4 and parts == 1 else 0.0


def _code_operands(c, bits, interpreted: bool, fold: float):
    """Stored code tile -> the bf16 dot operands per channel group (int4: each code + ``fold``, which is
    INT4_FOLD or 0)."""
    if bits == 4:
        ops = dequant_int4_asm(c, jnp.bfloat16, interpreted)  # code + INT4_FOLD
        return list(ops) if fold else [o - jnp.asarray(INT4_FOLD, jnp.bfloat16) for o in ops]
    return [c.astype(jnp.int32).astype(jnp.bfloat16)]


def _parts_sum(parts, axis):
    """The float32 sum along ``axis`` of the values the bf16 parts add up to (what the dots multiplied)."""
    return sum(jnp.sum(p.astype(jnp.float32), axis=axis, keepdims=True) for p in parts)


# Float32 x cached integers as bf16 tensor-core dots that lose nothing: the integers
# (|v| <= 255) are exact in bf16, and the float side is split into three bf16 parts
# whose sum is the float32 value (8 + 8 + 8 significant bits), one dot per part.
# (TF32x3 was as exact but 3-8x slower here: it also splits the integer side, every block.)
# A bf16/f16 query's attention needs no more than bf16 operands (what a bf16 model's own attention
# multiplies): one part, a third of the dots.
def _bf16_parts(a, parts: int = 3):
    hi = a.astype(jnp.bfloat16)
    if parts == 1:
        return (hi,)
    r = a - hi.astype(jnp.float32)
    mid = r.astype(jnp.bfloat16)
    return hi, mid, (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)


def _parts_dot(a_parts, c, contract):
    c = c.astype(jnp.bfloat16)
    return sum(jax.lax.dot_general(p, c, ((contract[0], contract[1]), ((), ())), preferred_element_type=jnp.float32)
               for p in a_parts)


def _pow2_scale(amax):
    """(the power of two that takes a largest magnitude ``amax`` to [2^14, 2^15), its inverse): float16
    operands scaled by it keep their 11 significant bits whatever the scale of the attention (scaling by a
    power of two and back is exact)."""
    e = jnp.clip(jnp.floor(jnp.log2(jnp.maximum(amax, TINY))), -100.0, 100.0)
    return jnp.exp2(14.0 - e), jnp.exp2(e - 14.0)


def _half_dot(a, c, contract):
    """float16 x float16 -> float32 dot (the word path's operands)."""
    return jax.lax.dot_general(a, c, (contract, ((), ())), preferred_element_type=jnp.float32)


# RoPE angles reach pos * freq ~ 3e4 rad at long contexts. jnp.cos / jnp.sin compile to libdevice's accurate
# cosf / sinf, whose slow path for large arguments (Payne-Hanek reduction over a table in local memory) made
# XLA's Triton build the pre-RoPE loop as 47751 instructions at 32 registers with 33 KB of spills
# (scripts/gpu_aot.py --sass, jax 0.11.2). The angle is reduced to [-pi, pi] first (core.rope.reduced_angle) and
# the GPU's cos.approx / sin.approx (absolute error ~5e-7 there) take the rest for bf16/f16 queries. Float32
# queries keep the accurate cos / sin of the reduced angle: their path promises float32 attention (1e-5 of the
# largest output), and ~5e-7 per rotated key lane is a tenth of that budget before the dots add up 64-128 of them.


def _cos_sin(angle, approx: bool):
    """(cos, sin) of float32 angles: reduced, then the GPU's approximate instructions (``approx``) or jnp's."""
    r = reduced_angle(angle)
    if not approx:
        return jnp.cos(r), jnp.sin(r)
    out = jax.ShapeDtypeStruct(r.shape, jnp.float32)
    return tuple(plgpu.elementwise_inline_asm(f"{op}.approx.ftz.f32 $0, $1;", args=[r], constraints="=f,f", pack=1,
                                              result_shape_dtypes=[out])[0] for op in ("cos", "sin"))


_NT = ((1,), (1,))  # a (m, k) . c (n, k)^T
_NN = ((1,), (0,))  # a (m, k) . c (k, n)


def _decode_kernel(*refs, lay: _Layout, g, bg, bt, d, sm_scale, split_blocks, precision, parts, interpreted):
    """One (batch, kv head, split of the tokens): unnormalised partial attention + its max and sum."""
    refs = list(refs)
    # A stacked store ([L, ...] codes and value grids): this layer of it, read in place.
    at = (refs.pop(0)[0],) if lay.stacked else ()
    q_ref, k_ref, v_ref, ks_ref, kl_ref, vs_ref = refs[:6]  # the key grid: scale and minimum
    rest = refs[6:]
    vlo_ref = rest.pop(0) if lay.v_lo else None
    allow_ref = rest.pop(0) if lay.masked else None
    pos_ref, freq_ref = (rest.pop(0), rest.pop(0)) if lay.rope else (None, None)
    sink_refs = (rest.pop(0), rest.pop(0), rest.pop(0)) if lay.sinks else None
    len_ref, o_ref, m_ref, l_ref = rest

    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bits, halves = lay.bits, lay.halves
    fold = _int4_fold(bits, parts)
    dh = d // halves  # channels per half
    bh = dh // 2 if bits == 4 else dh  # stored bytes per half
    heads, head_mask = span(0, bg, g)
    # clipped here, not by XLA (a launch of its own every layer); one length for all rows or one a row
    length = jnp.clip(len_ref[b if len_ref.shape[0] > 1 else 0], 0, k_ref.shape[-2])

    def half(i, width):  # columns of half i
        return pl.ds(i * width, width)

    # The key grid's row: [(L,) 1 or B, H, 1, D], per row or one for all (indexed here: a broadcast and a layer's
    # slice were launches of their own every layer).
    grid_at = (*(at if lay.grid_stacked else ()), b if ks_ref.shape[-4] > 1 else jnp.int32(0), h, pl.ds(0, 1))

    def key_grid(cols=slice(None)):
        """(scale, offset) of the key grid's columns: dequantized = code * scale + offset, where the offset is
        ``lo - shift * scale`` (the codes are stored minus ``shift``)."""
        scale = plgpu.load(ks_ref.at[(*grid_at, cols)])
        return scale, plgpu.load(kl_ref.at[(*grid_at, cols)]) - float(lay.shift) * scale

    if lay.words:
        qw = plgpu.load(q_ref.at[b, h, heads, :], mask=head_mask[:, None], other=0.0).astype(jnp.float32) * sm_scale
        # q . (c * s + o) = (q * s) . c + q . o, the first as float16 operands scaled into float16's range
        grid_scale, grid_off = key_grid()
        qf = qw * grid_scale
        q_const = jnp.sum(qw * grid_off, axis=1, keepdims=True)
        q_scale, q_unscale = _pow2_scale(jnp.max(jnp.abs(qf), axis=1, keepdims=True))  # per query row
        q_half = (qf * q_scale).astype(jnp.float16)
    else:
        # Per half: the query (scaled) and the per-channel key grid, split like the codes.
        q = [_lanes(plgpu.load(q_ref.at[b, h, heads, half(i, dh)], mask=head_mask[:, None], other=0.0)
                    .astype(jnp.float32) * sm_scale, bits) for i in range(halves)]
        grids = [key_grid(half(i, dh)) for i in range(halves)]
        k_scale = [_lanes(scale, bits) for scale, _ in grids]
        k_off = [_lanes(off, bits) for _, off in grids]
        lanes = range(len(q[0]))
        if lay.rope:
            freq = _lanes(freq_ref[...].reshape(1, dh), bits)  # the same frequencies for both halves
        else:
            # Fold the key grid into the query: q . (c * s + o) = (q * s) . c + q . o
            q_folded = [_bf16_parts(q[0][j] * k_scale[0][j], parts) for j in lanes]
            q_const = sum(jnp.sum(q[0][j] * k_off[0][j], axis=1, keepdims=True) for j in lanes)  # (bg, 1)
            if fold:  # the codes' fold offset, times the query side the dots multiply it by
                q_const = q_const - fold * sum(_parts_sum(q_folded[j], 1) for j in lanes)

    def scores(toks, tok_mask):
        if lay.words:
            words = plgpu.load(k_ref.at[(*at, b, h, toks, slice(None))], mask=tok_mask[:, None], other=0)
            return _half_dot(q_half, kv_words.channel_tile(words, bits, interpreted), _NT) * q_unscale + q_const
        stored = [plgpu.load(k_ref.at[(*at, b, h, toks, half(i, bh))], mask=tok_mask[:, None], other=0)
                  for i in range(halves)]
        if not lay.rope:
            codes = _code_operands(stored[0], bits, interpreted, fold)
            return sum(_parts_dot(q_folded[j], codes[j], _NT) for j in lanes) + q_const
        codes = [_code_lanes(c, bits) for c in stored]
        # Dequantize, rotate by the slot's position (rotate-half RoPE), then a float dot.
        # (read here, not a block ahead: carried, the positions pushed the 255-register rotation loop into
        # 218 local-memory loads)
        pos = plgpu.load(pos_ref.at[b, toks], mask=tok_mask, other=0).astype(jnp.float32).reshape(bt, 1)
        s = 0.0
        for j in lanes:
            k0 = codes[0][j].astype(jnp.float32) * k_scale[0][j] + k_off[0][j]
            k1 = codes[1][j].astype(jnp.float32) * k_scale[1][j] + k_off[1][j]
            cos, sin = _cos_sin(pos * freq[j], approx=parts == 1 and not interpreted)
            for qi, ki in ((q[0][j], k0 * cos - k1 * sin), (q[1][j], k1 * cos + k0 * sin)):
                if parts == 1:  # a bf16/f16 query: one bf16 dot (its own attention's operands), not TF32x3
                    qi, ki, prec = qi.astype(jnp.bfloat16), ki.astype(jnp.bfloat16), None
                else:
                    prec = precision
                s = s + jax.lax.dot_general(qi, ki, (_NT, ((), ())), precision=prec,
                                            preferred_element_type=jnp.float32)
        return s

    first = sp * split_blocks
    last = jnp.minimum(first + split_blocks, (length + bt - 1) // bt)

    # The per-token rows of block tb (allowed mask, value grid), read one block ahead
    # (carried through the loop): Triton's pipeliner stages only the loads that feed dots, and read where
    # they are used these were synchronous global loads in every iteration (sm_90 SASS: LDG.E.U16 between
    # the MMAs), each a memory latency per block that the cp.async pipeline of the codes did not hide.
    def token_rows(tb):
        """(allowed, value scale, value min) of block ``tb`` as stored (None where absent),
        ``tb`` clamped into the split (the block after its last is re-read, never used)."""
        toks, tok_mask = span(jnp.maximum(jnp.minimum(tb, last - 1), first) * bt, bt, length)
        rows = dict(mask=tok_mask[:, None], other=0)
        allowed = plgpu.load(allow_ref.at[b, toks], mask=tok_mask, other=0) if lay.masked else None
        v_scale = plgpu.load(vs_ref.at[(*at, b, h, toks, slice(None))], **rows)
        v_lo = plgpu.load(vlo_ref.at[(*at, b, h, toks, slice(None))], **rows) if lay.v_lo else None
        return allowed, v_scale, v_lo

    def body(tb, carry):
        m_prev, l_prev, acc, rows_now = carry
        rows_next = token_rows(tb + 1)
        allowed, v_scale, v_lo = rows_now
        toks, tok_mask = span(tb * bt, bt, length)
        ok = tok_mask if allowed is None else tok_mask & (allowed != 0)
        s = jnp.where(ok[None, :], scores(toks, tok_mask), NEG_INF)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(ok[None, :], jnp.exp(s - m_new), 0.0)  # a block with nothing allowed adds nothing
        corr = jnp.exp(m_prev - m_new)
        l_new = l_prev * corr + jnp.sum(p, axis=1, keepdims=True)
        v_scale = v_scale.astype(jnp.float32).reshape(1, bt)
        # p . (c * s_v + o_v) = (p * s_v) . c + sum(p * o_v): fold the per-token value grid into the weights.
        stored = plgpu.load(v_ref.at[(*at, b, h, toks, slice(None))], mask=tok_mask[:, None], other=0)
        if lay.words:
            # p <= 1: scaled by the tile's largest value scale, p * s_v fits float16 (a weight too small for
            # its normal range belongs to a tile far below the running maximum, and weighs nothing there)
            pv_scale, pv_unscale = _pow2_scale(jnp.max(v_scale))
            ph = (p * (v_scale * pv_scale)).astype(jnp.float16)
            upd = _half_dot(ph, kv_words.channel_tile(stored, bits, interpreted), _NN) * pv_unscale
        else:
            pv = _bf16_parts(p * v_scale, parts)
            parts_out = [_parts_dot(pv, c, _NN) for c in _code_operands(stored, bits, interpreted, fold)]
            upd = interleave_pairs(*parts_out) if bits == 4 else parts_out[0]
            if fold:  # the codes' fold offset, times the weights the dots multiplied it by
                upd = upd - fold * _parts_sum(pv, 1)
        if lay.shift or lay.v_lo:
            v_off = -float(lay.shift) * v_scale
            if lay.v_lo:
                v_off = v_off + v_lo.astype(jnp.float32).reshape(1, bt)
            upd = upd + jnp.sum(p * v_off, axis=1, keepdims=True)
        return m_new, l_new, acc * corr + upd, rows_next

    if lay.sinks:  # the float sinks as split 0's first block: one softmax with the store, nothing merged after
        m0, l0, acc0 = sink_carry(q_ref, *sink_refs, at=at, b=b, h=h, heads=heads, head_mask=head_mask,
                                  n=lay.sinks, first=sp == 0, sm_scale=sm_scale, precision=precision)
    else:
        m0, l0, acc0 = (jnp.full((bg, 1), NEG_INF, jnp.float32), jnp.zeros((bg, 1), jnp.float32),
                        jnp.zeros((bg, d), jnp.float32))
    init = (m0, l0, acc0, token_rows(first))
    # no iterations when the split is empty
    m_fin, l_fin, acc, _ = jax.lax.fori_loop(first, last, body, init)
    plgpu.store(o_ref.at[b, h, sp, heads, :], acc, mask=head_mask[:, None])
    plgpu.store(m_ref.at[b, h, sp, heads, :], m_fin, mask=head_mask[:, None])
    plgpu.store(l_ref.at[b, h, sp, heads, :], l_fin, mask=head_mask[:, None])


MIN_SPLIT_TOKENS = 256


def decode_splits(bsz: int, h: int, t: int, bt: int) -> int:
    """Token splits per (batch, kv head): enough programs to fill the GPU, each >= MIN_SPLIT_TOKENS long."""
    by_length = max(1, t // max(bt, MIN_SPLIT_TOKENS))
    return max(1, min(cdiv(TARGET_PROGRAMS, bsz * h), by_length))


def _decode(q, k_codes, v_codes, k_scale, k_lo, v_scale, extra, length, lay: _Layout, *, sm_scale, block_t,
            num_splits, num_warps, num_stages, interpret, layer=None, out_dtype=jnp.float32):
    """Run the kernel; -> (out [B, H_q, D] out_dtype, log-sum-exp of the scores [B, H_q])."""
    bsz, hq, d = q.shape
    h, t = k_codes.shape[-3], k_codes.shape[-2]
    if not (is_pow2(block_t) and block_t >= MIN_DOT):
        raise ValueError(f"decode_attention: block_t must be a power of two >= {MIN_DOT}, got {block_t}")
    g = hq // h
    bt = min(block_t, max(MIN_DOT, next_pow2(t)))
    splits, split_blocks = fit_splits(cdiv(t, bt), num_splits or decode_splits(bsz, h, t, bt))
    length = jnp.asarray(length, jnp.int32)
    if length.shape not in ((), (1,), (bsz,)):
        raise ValueError(f"decode_attention: length must be a scalar or [{bsz}], got shape {length.shape}")
    length = length.reshape(-1)  # (1,) for all rows (read as it is: a broadcast was a launch a layer) or (B,)
    interpret = config.resolve_interpret(interpret)
    kernel = functools.partial(
        _decode_kernel, lay=lay, g=g, bg=max(MIN_DOT, next_pow2(g)), bt=bt, d=d,
        sm_scale=float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)), split_blocks=split_blocks,
        precision=f32_dot_precision(interpret), parts=1 if jnp.dtype(q.dtype) != jnp.float32 else 3,
        interpreted=interpret,
    )
    part = jax.ShapeDtypeStruct((bsz, h, splits, g, d), jnp.float32)
    stat = jax.ShapeDtypeStruct((bsz, h, splits, g, 1), jnp.float32)
    at = () if layer is None else (jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),)
    if lay.words:  # the codes as int32 words: a bitcast
        k_codes, v_codes = kv_words.as_words(k_codes, lay.bits), kv_words.as_words(v_codes, lay.bits)
    offsets.check((k_codes, v_codes), "decode_attention")
    acc, m, l = pl.pallas_call(
        kernel,
        out_shape=(part, stat, stat),
        grid=(bsz, h, splits),
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=f"decode_attention_int{lay.bits}" + ("_rope" if lay.rope else ""),
    )(*at, q.reshape(bsz, h, g, d), k_codes, v_codes, k_scale, k_lo, v_scale, *extra, length)  # clipped inside
    # the splits merged in one kernel (XLA's merge was 3 launches for grouped queries, deviceless H100), once that
    # kernel passed its gpu cases on a GPU (pallas_kernels.hardware_checked); until then XLA's merge
    if hardware_checked.allowed("merge_splits"):
        out, lse = merge_splits(acc, m[..., 0], g, total=l[..., 0], out_dtype=out_dtype, interpret=interpret)
    else:
        out, lse = combine_splits(acc, m, l)
        out = out.astype(out_dtype)
    return out.reshape(bsz, hq, d), lse.reshape(bsz, hq)


def combine_splits(acc, m, l):
    """Flash decoding's last step: the splits' unnormalized sums ``acc`` [B, H, S, G, D] with their score maxima
    ``m`` and weight sums ``l`` [B, H, S, G, 1] -> (out [B, H, G, D], log-sum-exp [B, H, G]) over all splits.
    An empty split (m = NEG_INF, l = 0, acc = 0) weighs exp(NEG_INF - max) = 0."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)
    denom = jnp.maximum(jnp.sum(l * w, axis=2), TINY)
    return jnp.sum(acc * w, axis=2) / denom, (m_all[:, :, 0] + jnp.log(denom))[..., 0]


def _check_query(q, h, bsz):
    if q.ndim != 3 or jnp.dtype(q.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"decode_attention: q must be float [B, H_q, D], got {q.dtype} {q.shape}")
    if q.shape[0] != bsz or q.shape[1] % h:
        raise ValueError(f"decode_attention: q heads {q.shape[1]} must be a multiple of cache heads {h} (batch {bsz})")


def attention_reference(q, k, v, allowed, sm_scale):
    """Masked single-query attention in float32 -> (out [B, H_q, D], lse [B, H_q])."""
    bsz, hq, d = q.shape
    h = k.shape[1]
    qg = q.astype(jnp.float32).reshape(bsz, h, hq // h, d)
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, k) * (sm_scale if sm_scale is not None else 1.0 / math.sqrt(d))
    s = jnp.where(allowed[:, None, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    out = jnp.einsum("bhgt,bhtd->bhgd", jnp.exp(s - lse[..., None]), v)
    return out.reshape(bsz, hq, d), lse.reshape(bsz, hq)


# --------------------------------------------------------------------------- the quantized store of kv.cache


def store_decode_attention(
    q, k_codes, v_codes, k_scale, k_lo, v_scale, v_lo, length, *, bits: int, allowed=None, slot_pos=None,
    inv_freq=None, sinks=None, sm_scale: float | None = None, block_t: int = 128, num_splits: int | None = None,
    num_warps: int = 4, num_stages: int = 2, interpret: bool | None = None, layer=None, out_dtype=jnp.float32,
):
    """Single-query attention over ``llmeq_jax.kv.cache.QuantKVCache``'s store of one layer.

    The store holds asymmetric codes, ``(code - qmin) * scale + lo``, qmin the signed
    minimum of ``bits`` (codes packed along head_dim as in the module docstring):
      k_codes, v_codes  ``[B, H_kv, T, D / per-byte]`` int8 (8 bits) or uint8 (4 bits)
      k_scale, k_lo     per-channel key grid ``[B or 1, H_kv, 1, D]``
      v_scale, v_lo     per-token value grid ``[B, H_kv, T, 1]`` (float16 in the cache)
      allowed           optional ``[B, T]`` bool/int8: the slots this query reads (the
                        cache leaves out its float window and sinks); else all of ``0 .. length-1``
      slot_pos, inv_freq  keys stored before RoPE: ``[B, T]`` position of each slot and the
                        ``[D / 2]`` RoPE frequencies (rotate-half layout); the kernel
                        rotates the dequantized keys by them.
      sinks             optional ``(k, v, seen)``: float keys (post-RoPE) and values ``[B, H_kv, N, D]`` (with
                        ``layer``: stacks ``[L, B, H_kv, N, D]``) of N more tokens (the cache's attention sinks)
                        and ``[B, N]`` bool, the ones the query sees: attended in the same softmax as the store
                        (so the cache has nothing to merge after the kernel).
    ``length`` ``[B]`` or scalar: slots to scan (>= 0). Returns ``(out [B, H_q, D] out_dtype (float32),
    lse [B, H_q])``, lse the log-sum-exp of the scaled scores (about -1e30 when no slot is
    allowed), so a caller can merge this with attention over other (float) keys.

    ``layer`` (an integer scalar, may be traced): ``k_codes``, ``v_codes``, ``v_scale`` and ``v_lo`` are
    every layer's stack ``[L, ...]`` and layer ``layer`` is read in place -- what a decode step of the scan
    over stacked blocks passes, where slicing the layer out would copy its whole store for the kernel
    every step. The key grid is one layer's, ``[1 or B, H_kv, 1, D]``, or there every layer's, ``[L, 1 or B, H_kv,
    1, D]``, read at ``layer`` in place too (slicing it out was a launch of its own every layer).
    """
    d = q.shape[-1]
    stacked = layer is not None
    k_one, v_one, vs_one, vl_one = _one_layer("store_decode_attention", (k_codes, v_codes, v_scale, v_lo), layer)
    bsz, h, t = k_one.shape[:3]
    _check_cache(k_one, v_one, vs_one, bits, d)
    _check_query(q, h, bsz)
    layers = k_codes.shape[0] if stacked else None
    check_key_grid(k_scale, k_lo, bsz, h, d, layers)
    if vl_one.shape != vs_one.shape:
        raise ValueError(f"store_decode_attention: v_lo must be {vs_one.shape}, got {vl_one.shape}")
    rope = slot_pos is not None
    if rope != (inv_freq is not None):
        raise ValueError("store_decode_attention: pre-RoPE keys need both slot_pos and inv_freq")
    if rope and (slot_pos.shape != (bsz, t) or inv_freq.shape != (d // 2,)):
        raise ValueError(f"store_decode_attention: slot_pos must be {(bsz, t)} and inv_freq {(d // 2,)}, "
                         f"got {slot_pos.shape} and {inv_freq.shape}")
    ok, why = can_use(d, bits, q.dtype, rope=rope)
    if not ok:
        raise ValueError(f"store_decode_attention: {why}")
    if allowed is not None and allowed.shape != (bsz, t):
        raise ValueError(f"store_decode_attention: allowed must be {(bsz, t)}, got {allowed.shape}")
    shift, _ = int_range(bits)
    k_scale, k_lo = k_scale.astype(jnp.float32), k_lo.astype(jnp.float32)  # (c - qmin) * s + lo, in the kernel
    extra = [v_lo]
    if allowed is not None:  # as the caller has it (bool): a conversion here was a launch a layer on a GPU
        extra.append(allowed if allowed.dtype in (jnp.bool_, jnp.int8) else allowed.astype(bool))
    if rope:
        extra += [slot_pos.astype(jnp.int32), inv_freq.astype(jnp.float32).reshape(1, d // 2)]
    if sinks is not None:
        extra += check_sinks(sinks, (*k_codes.shape[:-2], d), bsz)
    lay = _Layout(bits, shift=shift, v_lo=True, masked=allowed is not None, rope=rope, stacked=stacked,
                  words=reads_words(d, bits, q.dtype, rope=rope), sinks=0 if sinks is None else sinks[0].shape[-2],
                  grid_stacked=k_scale.ndim == 5)
    return _decode(q, k_codes, v_codes, k_scale, k_lo, v_scale, tuple(extra), length, lay, sm_scale=sm_scale,
                   block_t=block_t, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                   interpret=interpret, layer=layer, out_dtype=out_dtype)


def check_sinks(sinks, lead, bsz, name: str = "store_decode_attention") -> list:
    """The ``sinks`` argument's three arrays as the kernels read them (the mask as bool), or one clear error naming
    the function ``name``."""
    k, v, seen = sinks
    if k.ndim != len(lead) + 1 or k.shape[:-2] != lead[:-1] or k.shape[-1] != lead[-1] or v.shape != k.shape \
            or jnp.dtype(k.dtype) not in FLOAT_DTYPES or seen.shape != (bsz, k.shape[-2]):
        want = f"k / v [{', '.join(map(str, lead[:-1]))}, N, {lead[-1]}] float and seen [{bsz}, N]"
        raise ValueError(f"{name}: sinks must be {want}, got {k.dtype} {k.shape} / {v.shape} / "
                         f"{seen.shape}")
    return [k, v, seen.astype(bool)]


def store_decode_attention_reference(q, k_codes, v_codes, k_scale, k_lo, v_scale, v_lo, length, *, bits: int,
                                     allowed=None, slot_pos=None, inv_freq=None, sinks=None, sm_scale=None,
                                     layer=None):
    """Pure-jnp reference of :func:`store_decode_attention`: dequantize, rotate, attend (with the sinks' float
    keys and values beside the store's)."""
    if layer is not None:
        k_codes, v_codes, v_scale, v_lo = (a[layer] for a in (k_codes, v_codes, v_scale, v_lo))
        sinks = None if sinks is None else (sinks[0][layer], sinks[1][layer], sinks[2])
        if jnp.ndim(k_scale) == 5:  # every layer's key grid
            k_scale, k_lo = k_scale[layer], k_lo[layer]
    d = q.shape[-1]
    bsz, t = k_codes.shape[0], k_codes.shape[2]
    k = dequantize_grid(unpack(k_codes, bits, -1, d), k_scale, k_lo, bits)
    v = dequantize_grid(unpack(v_codes, bits, -1, d), v_scale, v_lo, bits)
    if slot_pos is not None:
        k = apply_rope(k, slot_pos, inv_freq, heads_axis=1)
    ok = jnp.arange(t)[None, :] < jnp.broadcast_to(jnp.asarray(length), (bsz,))[:, None]
    if allowed is not None:
        ok = ok & allowed.astype(bool)
    if sinks is not None:
        k = jnp.concatenate([k, sinks[0].astype(jnp.float32)], axis=2)
        v = jnp.concatenate([v, sinks[1].astype(jnp.float32)], axis=2)
        ok = jnp.concatenate([ok, sinks[2].astype(bool)], axis=1)
    return attention_reference(q, k, v, ok, sm_scale)


def reads_words(head_dim: int, bits: int, dtype, *, rope: bool = False) -> bool:
    """Whether the decode kernel reads the store as 32-bit words (``kv_words``): float16 operands from
    32-bit loads, one dot per lane of ``head_dim / LANES`` channels. For bfloat16/float16 queries over
    post-RoPE keys, where each lane is a whole dot (>= 16 channels: int8 from head_dim 64, int4 from 128).
    Float32 queries keep the byte path's exact three-part bf16 dots; pre-RoPE keys are rotated in float32."""
    return (not rope and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and head_dim // kv_words.LANES[bits] >= MIN_DOT)


def can_use(head_dim: int, bits: int, dtype, *, rope: bool = False) -> tuple[bool, str]:
    """(True, "") when the KV kernels take this cache, else (False, why).

    ``rope``: keys stored before RoPE (only :func:`store_decode_attention` reads those;
    each half of the head dim is a dot of its own, so the minimum doubles).
    """
    if bits not in SUPPORTED_BITS:
        return False, f"int{bits} cache (kernels exist for {SUPPORTED_BITS})"
    least = min_head_dim(bits) * (2 if rope else 1)
    if not (is_pow2(head_dim) and head_dim >= least):
        return False, f"head_dim {head_dim} is not a power of two >= {least} (int{bits}{', pre-RoPE keys' if rope else ''})"
    if jnp.dtype(dtype) not in FLOAT_DTYPES:
        return False, f"dtype {jnp.dtype(dtype).name} is not float32/bfloat16/float16"
    return True, ""
