"""Flash decoding's last step in one kernel: a decode attention's split results merged by their log-sum-exps, with
the cache's float sinks' share of the same softmax.

Why: the Mosaic GPU KV kernel (:mod:`pallas_kernels.kv_attention_hopper`) leaves each (row, KV head)'s splits as
partial results. Merged by XLA (:func:`pallas_kernels.kv_cache.combine_splits`: a max over the splits, their weights,
two sums) and beside the float sinks' attention, they were 7 small launches of a Llama-2-7B decode layer over an int8
pre-RoPE cache (deviceless H100 compile): 9 launches around the kernel where it does ~25 us of work at 32K slots, each
of them ~2 us on an H100. Here they are one: a program a (row, KV head, 32 output channels) takes the splits in as
few chunks as its registers hold (one for up to 16 splits of 16 rows) with a running max, weight sum and output (the
online softmax over whole splits), starting from the sinks' share where the cache has sinks, and writes the output in
the dtype its consumer reads. (One program a head walking chunks of 4 splits would wait on a load a chunk: 16 in a
row for Llama-3-8B's 64 splits.) The Triton decode kernel (:func:`pallas_kernels.kv_cache.store_decode_attention`,
which reads the sinks itself) merges its unnormalized splits here too: XLA's merge of them was one fusion for one
query head a KV head, three for grouped queries (Llama-3-8B's 4, deviceless H100).

Contract (:func:`merge_splits`):
  out      [B, H, S, R, D] float32   each split's output for R >= G query rows (rows past G are not read)
  lse      [B, H, S, R]    float32   their log-sum-exps (``total=None``: ``out`` is normalized) or score maxima
  total    [B, H, S, R]    float32   with maxima: each split's weight sum (``out`` unnormalized), else None
  shift    [B, H, G]       float32   optional: added to every split's log-sum-exp (a query's scores shifted alike)
  sinks    (q [B, H, G, D], k [(L,) B, H, N, D], v, seen [B, N])   optional: float keys and values the queries
           (scaled by ``sm_scale`` here) also attend to, ``layer`` picking a stack's layer in place
  -> (out [B, H, G, D] ``out_dtype``, lse [B, H, G] float32)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import config
from pallas_kernels.common import MIN_DOT, TINY, cdiv, compiler_params, f32_dot_precision, next_pow2, span

NEG_INF = -1e30  # finite: a fully masked block must not produce inf - inf = nan
COLS = 32  # output channels a program merges (all of a narrower head)
_QK, _PV = ((1,), (1,)), ((1,), (0,))  # contractions: q (rows, D) . k (n, D)^T; p (rows, n) . v (n, D)
TILE = 8192  # float32 values of the splits' outputs a chunk loads ([chunk, rows, COLS]): 64 a thread of 4 warps


def sink_carry(q_ref, k_ref, v_ref, seen_ref, *, at, b, h, heads, head_mask, n, first, sm_scale, precision,
               cols=slice(None)):
    """(max, sum, weighted values) of the query heads over the ``n`` float sink tokens they see, where ``first``
    (split 0; elsewhere the empty carry): float32 scores and products, as the cache's float attention parts. ``cols``:
    the value columns to weigh (all: the scores always take every channel)."""
    rows, row_mask = span(0, max(MIN_DOT, next_pow2(n)), n)
    q = plgpu.load(q_ref.at[b, h, heads, :], mask=head_mask[:, None], other=0.0).astype(jnp.float32) * sm_scale
    keys = plgpu.load(k_ref.at[(*at, b, h, rows, slice(None))], mask=row_mask[:, None], other=0).astype(jnp.float32)
    values = plgpu.load(v_ref.at[(*at, b, h, rows, cols)], mask=row_mask[:, None], other=0).astype(jnp.float32)
    ok = row_mask & (plgpu.load(seen_ref.at[b, rows], mask=row_mask, other=0) != 0) & first
    s = jnp.where(ok[None, :], jax.lax.dot_general(q, keys, (_QK, ((), ())), precision=precision,
                                                   preferred_element_type=jnp.float32), NEG_INF)
    m = jnp.max(s, axis=1, keepdims=True)
    p = jnp.where(ok[None, :], jnp.exp(s - m), 0.0)  # none seen: m = NEG_INF, l = 0, acc = 0 (the empty carry)
    acc = jax.lax.dot_general(p, values, (_PV, ((), ())), precision=precision, preferred_element_type=jnp.float32)
    return m, jnp.sum(p, axis=1, keepdims=True), acc


def _kernel(*refs, g: int, rows: int, width: int, chunk: int, parts: int, normalized: bool, shifted: bool,
            sinks: int, stacked: bool, sm_scale: float, precision):
    refs = list(refs)
    at = (refs.pop(0)[0],) if stacked else ()  # the sinks' layer, read in place from their stacks
    out_ref, lse_ref = refs.pop(0), refs.pop(0)
    total_ref = None if normalized else refs.pop(0)
    shift_ref = refs.pop(0) if shifted else None
    sink_refs = [refs.pop(0) for _ in range(4)] if sinks else None
    o_ref, l_ref = refs
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads, head_mask = span(0, rows, g)
    cols = pl.ds(c * width, width)
    if sinks:  # the running state starts as the queries' attention over the sinks they see
        m, l, acc = sink_carry(*sink_refs, at=at, b=b, h=h, heads=heads, head_mask=head_mask, n=sinks, first=True,
                               sm_scale=sm_scale, precision=precision, cols=cols)
    else:
        m, l, acc = (jnp.full((rows, 1), NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
                     jnp.zeros((rows, width), jnp.float32))
    shift = plgpu.load(shift_ref.at[b, h, heads], mask=head_mask, other=0.0) if shifted else 0.0

    def merge_chunk(i, carry):
        m, l, acc = carry
        splits, split_mask = span(i * chunk, chunk, parts)
        mask = split_mask[:, None] & head_mask[None, :]
        # a split past the end weighs exp(NEG_INF - max) = 0 (the kernel's empty splits as well)
        lse = plgpu.load(lse_ref.at[b, h, splits, heads], mask=mask, other=NEG_INF) + shift
        o = plgpu.load(out_ref.at[b, h, splits, heads, cols], mask=mask[:, :, None], other=0.0)
        weight = 1.0 if normalized else plgpu.load(total_ref.at[b, h, splits, heads], mask=mask, other=0.0)
        m_new = jnp.maximum(m, jnp.max(lse, axis=0)[:, None])
        w = jnp.exp(lse - m_new[:, 0][None, :])  # [chunk, rows]
        corr = jnp.exp(m - m_new)
        return m_new, l * corr + jnp.sum(w * weight, axis=0)[:, None], acc * corr + jnp.sum(o * w[:, :, None], axis=0)

    m, l, acc = jax.lax.fori_loop(0, cdiv(parts, chunk), merge_chunk, (m, l, acc))
    denom = jnp.maximum(l, TINY)
    plgpu.store(o_ref.at[b, h, heads, cols], (acc / denom).astype(o_ref.dtype), mask=head_mask[:, None])
    # every program of a head has the log-sum-exp: the first of them writes it
    plgpu.store(l_ref.at[b, h, heads], (m + jnp.log(denom))[:, 0], mask=head_mask & (c == 0))


def merge_splits(out, lse, g: int, *, total=None, shift=None, sinks=None, layer=None, sm_scale: float = 1.0,
                 out_dtype=jnp.float32, interpret: bool | None = None):
    """The splits of each (row, KV head) merged, with the sinks' share where given (module docstring: the contract)
    -> ``(out [B, H, G, D] out_dtype, lse [B, H, G] float32)``."""
    bsz, heads, parts, r, d = out.shape
    width = min(COLS, d)
    if d % width or width & (width - 1):
        raise ValueError(f"merge_splits: head_dim {d}, neither a power of two below {COLS} nor a multiple of it")
    if lse.shape != out.shape[:-1] or (total is not None and total.shape != lse.shape) or not 1 <= g <= r:
        raise ValueError(f"merge_splits: out {out.shape}, lse {lse.shape}, total "
                         f"{None if total is None else total.shape} for {g} query rows (expected [B, H, S, R, D], "
                         f"[B, H, S, R] and R >= G)")
    if shift is not None and shift.shape != (bsz, heads, g):
        raise ValueError(f"merge_splits: shift must be {(bsz, heads, g)}, got {shift.shape}")
    args = [out, lse] + ([] if total is None else [total]) + ([] if shift is None else [shift])
    n = 0
    if sinks is not None:
        q, k, v, seen = sinks
        n = k.shape[-2]
        if q.shape != (bsz, heads, g, d) or k.shape[-4:] != (bsz, heads, n, d) or v.shape != k.shape \
                or seen.shape != (bsz, n) or k.ndim != 4 + int(layer is not None):
            raise ValueError(f"merge_splits: sinks q {q.shape}, k {k.shape}, v {v.shape}, seen {seen.shape} (expected "
                             f"[{bsz}, {heads}, {g}, {d}], [{'L, ' if layer is not None else ''}{bsz}, {heads}, N, "
                             f"{d}] twice and [{bsz}, N])")
        args += [q, k, v, seen.astype(bool)]
    stacked = sinks is not None and layer is not None
    if stacked:
        args = [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), *args]
    interpret = config.resolve_interpret(interpret)
    rows = max(MIN_DOT, next_pow2(g)) if n else next_pow2(g)  # the sinks' dots need 16 rows
    chunk = max(1, min(next_pow2(parts), TILE // (rows * width)))
    kernel = functools.partial(_kernel, g=g, rows=rows, width=width, chunk=chunk, parts=parts, normalized=total is None,
                               shifted=shift is not None, sinks=n, stacked=stacked, sm_scale=float(sm_scale),
                               precision=f32_dot_precision(interpret))
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((bsz, heads, g, d), out_dtype),
                   jax.ShapeDtypeStruct((bsz, heads, g), jnp.float32)),
        grid=(bsz, heads, d // width),
        compiler_params=compiler_params(4, 1),
        interpret=interpret,
        name="merge_splits",
    )(*args)


__all__ = ["COLS", "NEG_INF", "merge_splits", "sink_carry"]
