"""KV-cache kernels: quantize new K/V rows into an int8/int4 cache; decode attention over it.

Layout (shared with ``llmeq_jax/kvcache.py``): caches are ``[B, H_kv, T, D]``.
  keys    per channel (KVQuant): one scale per (batch|1, head, dim) over tokens,
          ``k_scale [B or 1, H_kv, 1, D]`` float32, calibrated (given, static)
  values  per token: one scale per (batch, head, token) over dims,
          ``v_scale [B, H_kv, T, 1]`` float32, computed when the row is written
  int8    caches are int8 ``[B, H_kv, T, D]``
  int4    caches are uint8 ``[B, H_kv, T, D/2]``, byte = (v[2i] & 0xF) | ((v[2i+1] & 0xF) << 4)
          (packed along head_dim, so appending a token touches whole bytes)
Symmetric grids, qmax = 2^(b-1) - 1, round half to even, as in the core.

``kv_append`` writes S new rows at token offset ``pos`` (aliased in place).
``decode_attention`` runs one query token per head (GQA: H_q = G * H_kv) over the
first ``length[b]`` cached tokens, dequantizing inside the kernel by folding the
scales: q . (k * s_k) = (q * s_k) . k, and p . (v * s_v) = (p * s_v) . v.
The tokens are split into ranges, one program each (flash decoding), so that a
long cache with few heads still fills the GPU; the partial results are merged
by a small jnp step.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import config
from pallas_kernels.common import (
    FLOAT_DTYPES,
    MIN_DOT,
    TARGET_PROGRAMS,
    TINY,
    cdiv,
    compiler_params,
    fit_splits,
    high_nibble,
    interleave_pairs,
    is_pow2,
    low_nibble,
    next_pow2,
    pack_nibbles,
    quantize_sym,
    span,
    split_pairs,
)
from jax.experimental.pallas import triton as plgpu

SUPPORTED_BITS = (4, 8)
NEG_INF = -1e30  # finite: a fully masked block must not produce inf - inf = nan


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


def _store_rows(ref, b, h, rows, mask_rows, value):
    plgpu.store(ref.at[b, h, rows, :], value, mask=mask_rows[:, None])


def _to_cache(q, bits):
    """int32 values (S, D) -> stored form: int8 (S, D) or packed uint8 (S, D/2)."""
    if bits == 8:
        return q.astype(jnp.int8)
    even, odd = split_pairs(q)
    return pack_nibbles(even, odd).astype(jnp.uint8)


# --------------------------------------------------------------------------- append


def _append_kernel(kn_ref, vn_ref, ks_ref, pos_ref, _k_in, _v_in, _vs_in, k_ref, v_ref, vs_ref, *, s, t, bs, bits):
    b, h = pl.program_id(0), pl.program_id(1)
    qmax = _qmax(bits)
    pos = pos_ref[0]
    new_rows, new_mask = span(0, bs, s)
    dst_idx = pos + jax.lax.broadcasted_iota(jnp.int32, (bs,), 0)
    dst = pl.ds(pos, bs)
    dst_mask = new_mask & (dst_idx < t)  # never write past the cache end
    k_scale = plgpu.load(ks_ref.at[b, h, pl.ds(0, 1), :]).astype(jnp.float32)  # (1, D)
    k = _rows_at(kn_ref, b, h, new_rows, new_mask).astype(jnp.float32)
    _store_rows(k_ref, b, h, dst, dst_mask, _to_cache(quantize_sym(k, k_scale, qmax), bits))
    v = _rows_at(vn_ref, b, h, new_rows, new_mask).astype(jnp.float32)
    v_scale = jnp.maximum(jnp.max(jnp.abs(v), axis=1, keepdims=True), TINY) / qmax  # (bs, 1)
    _store_rows(v_ref, b, h, dst, dst_mask, _to_cache(quantize_sym(v, v_scale, qmax), bits))
    _store_rows(vs_ref, b, h, dst, dst_mask, v_scale)


def _check_cache(k_cache, v_cache, v_scale, bits, d):
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


def _check_k_scale(k_scale, bsz, h, d):
    if k_scale.ndim != 4 or k_scale.shape[0] not in (1, bsz) or k_scale.shape[1:] != (h, 1, d):
        raise ValueError(f"KV cache: k_scale must be (1 or {bsz}, {h}, 1, {d}), got {k_scale.shape}")


def _batched(k_scale, bsz):
    # A tiny [B, H, 1, D] copy, so the kernel always indexes it by program id.
    return jnp.broadcast_to(k_scale.astype(jnp.float32), (bsz, *k_scale.shape[1:]))


def kv_append(k_cache, v_cache, v_scale, k_new, v_new, k_scale, pos, *, bits: int, interpret: bool | None = None):
    """Quantize ``k_new``/``v_new`` ``[B, H_kv, S, D]`` and write them at token ``pos``.

    Returns the updated ``(k_cache, v_cache, v_scale)`` (the inputs' buffers, aliased).
    Rows that would fall past the end of the cache are dropped.
    """
    bsz, h, s, d = k_new.shape
    if v_new.shape != k_new.shape or jnp.dtype(k_new.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"kv_append: k_new/v_new must be float [B, H, S, D] of one shape, got {k_new.shape}, {v_new.shape}")
    _check_cache(k_cache, v_cache, v_scale, bits, d)
    if k_cache.shape[:2] != (bsz, h):
        raise ValueError(f"kv_append: cache is for (B, H) = {k_cache.shape[:2]}, new rows are for {(bsz, h)}")
    _check_k_scale(k_scale, bsz, h, d)
    t = k_cache.shape[2]
    kernel = functools.partial(
_append_kernel, s=s, t=t, bs=next_pow2(s), bits=bits)
    pos = jnp.asarray(pos, jnp.int32).reshape(1)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
            jax.ShapeDtypeStruct(v_scale.shape, jnp.float32),
        ),
        grid=(bsz, h),
        input_output_aliases={4: 0, 5: 1, 6: 2},
        compiler_params=compiler_params(),
        interpret=config.resolve_interpret(interpret),
        name=f"kv_append_int{bits}",
    )(k_new, v_new, _batched(k_scale, bsz), pos, k_cache, v_cache, v_scale.astype(jnp.float32))


def kv_append_reference(k_cache, v_cache, v_scale, k_new, v_new, k_scale, pos, *, bits: int):
    """Pure-jnp reference of :func:`kv_append` (``pos`` static here)."""
    qmax = _qmax(bits)
    t = k_cache.shape[2]
    keep = max(0, min(k_new.shape[2], t - pos))
    kq = jnp.clip(jnp.round(k_new.astype(jnp.float32) / k_scale), -qmax, qmax).astype(jnp.int32)
    vf = v_new.astype(jnp.float32)
    vs = jnp.maximum(jnp.max(jnp.abs(vf), axis=-1, keepdims=True), TINY) / qmax
    vq = jnp.clip(jnp.round(vf / vs), -qmax, qmax).astype(jnp.int32)

    def stored(q):
        if bits == 8:
            return q.astype(jnp.int8)
        return ((q[..., 0::2] & 15) | ((q[..., 1::2] & 15) << 4)).astype(jnp.uint8)

    def put(cache, rows):
        return cache.at[:, :, pos : pos + keep].set(rows[:, :, :keep].astype(cache.dtype))

    return put(k_cache, stored(kq)), put(v_cache, stored(vq)), put(v_scale, vs)


def dequantize_cache(cache, scale, bits: int):
    """Float32 ``[B, H, T, D]`` view of a quantized cache (scale broadcasts: per channel or per token)."""
    if bits == 8:
        q = cache.astype(jnp.float32)
    else:
        b = cache.astype(jnp.int32)
        q = jnp.stack([low_nibble(b), high_nibble(b)], axis=-1).reshape(*cache.shape[:-1], -1).astype(jnp.float32)
    return q * scale


# --------------------------------------------------------------------------- decode attention


def _decode_kernel(q_ref, k_ref, v_ref, ks_ref, vs_ref, len_ref, o_ref, m_ref, l_ref, *, g, bg, bt, d, bits, sm_scale,
                   split_blocks):
    """One (batch, kv head, split of the tokens): unnormalised partial attention + its max and sum."""
    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads, head_mask = span(0, bg, g)
    q = _rows_at(q_ref, b, h, heads, head_mask).astype(jnp.float32)  # (bg, D)
    q = q * plgpu.load(ks_ref.at[b, h, pl.ds(0, 1), :]) * sm_scale  # fold the per-channel key scale
    length = len_ref[b]

    # Float32 x cached integers as bf16 tensor-core dots that lose nothing: the integers
    # (|v| <= 127) are exact in bf16, and the float side is split into three bf16 parts
    # whose sum is the float32 value (8 + 8 + 8 significant bits), one dot per part.
    # (TF32x3 was as exact but 3-8x slower here: it also splits the integer side, every block.)
    def parts(a):
        hi = a.astype(jnp.bfloat16)
        r = a - hi.astype(jnp.float32)
        mid = r.astype(jnp.bfloat16)
        return hi, mid, (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)

    def dot_t(a_parts, c):  # a (m, k) . c (n, k)^T
        c = c.astype(jnp.bfloat16)
        return sum(jax.lax.dot_general(p, c, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                   for p in a_parts)

    def dot(a_parts, c):
        c = c.astype(jnp.bfloat16)
        return sum(jax.lax.dot_general(p, c, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
                   for p in a_parts)

    if bits == 8:
        q_parts = parts(q)
    else:
        q_even, q_odd = split_pairs(q)
        q_even, q_odd = parts(q_even), parts(q_odd)

    def body(tb, carry):
        m_prev, l_prev, acc = carry
        toks, tok_mask = span(tb * bt, bt, length)
        kt = _rows_at(k_ref, b, h, toks, tok_mask).astype(jnp.int32)
        vt = _rows_at(v_ref, b, h, toks, tok_mask).astype(jnp.int32)
        if bits == 8:
            s = dot_t(q_parts, kt)
        else:
            s = dot_t(q_even, low_nibble(kt)) + dot_t(q_odd, high_nibble(kt))
        s = jnp.where(tok_mask[None, :], s, NEG_INF)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        corr = jnp.exp(m_prev - m_new)
        l_new = l_prev * corr + jnp.sum(p, axis=1, keepdims=True)
        v_scale = plgpu.load(vs_ref.at[b, h, toks, :], mask=tok_mask[:, None], other=0.0)  # (bt, 1)
        pv = parts(p * v_scale.reshape(1, bt))  # fold the per-token value scale into the weights
        if bits == 8:
            upd = dot(pv, vt)
        else:
            upd = interleave_pairs(dot(pv, low_nibble(vt)), dot(pv, high_nibble(vt)))
        return m_new, l_new, acc * corr + upd

    init = (jnp.full((bg, 1), NEG_INF, jnp.float32), jnp.zeros((bg, 1), jnp.float32), jnp.zeros((bg, d), jnp.float32))
    first = sp * split_blocks
    last = jnp.minimum(first + split_blocks, (length + bt - 1) // bt)
    m_fin, l_fin, acc = jax.lax.fori_loop(first, last, body, init)  # no iterations when the split is empty
    plgpu.store(o_ref.at[b, h, sp, heads, :], acc, mask=head_mask[:, None])
    plgpu.store(m_ref.at[b, h, sp, heads, :], m_fin, mask=head_mask[:, None])
    plgpu.store(l_ref.at[b, h, sp, heads, :], l_fin, mask=head_mask[:, None])


MIN_SPLIT_TOKENS = 256


def decode_splits(bsz: int, h: int, t: int, bt: int) -> int:
    """Token splits per (batch, kv head): enough programs to fill the GPU, each >= MIN_SPLIT_TOKENS long."""
    by_length = max(1, t // max(bt, MIN_SPLIT_TOKENS))
    return max(1, min(cdiv(TARGET_PROGRAMS, bsz * h), by_length))


def decode_attention(
    q, k_cache, v_cache, k_scale, v_scale, length, *, bits: int, sm_scale: float | None = None,
    block_t: int = 128, num_splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
    interpret: bool | None = None,
):
    """Single-query attention over a quantized cache (split-T "flash decoding").

    q ``[B, H_q, D]`` float, caches as in the module docstring, ``length`` int32 ``[B]``
    (valid tokens per sequence, >= 1). Returns ``[B, H_q, D]`` in q's dtype.

    The cached tokens are cut into ``num_splits`` ranges (default :func:`decode_splits`),
    one program each per (batch, kv head); each returns its unnormalised sum with its
    running max and denominator, and a small jnp step rescales and adds them.
    """
    if q.ndim != 3 or jnp.dtype(q.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"decode_attention: q must be float [B, H_q, D], got {q.dtype} {q.shape}")
    bsz, hq, d = q.shape
    _check_cache(k_cache, v_cache, v_scale, bits, d)
    h, t = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[0] != bsz or hq % h:
        raise ValueError(f"decode_attention: q heads {hq} must be a multiple of cache heads {h} (batch {bsz})")
    _check_k_scale(k_scale, bsz, h, d)
    if not (is_pow2(block_t) and block_t >= MIN_DOT):
        raise ValueError(f"decode_attention: block_t must be a power of two >= {MIN_DOT}, got {block_t}")
    g = hq // h
    bt = min(block_t, max(MIN_DOT, next_pow2(t)))
    n_blocks = cdiv(t, bt)
    splits, split_blocks = fit_splits(n_blocks, num_splits or decode_splits(bsz, h, t, bt))
    length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), (bsz,))
    interpret = config.resolve_interpret(interpret)
    kernel = functools.partial(
        _decode_kernel, g=g, bg=max(MIN_DOT, next_pow2(g)), bt=bt, d=d, bits=bits,
        sm_scale=float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)), split_blocks=split_blocks,
    )
    part = jax.ShapeDtypeStruct((bsz, h, splits, g, d), jnp.float32)
    stat = jax.ShapeDtypeStruct((bsz, h, splits, g, 1), jnp.float32)
    acc, m, l = pl.pallas_call(
        kernel,
        out_shape=(part, stat, stat),
        grid=(bsz, h, splits),
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=f"decode_attention_int{bits}",
    )(q.reshape(bsz, h, g, d), k_cache, v_cache, _batched(k_scale, bsz), v_scale.astype(jnp.float32),
      jnp.minimum(length, t))
    # Combine the splits: an empty split has m = NEG_INF, l = 0, acc = 0 and weighs exp(NEG_INF - max) = 0.
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)
    out = jnp.sum(acc * w, axis=2) / jnp.maximum(jnp.sum(l * w, axis=2), TINY)
    return out.reshape(bsz, hq, d).astype(q.dtype)


def decode_attention_reference(q, k_cache, v_cache, k_scale, v_scale, length, *, bits: int, sm_scale=None):
    """Dequantize the whole cache, then plain masked softmax attention in float32."""
    bsz, hq, d = q.shape
    h, t = k_cache.shape[1], k_cache.shape[2]
    k = dequantize_cache(k_cache, k_scale, bits)
    v = dequantize_cache(v_cache, v_scale, bits)
    qg = q.astype(jnp.float32).reshape(bsz, h, hq // h, d)
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, k) * (sm_scale if sm_scale is not None else 1.0 / math.sqrt(d))
    valid = jnp.arange(t)[None, :] < jnp.broadcast_to(jnp.asarray(length), (bsz,))[:, None]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    out = jnp.einsum("bhgt,bhtd->bhgd", jax.nn.softmax(s, axis=-1), v)
    return out.reshape(bsz, hq, d).astype(q.dtype)


def can_use(head_dim: int, bits: int, dtype) -> tuple[bool, str]:
    """(True, "") when the KV kernels take this cache, else (False, why)."""
    if bits not in SUPPORTED_BITS:
        return False, f"int{bits} cache (kernels exist for {SUPPORTED_BITS})"
    if not (is_pow2(head_dim) and head_dim >= min_head_dim(bits)):
        return False, f"head_dim {head_dim} is not a power of two >= {min_head_dim(bits)} (int{bits})"
    if jnp.dtype(dtype) not in FLOAT_DTYPES:
        return False, f"dtype {jnp.dtype(dtype).name} is not float32/bfloat16/float16"
    return True, ""
