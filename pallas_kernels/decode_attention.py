"""A decode step's attention over a stacked float KV cache, the step's key and value written by the same kernel.

Why: through XLA one query token's attention over a float cache is six launches a layer on a GPU (deviceless
H200 compile, Llama-2-7B shapes, ``scripts/gpu_aot.py``): the query's RoPE, the scores (the keys' RoPE fused
in), the softmax, the weighted values and one dynamic-update-slice per cache. Here it is two: XLA's fusion that
makes q, k and v (split-K sums and RoPE), then this kernel. It also reads only the slots written so far (its
loop stops at the step's slot), where XLA's reductions read all ``max_len`` slots and mask them.

Grid (batch, kv head, split of the slots). A program takes the G = H / KV query heads of its kv head (padded to
16 rows for the tensor-core dots) over its range of the slots before the step's, block by block with an online
softmax. The step's own key and value enter split 0 as its starting carry, so no program reads the slot being
written; split 0 also writes them into the cache at that slot (the cache outputs alias the cache inputs: the
update is in place, as XLA's dynamic-update-slice was). One split: the output is normalized in the kernel; more
(long caches, few heads): partial sums with their max and sum, merged by a small jnp step (flash decoding) -- or,
where a scan over the layers holds counters (``pallas_kernels.split_fixup``), by the last program of each (batch, kv
head), which spares the merge its launch.

The math is ``llmeq_jax.kv.attention.attention_xla``'s: scores in float32 from the query and keys in their
dtype, scaled by 1/sqrt(D); the (unnormalized) weights cast to the values' dtype for the second product.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import config, settings, split_fixup
from pallas_kernels.common import FLOAT_DTYPES, MIN_DOT, TINY, cdiv, check_int_scalar, compiler_params, \
    f32_dot_precision, fit_splits, is_pow2, next_pow2, span
from pallas_kernels.kv_cache import NEG_INF, attention_reference, combine_splits, decode_splits

MAX_HEAD_DIM = 256
MAX_GROUP = 64  # query heads per kv head: the program's score tile is (group, block) float32 in registers

_NT = ((1,), (1,))  # a (m, k) . c (n, k)^T
_NN = ((1,), (0,))  # a (m, k) . c (k, n)


def can_use(q_shape, q_dtype, cache_shape, cache_dtype, *, stacked: bool = True) -> tuple[bool, str]:
    """(True, "") when the kernel takes a query ``[B, H, D]`` over a cache ``[L, B, KV, S, D]`` (``stacked``) or
    ``[B, KV, S, D]``, else (False, why)."""
    if len(q_shape) != 3:
        return False, f"q must be [batch, heads, head_dim], got {tuple(q_shape)}"
    if len(cache_shape) != (5 if stacked else 4):
        want = "[layers, batch, kv_heads, slots, head_dim]" if stacked else "[batch, kv_heads, slots, head_dim]"
        return False, f"the cache must be {want}, got {tuple(cache_shape)}"
    b, h, d = q_shape
    cb, kv, _, cd = cache_shape[-4:]
    if (cb, cd) != (b, d) or h % kv:
        return False, f"q {tuple(q_shape)} does not match the cache {tuple(cache_shape)} (batch, head_dim, heads % kv)"
    if not (is_pow2(d) and MIN_DOT <= d <= MAX_HEAD_DIM):
        return False, f"head_dim {d} is not a power of two in [{MIN_DOT}, {MAX_HEAD_DIM}]"
    if h // kv > MAX_GROUP:
        return False, f"{h // kv} query heads per kv head (at most {MAX_GROUP})"
    for name, dtype in (("q", q_dtype), ("cache", cache_dtype)):
        if jnp.dtype(dtype) not in FLOAT_DTYPES:
            return False, f"{name} dtype {jnp.dtype(dtype).name} is not float32/bfloat16/float16"
    return True, ""


def _added(parts):
    """The sum of an iterable of arrays (one part: itself, no add)."""
    return functools.reduce(operator.add, parts)


def _kernel(*refs, g, bg, q_heads, kv, bt, sm_scale, split_blocks, splits, precision, stacked, merges=False,
            rope=False, dot_dtype=None, interpret=False):
    """One (batch, kv head, split of the slots before the step's). ``precision``: the (scores, weighted values)
    dots' (TF32x3 where an operand is float32 on a GPU). ``merges``: the splits' last program merges them (the
    counters the last input, the output then first, before the partials). ``rope``: the query and key arrive
    before RoPE, with the step's cos / sin after the mask; each is rotated in float32 and rounded to its dtype (as
    ``core.rope.apply_rope``), the query then cast to ``dot_dtype``; everything that touches a head's features
    works on its two halves apart (rotate-half pairs feature i with i + D/2; a dot over the halves is two dots)."""
    refs = list(refs)
    at = (refs.pop(0)[0],) if stacked else ()  # the layer of a stacked cache, read in place
    slot_ref, qkv_ref, allow_ref = refs[:3]
    del refs[:3]
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if rope else (None, None)
    k_ref, v_ref = refs[:2]
    counters = refs.pop(2) if merges else None
    outs = refs[2:-1] if merges else refs[2:]  # (the counters' aliased output last: the same buffer)
    out_ref = outs.pop(0) if merges else None
    o_ref, m_ref, l_ref = (outs[0], None, None) if splits == 1 else outs[:3]
    k_out, v_out = outs[-2:]
    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = jnp.minimum(slot_ref[0], allow_ref.shape[1] - 1)  # a slot past the cache's end writes its last one
    heads, head_mask = span(0, bg, g)
    d = qkv_ref.shape[-1]
    cols = (slice(None),) if not rope else (pl.ds(0, d // 2), pl.ds(d // 2, d // 2))  # the features, or each half

    def step_rows(rows, mask=None) -> list:
        """Rows of the step's q | k | v operand, as ``cols`` parts: rotated where ``rope``."""
        parts = [plgpu.load(qkv_ref.at[b, rows, c], mask=mask, other=None if mask is None else 0) for c in cols]
        if not rope:
            return parts
        cos, sin = (plgpu.load(r.at[pl.ds(b, 1), :]) for r in (cos_ref, sin_ref))  # (1, d / 2) float32
        lo, hi = (a.astype(jnp.float32) for a in parts)
        return [(lo * cos - hi * sin).astype(parts[0].dtype), (hi * cos + lo * sin).astype(parts[1].dtype)]

    # the query heads of kv head h, then its key and value: rows h * g.., q_heads + h and q_heads + kv + h
    q = [a.astype(dot_dtype or a.dtype) for a in step_rows(pl.ds(h * g, bg), head_mask[:, None])]  # (bg, d) parts
    k_new = [a.astype(k_ref.dtype) for a in step_rows(pl.ds(q_heads + h, 1))]  # (1, d) parts, the cache's values
    v_new = plgpu.load(qkv_ref.at[b, pl.ds(q_heads + kv + h, 1), :]).astype(v_ref.dtype)
    # The step's own key as the first "block" of split 0 (where the mask lets the query see it).
    own = (sp == 0) & (plgpu.load(allow_ref.at[b, pl.ds(slot, 1)]) != 0)  # (1,)
    s_own = _added(jnp.sum(qp.astype(jnp.float32) * kp.astype(jnp.float32), axis=1, keepdims=True)
                   for qp, kp in zip(q, k_new)) * sm_scale
    m0 = jnp.where(own[None, :], s_own, NEG_INF)  # (bg, 1)
    l0 = jnp.where(own[None, :], 1.0, 0.0) + jnp.zeros_like(m0)
    acc0 = jnp.where(own[None, :], v_new.astype(jnp.float32), 0.0) + jnp.zeros((bg, 1), jnp.float32)

    def body(tb, carry):
        m_prev, l_prev, acc = carry
        toks, before = span(tb * bt, bt, slot)  # slots before the step's
        ok = before & (plgpu.load(allow_ref.at[b, toks], mask=before, other=0) != 0)
        s = _added(jax.lax.dot_general(qp, plgpu.load(k_ref.at[(*at, b, h, toks, c)], mask=before[:, None],
                                                       other=0).astype(qp.dtype),
                                       (_NT, ((), ())), precision=precision[0], preferred_element_type=jnp.float32)
                   for qp, c in zip(q, cols))
        s = jnp.where(ok[None, :], s * sm_scale, NEG_INF)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(ok[None, :], jnp.exp(s - m_new), 0.0)  # a block with nothing allowed adds nothing
        corr = jnp.exp(m_prev - m_new)
        values = plgpu.load(v_ref.at[(*at, b, h, toks, slice(None))], mask=before[:, None], other=0)
        upd = jax.lax.dot_general(p.astype(values.dtype), values, (_NN, ((), ())), precision=precision[1],
                                  preferred_element_type=jnp.float32)
        return m_new, l_prev * corr + jnp.sum(p, axis=1, keepdims=True), acc * corr + upd

    first = sp * split_blocks
    last = jnp.minimum(first + split_blocks, (slot + bt - 1) // bt)
    m_fin, l_fin, acc = jax.lax.fori_loop(first, last, body, (m0, l0, acc0))  # none when the split is empty
    rows = head_mask[:, None]
    if splits == 1:
        plgpu.store(o_ref.at[b, h, heads, :], (acc / jnp.maximum(l_fin, TINY)).astype(o_ref.dtype), mask=rows)
    else:
        plgpu.store(o_ref.at[b, h, sp, heads, :], acc, mask=rows)
        plgpu.store(m_ref.at[b, h, sp, heads, :], m_fin, mask=rows)
        plgpu.store(l_ref.at[b, h, sp, heads, :], l_fin, mask=rows)
    if merges:
        tile = b * kv + h  # read outside the branch: interpret mode has no program ids inside one

        @pl.when(split_fixup.arrived_last(counters, tile, splits, interpret))
        def _():  # combine_splits' merge, split by split in order
            m_all = NEG_INF + jnp.zeros((bg, 1), jnp.float32)
            for t in range(splits):
                m_all = jnp.maximum(m_all, split_fixup.read(m_ref.at[b, h, jnp.int32(t), heads, :], rows, NEG_INF))
            num, den = jnp.zeros_like(acc), jnp.zeros((bg, 1), jnp.float32)
            for t in range(splits):
                w = jnp.exp(split_fixup.read(m_ref.at[b, h, jnp.int32(t), heads, :], rows, NEG_INF) - m_all)
                num = num + split_fixup.read(o_ref.at[b, h, jnp.int32(t), heads, :], rows) * w
                den = den + split_fixup.read(l_ref.at[b, h, jnp.int32(t), heads, :], rows) * w
            plgpu.store(out_ref.at[b, h, heads, :], (num / jnp.maximum(den, TINY)).astype(out_ref.dtype), mask=rows)
            split_fixup.release(counters, tile)
    # Split 0 writes the step's key and value into the cache (the outputs alias the inputs: in place).
    for kp, c in zip(k_new, cols):
        plgpu.store(k_out.at[(*at, b, h, pl.ds(slot, 1), c)], kp, mask=jnp.broadcast_to((sp == 0)[None, None], kp.shape))
    plgpu.store(v_out.at[(*at, b, h, pl.ds(slot, 1), slice(None))], v_new,
                mask=jnp.broadcast_to((sp == 0)[None, None], v_new.shape))


def append_decode_attention(q, k_new, v_new, k_cache, v_cache, slot, allowed, *, layer=None, rope=None,
                            sm_scale: float | None = None, block_t: int = 64, num_splits: int | None = None,
                            num_warps: int = 4, num_stages: int = 2, interpret: bool | None = None):
    """Write one token's key and value into a float cache at ``slot`` and attend over the cache: ->
    ``(out [B, H, D] in q's dtype, k_cache, v_cache)``, the caches updated in place.

    q ``[B, H, D]`` (GQA: H = G x KV); k_new, v_new ``[B, KV, D]`` (written in the cache's dtype);
    k_cache, v_cache ``[L, B, KV, S, D]`` with ``layer`` (an integer scalar, may be traced: that layer is read
    and written in place) or ``[B, KV, S, D]`` without; ``slot`` an integer scalar < S, the slot the token
    takes (slots after it are not read); ``allowed`` ``[B, S]`` bool, the slots the query sees (valid tokens,
    causal, sliding window; its own slot included where it is a real token). A query that sees nothing gets
    zeros (XLA's masked softmax averages every slot there; only padding queries see nothing).

    ``rope``: ``(cos, sin)`` ``[B, D / 2]`` float32, the step's RoPE tables (``core.rope.RopeTables`` of its
    position): q and k_new are then the projections' outputs before RoPE (one dtype with v_new), and the kernel
    rotates them as ``core.rope.apply_rope`` would (rotate-half, float32, rounded to their dtype) before it attends
    and writes the key. Why: the rotation was a launch of its own every layer (XLA's fusion between the q/k/v
    product and this kernel); the product's output now reaches the kernel as it is.
    """
    stacked = layer is not None
    ok, why = can_use(q.shape, q.dtype, k_cache.shape, k_cache.dtype, stacked=stacked)
    if not ok:
        raise ValueError(f"append_decode_attention: {why}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"append_decode_attention: v_cache {v_cache.dtype} {v_cache.shape} differs from k_cache "
                         f"{k_cache.dtype} {k_cache.shape}")
    bsz, hq, d = q.shape
    kv, t = k_cache.shape[-3], k_cache.shape[-2]
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        if a.shape != (bsz, kv, d):
            raise ValueError(f"append_decode_attention: {name} must be {(bsz, kv, d)}, got {a.shape}")
    if allowed.shape != (bsz, t):
        raise ValueError(f"append_decode_attention: allowed must be {(bsz, t)}, got {allowed.shape}")
    for name, s in (("slot", slot), ("layer", layer)):
        if s is not None:
            check_int_scalar("append_decode_attention", name, s)
    if not (is_pow2(block_t) and block_t >= MIN_DOT):
        raise ValueError(f"append_decode_attention: block_t must be a power of two >= {MIN_DOT}, got {block_t}")
    if rope is not None:
        _check_rope(rope, q, k_new, v_new)
    g = hq // kv
    bt = min(block_t, max(MIN_DOT, next_pow2(t)))
    splits, split_blocks = fit_splits(cdiv(t, bt), num_splits or decode_splits(bsz, kv, t, bt))
    interpret = config.resolve_interpret(interpret)
    f32 = f32_dot_precision(interpret)
    if jnp.dtype(q.dtype) != jnp.dtype(k_cache.dtype) or jnp.dtype(q.dtype) == jnp.float32:  # float32 scores
        dot_dtype, precision = jnp.float32, (f32, f32 if jnp.dtype(k_cache.dtype) == jnp.float32 else None)
    else:
        dot_dtype, precision = k_cache.dtype, (None, None)
    # the splits merged by their last program where the scan's counters are held (pallas_kernels.split_fixup)
    counters = split_fixup.take(bsz * kv) if splits > 1 and settings.of("append_decode_attention", bsz).reduce \
        != "xla" else None
    merges = counters is not None
    kernel = functools.partial(
        _kernel, g=g, bg=max(MIN_DOT, next_pow2(g)), q_heads=hq, kv=kv, bt=bt, split_blocks=split_blocks, splits=splits,
        sm_scale=float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)), precision=precision,
        stacked=stacked, merges=merges, rope=rope is not None, dot_dtype=dot_dtype if rope is not None else None,
        interpret=interpret)
    if splits == 1:
        outs = (jax.ShapeDtypeStruct((bsz, kv, g, d), q.dtype),)
    else:
        stat = jax.ShapeDtypeStruct((bsz, kv, splits, g, 1), jnp.float32)
        outs = (jax.ShapeDtypeStruct((bsz, kv, splits, g, d), jnp.float32), stat, stat)
    if merges:  # the merged output first, the counters after the caches (updated in place)
        outs = (jax.ShapeDtypeStruct((bsz, kv, g, d), q.dtype), *outs)
    at = [] if layer is None else [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))]
    # (scalars as they are and the mask as bool: a conversion here would be a launch of its own every layer)
    args = [*at, jnp.reshape(jnp.asarray(slot, jnp.int32), (1,)), _step_operand(q, k_new, v_new, k_cache.dtype,
                                                                               dot_dtype, rope is not None),
            allowed.astype(bool), *([] if rope is None else [a.astype(jnp.float32) for a in rope]), k_cache, v_cache]
    aliases = {len(args) - 2: len(outs), len(args) - 1: len(outs) + 1}
    cache_outs = (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    if merges:
        aliases[len(args)] = len(outs) + 2
        args.append(counters)
        cache_outs = (*cache_outs, jax.ShapeDtypeStruct(counters.shape, counters.dtype))
    result = pl.pallas_call(
        kernel,
        out_shape=(*outs, *cache_outs),
        grid=(bsz, kv, splits),
        input_output_aliases=aliases,
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="append_decode_attention",
    )(*args)
    if merges:
        split_fixup.give(result[-1])
        result = result[:-1]
    k_cache, v_cache = result[-2:]
    if splits == 1 or merges:
        out = result[0]
    else:
        out, _ = combine_splits(*result[:3])
    return out.reshape(bsz, hq, d).astype(q.dtype), k_cache, v_cache


def _check_rope(rope, q, k_new, v_new) -> None:
    bsz, _, d = q.shape
    if len(rope) != 2 or any(a.shape != (bsz, d // 2) for a in rope):
        raise ValueError(f"append_decode_attention: rope must be (cos, sin), each {(bsz, d // 2)}, got "
                         f"{[getattr(a, 'shape', a) for a in rope]}")
    if d // 2 < MIN_DOT:
        raise ValueError(f"append_decode_attention: with rope, head_dim must be >= {2 * MIN_DOT} (each half a dot "
                         f"of >= {MIN_DOT}), got {d}")
    if not (q.dtype == k_new.dtype == v_new.dtype):
        raise ValueError(f"append_decode_attention: with rope, q, k_new and v_new must share a dtype (the "
                         f"projections' outputs as they are), got {q.dtype}, {k_new.dtype}, {v_new.dtype}")


def _step_operand(q, k_new, v_new, cache_dtype, dot_dtype, rope: bool):
    """The step's q | k | v rows ``[B, H + 2 KV, D]``: one operand for the three, which XLA writes in one fusion
    at most (three operands were three). Without ``rope`` the query in ``dot_dtype`` and the key and value
    rounded to the cache's dtype first (what the cache holds; ``dot_dtype`` holds those exactly: the same, or
    float32). With it, all three as they are (the kernel rotates and converts), joined as flat rows ``[B, 1, n]``:
    where they are one product's columns (a q/k/v product, reshaped), XLA's simplifier sees the concatenate of that
    product's adjacent slices and makes it the product itself, so no fusion runs before the kernel (joined as
    heads, the reshapes between the slices and the concatenate kept it a launch of its own)."""
    if rope:
        bsz, rows = q.shape[0], q.shape[1] + k_new.shape[1] + v_new.shape[1]
        flat = jnp.concatenate([a.reshape(bsz, 1, -1) for a in (q, k_new, v_new)], axis=2)
        return flat.reshape(bsz, rows, q.shape[2])
    new = [a.astype(cache_dtype).astype(dot_dtype) for a in (k_new, v_new)]
    return jnp.concatenate([q.astype(dot_dtype), *new], axis=1)


def append_decode_attention_reference(q, k_new, v_new, k_cache, v_cache, slot, allowed, *, layer=None, rope=None,
                                      sm_scale: float | None = None):
    """Pure-jnp reference: write the token's key and value, then masked attention over slots ``0 .. slot``
    (``rope``: q and k_new rotated first by ``core.rope.apply_rope``)."""
    if rope is not None:
        from llmeq_jax.core.rope import RopeTables, apply_rope

        tables = RopeTables(*(a.astype(jnp.float32)[:, None] for a in rope))  # [B, 1, D / 2]
        q, k_new = (apply_rope(a[:, None], tables, None)[:, 0] for a in (q, k_new))
    start = (0, 0, slot, 0) if layer is None else (layer, 0, 0, slot, 0)
    new_k, new_v = (a.astype(k_cache.dtype)[:, :, None, :] for a in (k_new, v_new))  # [B, KV, 1, D]
    if layer is not None:
        new_k, new_v = new_k[None], new_v[None]
    k_cache = jax.lax.dynamic_update_slice(k_cache, new_k, start)
    v_cache = jax.lax.dynamic_update_slice(v_cache, new_v, start)
    k, v = (k_cache, v_cache) if layer is None else (k_cache[layer], v_cache[layer])
    seen = allowed.astype(bool) & (jnp.arange(k.shape[2])[None, :] <= slot)
    out, _ = attention_reference(q, k.astype(jnp.float32), v.astype(jnp.float32), seen, sm_scale)
    return out.astype(q.dtype), k_cache, v_cache


__all__ = ["MAX_GROUP", "MAX_HEAD_DIM", "append_decode_attention", "append_decode_attention_reference", "can_use"]
