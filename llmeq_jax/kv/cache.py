"""Preallocated key/value cache for generation.

A :class:`KVCache` is a pytree of fixed-shape arrays, so a jitted decode step
never changes shape and never recompiles:

* ``k``, ``v``: ``[layers, batch, kv_heads, max_len, head_dim]``
* ``valid``: ``[batch, max_len]`` bool, which slots hold a real (non-padding) token
* ``length``: scalar int32, how many slots are written (the same for every row:
  prompts are left-padded to one length)
* ``positions``: ``[batch]`` int32, the position id the next real token gets
* ``written``: static, whether any step has been written (:func:`advance`); a prompt into an unwritten cache
  attends to its own keys only, not to the ``max_len`` slots (the rest are empty)

A step goes: :func:`append_mask` (mark the new slots), per layer
:func:`attend` (write the new keys/values, attend over the cache; for the float
cache that is :func:`update` then :func:`read`), finally :func:`advance`.

:class:`QuantKVCache` is the quantized cache (SimQuant / KVQuant-style, math in
:mod:`llmeq_jax.kv.grid`): the same bookkeeping fields, keys and values stored
as packed int8/int4/int2 codes, a float ring buffer of the most recent
``window`` tokens and a float copy of the first ``sink_tokens`` tokens. Every
function here dispatches on the cache type, so model code never tests for
quantization.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax import dispatch_table, native
from llmeq_jax.core.rope import RopeTables, apply_rope, rope_tables
from llmeq_jax.kv import grid as kvgrid
from llmeq_jax.kv import spec as kvspec
from llmeq_jax.kv.attention import dot_product_attention, flash_ok, layer_attention, merge_attention, split_attention
from llmeq_jax.kv.store_attention import store_attention
from pallas_kernels import config as kernel_config
from pallas_kernels import decode_attention as float_kernel
from pallas_kernels import hardware_checked
from pallas_kernels import kv_attention_hopper as kv_hopper
from pallas_kernels import kv_cache as kv_kernels
from pallas_kernels import kv_store_append as kv_append


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array
    v: jax.Array
    valid: jax.Array
    length: jax.Array
    positions: jax.Array
    written: bool = dataclasses.field(metadata=dict(static=True), default=False)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def init(num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype=jnp.float32) -> KVCache:
    """An empty cache with room for ``max_len`` tokens per row."""
    shape = (num_layers, batch, kv_heads, max_len, head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        valid=jnp.zeros((batch, max_len), bool),
        length=jnp.zeros((), jnp.int32),
        positions=jnp.zeros((batch,), jnp.int32),
    )


def new_positions(cache: KVCache, attention_mask: jax.Array) -> jax.Array:
    """Position ids [B, T] for the next T tokens: real tokens count up from ``cache.positions``.

    Padding tokens get the position of the next real token (they are masked out anyway).
    """
    mask = attention_mask.astype(jnp.int32)
    return cache.positions[:, None] + jnp.cumsum(mask, axis=1) - mask


def slots(cache: KVCache, num_new: int) -> jax.Array:
    """Cache slot index of each of the next ``num_new`` tokens."""
    return cache.length + jnp.arange(num_new, dtype=jnp.int32)


def append_mask(cache, attention_mask: jax.Array):
    """Mark the next T slots valid where ``attention_mask`` [B, T] is 1 (quantized: record their positions)."""
    valid = jax.lax.dynamic_update_slice(cache.valid, attention_mask.astype(bool), (0, cache.length))
    if not isinstance(cache, QuantKVCache):
        return dataclasses.replace(cache, valid=valid)
    pos = new_positions(cache, attention_mask)
    if cache.slot_pos is not None:
        cache = dataclasses.replace(cache, slot_pos=jax.lax.dynamic_update_slice(cache.slot_pos, pos, (0, cache.length)))
    if cache.rope_cos is not None:
        cos, sin = rope_tables(pos, cache.inv_freq)
        cache = dataclasses.replace(cache, rope_cos=jax.lax.dynamic_update_slice(cache.rope_cos, cos, (0, cache.length, 0)),
                                    rope_sin=jax.lax.dynamic_update_slice(cache.rope_sin, sin, (0, cache.length, 0)))
    if cache.sink_slot is not None:
        rows = jnp.arange(pos.shape[0])[:, None]
        at = _sink_index(cache, pos, attention_mask)
        cache = dataclasses.replace(cache, sink_slot=cache.sink_slot.at[rows, at].set(
            jnp.broadcast_to(slots(cache, pos.shape[1]), pos.shape), mode="drop"))
    return dataclasses.replace(cache, valid=valid)


def update(cache, layer: int, k: jax.Array, v: jax.Array, *, k_raw: jax.Array | None = None):
    """Write new keys/values ``[B, KV, T, D]`` of ``layer`` at slots ``length .. length+T``.

    ``k_raw``: the keys before RoPE (a pre-RoPE quantized cache stores those).
    """
    if isinstance(cache, QuantKVCache):
        return _q_update(cache, layer, k, v, k_raw)
    start = (layer, 0, 0, cache.length, 0)
    return dataclasses.replace(
        cache,
        k=jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), start),
        v=jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), start),
    )


def read(cache, layer: int) -> tuple[jax.Array, jax.Array]:
    """All keys and values of ``layer``: ``[B, KV, max_len, D]`` each (use ``valid`` to mask).

    A quantized cache returns the dequantized store (RoPE applied to pre-RoPE keys),
    without its float window.
    """
    if isinstance(cache, QuantKVCache):
        return _q_read(cache, layer)
    return cache.k[layer], cache.v[layer]


def attend(cache, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, k_raw=None,
           rope: RopeTables | None = None):
    """Write the step's keys/values (``[B, KV, T, D]``) and attend over the cache: -> (out [B, T, H, D], cache).

    q [B, T, H, D]; mask [B, T, max_len] (causal, valid, sliding window). ``rope``: q and k are before RoPE,
    to be rotated by these tables (the float cache's kernel does it itself where :func:`rotates` says so;
    anywhere else, ``core.rope.apply_rope`` here).
    """
    pallas = not isinstance(cache, QuantKVCache) and float_path(cache, q) == "pallas"
    if rope is not None and not (pallas and _rotates_in_kernel(q) and q.dtype == k.dtype == v.dtype):
        q, k, rope = apply_rope(q, rope, None), apply_rope(k, rope, None, heads_axis=1), None
    if isinstance(cache, QuantKVCache):
        out, cache = _q_attend(cache, layer, q, k, v, mask, k_raw)
    elif pallas:  # a GPU's decode step: one kernel writes the token and attends (and rotates q and k: rope)
        tables = None if rope is None else (rope.cos[:, 0], rope.sin[:, 0])
        out, k_cache, v_cache = float_kernel.append_decode_attention(q[:, 0], k[:, :, 0], v[:, :, 0], cache.k, cache.v,
                                                                     cache.length, mask[:, 0], layer=layer, rope=tables)
        out, cache = out[:, None], dataclasses.replace(cache, k=k_cache, v=v_cache)
    else:
        cache = update(cache, layer, k, v)
        if cache.written or k.shape[2] == 1:
            out = layer_attention(q, cache.k, cache.v, layer, mask)
        else:  # a prompt into an unwritten cache: its slots 0..T are these keys, the other max_len - T empty
            t = k.shape[2]
            out = dot_product_attention(q, k.astype(cache.k.dtype), v.astype(cache.v.dtype), mask[:, :, :t])
    # In the queries' dtype whatever the cache holds: a bf16 model's residual stream stays bf16 (and a
    # scanned stack of blocks keeps one carry type) under a float32 cache too.
    return out.astype(q.dtype), cache


def advance(cache: KVCache, attention_mask: jax.Array) -> KVCache:
    """Close the step: T more slots written, position counters moved past the real tokens."""
    t = attention_mask.shape[1]
    return dataclasses.replace(
        cache,
        length=cache.length + t,
        positions=cache.positions + jnp.sum(attention_mask.astype(jnp.int32), axis=1),
        written=True,
    )


# --------------------------------------------------------------------------- quantized cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What every layer of one step over a quantized cache derives alike from the step's mask and the cache's
    counters (:func:`step_plan`). Derived in each layer, it was evaluated again in every iteration of the loop
    over stacked blocks (XLA does not hoist it out): four small launches a layer of an int8 cache's decode step on
    a GPU (the store's mask, the sinks seen, the sink targets, the scan length; deviceless H200 compile).
    :func:`with_step_plan` makes it once, before that loop."""

    store_allowed: jax.Array  # [B, T, S] bool: the slots each query reads from the store (not window, not sink)
    scan: jax.Array  # int32: the slots a one-token step's store attention scans (those before query - window)
    sinks_seen: jax.Array | None = None  # [B, T, N] bool: the float sinks each query sees (None: no sinks)
    sink_targets: jax.Array | None = None  # [B, T] int32: the sink each new token is copied to (N: none)
    # [B, S] int8: a one-token step's store_allowed as the Mosaic GPU kernel reads it, one byte a slot (None: T > 1;
    # XLA drops it where no kernel reads it)
    store_bytes: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantKVCache:
    """Quantized K/V cache. Shapes (L layers, B rows, KV heads, S = max_len slots, D head dim):

    * ``k``, ``v``: :class:`llmeq_jax.kv.grid.QuantizedKV` with codes ``[L, B, KV, S, D / per-byte]``,
      per-token ``scale``/``lo`` ``[L, B, KV, S, 1]`` float16 (keys per channel: None),
      outliers ``[L, B, KV, S, n]``.
    * ``k_scale``, ``k_lo``, ``k_hi``: per-channel key grid ``[L, KV, D]`` (static, calibrated),
      ``[L, B, KV, D]`` (online: set per row by the first write), or None (per-token keys).
    * ``k_win``, ``v_win``: float ring buffer ``[L, B, KV, W, D]`` of the last W tokens
      (slot s lives at ``s % W``), or None for W = 0. Keys there are post-RoPE.
    * ``k_sink``, ``v_sink``: float copy ``[L, B, KV, N, D]`` of the tokens at positions
      ``0 .. N-1`` (N = ``sink_tokens``; keys post-RoPE), or None for N = 0;
      ``sink_slot``: ``[B, N]`` the slot each of them sits in (-1 until written).
    * ``slot_pos``: ``[B, S]`` position id of each slot (pre-RoPE keys are rotated with it).
    * ``inv_freq``: RoPE inverse frequencies ``[D / 2]`` (None for models without RoPE).
    * ``valid``, ``length``, ``positions``: as in :class:`KVCache`.
    * ``written``: static, whether any step has been written (the online key grid is set then).
    * ``plan``: the step's :class:`StepPlan` while a scan over stacked blocks runs (:func:`with_step_plan`), else
      None.
    * ``rope_cos``, ``rope_sin``: ``[B, S, D / 2]`` cos/sin of each slot's position times ``inv_freq``, kept
      where the native CPU kernel reads pre-RoPE keys and they add at most :data:`TABLE_SHARE_MAX` to the
      codes' bytes (else None): written with the slot, instead of computing the whole table again on every
      step (~0.7 ms of a SmolLM2 step at 1K cached tokens).

    Each token is quantized once, when it is written (per-token ranges from the token
    itself, per-channel ranges calibrated): so its codes do not depend on how the
    sequence was cut into steps, and a full-sequence "prefill path" sees exactly what
    token-by-token decoding sees. The float window only changes what attention
    reads: at query slot t, key slots t-W+1 .. t come from the float copy, and so do
    the sink tokens (whatever their slot).
    """

    k: kvgrid.QuantizedKV
    v: kvgrid.QuantizedKV
    k_scale: jax.Array | None
    k_lo: jax.Array | None
    k_hi: jax.Array | None
    k_win: jax.Array | None
    v_win: jax.Array | None
    k_sink: jax.Array | None
    v_sink: jax.Array | None
    sink_slot: jax.Array | None
    slot_pos: jax.Array | None
    inv_freq: jax.Array | None
    valid: jax.Array
    length: jax.Array
    positions: jax.Array
    rope_cos: jax.Array | None = None
    rope_sin: jax.Array | None = None
    plan: StepPlan | None = None
    spec: kvspec.KVSpec = dataclasses.field(metadata=dict(static=True), default=kvspec.KVSpec())
    head_dim: int = dataclasses.field(metadata=dict(static=True), default=0)
    # True once a step has been written (:func:`advance`): an online key grid is then fixed for good, which the
    # trace knows, so later steps leave it alone instead of computing a range only to discard it.
    written: bool = dataclasses.field(metadata=dict(static=True), default=False)

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


def _empty_store(shape, bits: int, per_token: bool, n_out: int) -> kvgrid.QuantizedKV:
    l, b, h, s, d = shape
    per_byte = 8 // {2: 2, 4: 4, 8: 8}[bits]
    code_dtype = jnp.int8 if bits == 8 else jnp.uint8
    side = (l, b, h, s, 1)
    return kvgrid.QuantizedKV(
        q=jnp.zeros((l, b, h, s, math.ceil(d / per_byte)), code_dtype),
        scale=jnp.ones(side, kvgrid.SCALE_DTYPE) if per_token else None,
        lo=jnp.zeros(side, kvgrid.SCALE_DTYPE) if per_token else None,
        out_idx=jnp.zeros((l, b, h, s, n_out), jnp.uint8) if n_out else None,
        out_val=jnp.zeros((l, b, h, s, n_out), kvgrid.SCALE_DTYPE) if n_out else None,
    )


def init_quantized(
    num_layers: int,
    batch: int,
    kv_heads: int,
    max_len: int,
    head_dim: int,
    kv: kvspec.KVQuantizer,
    *,
    inv_freq: np.ndarray | None = None,
    dtype=jnp.float32,
) -> QuantKVCache:
    """An empty quantized cache. ``inv_freq``: the model's RoPE frequencies (needed for pre-RoPE keys)."""
    spec = kv.spec
    kv.check(num_layers, kv_heads, head_dim)
    if spec.window > max_len:
        raise kvspec.KVSpecError(
            f"the float window ({spec.window} tokens) is longer than the context ({max_len} tokens)"
        )
    pre_rope = spec.pre_rope and inv_freq is not None
    n_out = spec.n_outliers(head_dim)
    shape = (num_layers, batch, kv_heads, max_len, head_dim)
    k_scale = k_lo = k_hi = None
    if spec.needs_key_ranges:
        k_hi = jnp.array(kv.key_ranges.hi, copy=True)  # the cache is donated: never alias the quantizer
        k_scale, k_lo = kvgrid.grid_from_range(kv.key_ranges.lo, k_hi, spec.bits)
    elif spec.online_keys:
        # Until the first write these hold the running range (blended in then), if there is one.
        rows = (num_layers, batch, kv_heads, head_dim)
        if kv.key_ranges is None:
            spec = dataclasses.replace(spec, ema=0.0)  # nothing to blend with: the prompt alone
            k_lo, k_hi = jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.float32)  # two buffers: both are donated
        else:
            k_lo = jnp.broadcast_to(kv.key_ranges.lo[:, None], rows).astype(jnp.float32)
            k_hi = jnp.broadcast_to(kv.key_ranges.hi[:, None], rows).astype(jnp.float32)
        k_scale = jnp.ones(rows, jnp.float32)
    keep_tables = pre_rope and native_reads_store(spec, head_dim) and tables_are_cheap(num_layers, kv_heads, spec.bits)
    table = (batch, max_len, head_dim // 2)
    win = (num_layers, batch, kv_heads, spec.window, head_dim)
    n_sink = min(spec.sink_tokens, max_len)  # a shorter context is all sinks
    sink = (num_layers, batch, kv_heads, n_sink, head_dim)
    return QuantKVCache(
        k=_empty_store(shape, spec.bits, not spec.per_channel_keys, n_out),
        v=_empty_store(shape, spec.bits, True, n_out),
        k_scale=k_scale,
        k_lo=k_lo,
        k_hi=k_hi,
        k_win=jnp.zeros(win, dtype) if spec.window else None,
        v_win=jnp.zeros(win, dtype) if spec.window else None,
        k_sink=jnp.zeros(sink, dtype) if n_sink else None,
        v_sink=jnp.zeros(sink, dtype) if n_sink else None,
        sink_slot=jnp.full((batch, n_sink), -1, jnp.int32) if n_sink else None,
        slot_pos=jnp.zeros((batch, max_len), jnp.int32) if pre_rope else None,
        inv_freq=None if inv_freq is None else jnp.asarray(inv_freq, jnp.float32),
        valid=jnp.zeros((batch, max_len), bool),
        length=jnp.zeros((), jnp.int32),
        positions=jnp.zeros((batch,), jnp.int32),
        rope_cos=jnp.ones(table, jnp.float32) if keep_tables else None,
        rope_sin=jnp.zeros(table, jnp.float32) if keep_tables else None,
        spec=dataclasses.replace(spec, pre_rope=pre_rope),
        head_dim=head_dim,
    )


def _key_grid(cache: QuantKVCache, layer: int):
    """Per-channel (scale, lo, hi) of ``layer`` shaped [1 or B, KV, 1, D] to broadcast over [B, KV, T, D]."""
    if cache.spec.online_keys:
        return tuple(a[layer][:, :, None, :] for a in (cache.k_scale, cache.k_lo, cache.k_hi))
    return tuple(a[layer][None, :, None, :] for a in (cache.k_scale, cache.k_lo, cache.k_hi))


def _key_grids(cache: QuantKVCache):
    """Every layer's per-channel (scale, lo) shaped [L, 1 or B, KV, 1, D] (views of the stored arrays), for the
    Pallas kernels, which read ``layer``'s in place: the layer's slice was a launch of its own every layer."""
    if cache.spec.online_keys:
        return tuple(a[:, :, :, None, :] for a in (cache.k_scale, cache.k_lo))
    return tuple(a[:, None, :, None, :] for a in (cache.k_scale, cache.k_lo))


def _set_online_grid(cache: QuantKVCache, layer: int, keys: jax.Array) -> QuantKVCache:
    """First write of an online cache: each row's key range from this step's valid keys (blended with the
    running range by ``ema``); later writes keep it, so every stored code has one grid."""
    spec = cache.spec
    valid = jax.lax.dynamic_slice_in_dim(cache.valid, cache.length, keys.shape[2], axis=1)
    # The sinks stay in: a prompt's range already under-covers later keys, and leaving the sinks
    # out narrows it further (SmolLM2, int8, 64-token prompts: +5.1 % ppl without them vs +3.7 %).
    lo, hi = kvgrid.observed_key_ranges(keys, valid, spec.outlier_frac)
    if spec.ema:
        lo = spec.ema * cache.k_lo[layer] + (1 - spec.ema) * lo
        hi = spec.ema * cache.k_hi[layer] + (1 - spec.ema) * hi
    scale, lo = kvgrid.grid_from_range(lo, hi, spec.bits)
    first = cache.length == 0
    return dataclasses.replace(
        cache,
        k_scale=cache.k_scale.at[layer].set(jnp.where(first, scale, cache.k_scale[layer])),
        k_lo=cache.k_lo.at[layer].set(jnp.where(first, lo, cache.k_lo[layer])),
        k_hi=cache.k_hi.at[layer].set(jnp.where(first, hi, cache.k_hi[layer])),
    )


def _quantize_keys(cache: QuantKVCache, layer: int, k: jax.Array) -> kvgrid.QuantizedKV:
    spec, n_out = cache.spec, cache.spec.n_outliers(cache.head_dim)
    if spec.per_channel_keys:
        scale, lo, hi = _key_grid(cache, layer)
        return kvgrid.quantize_per_channel(k, scale, lo, hi, spec.bits, n_out)
    return kvgrid.quantize_per_token(k, spec.bits, n_out)


def _write(store: kvgrid.QuantizedKV, layer: int, new: kvgrid.QuantizedKV, start) -> kvgrid.QuantizedKV:
    return jax.tree.map(
        lambda a, n: jax.lax.dynamic_update_slice(a, n[None].astype(a.dtype), (layer, 0, 0, start, 0)), store, new
    )


def _sink_index(cache: QuantKVCache, positions: jax.Array, step_mask: jax.Array) -> jax.Array:
    """Index into the sink store of each new token [B, T]: its position, or N (dropped) for
    padding and tokens past the sinks."""
    n = cache.sink_slot.shape[1]
    return jnp.where(step_mask.astype(bool) & (positions < n), positions, n)


def _sink_targets(cache: QuantKVCache, t: int) -> jax.Array:
    """:func:`_sink_index` of this step's T tokens [B, T] (the step's slots are marked valid already)."""
    if cache.plan is not None:
        return cache.plan.sink_targets
    step_mask = jax.lax.dynamic_slice_in_dim(cache.valid, cache.length, t, axis=1)
    return _sink_index(cache, new_positions(cache, step_mask), step_mask)


def _write_sinks(cache: QuantKVCache, layer: int, k, v) -> QuantKVCache:
    """Float copies of this step's sink tokens (keys post-RoPE) into the sink store of ``layer``."""
    at = _sink_targets(cache, k.shape[2])  # [B, T]
    rows = jnp.arange(at.shape[0])[:, None]

    def put(stack, new):  # stack [L, B, KV, N, D] <- new [B, KV, T, D] at (layer, row, :, at[row, t])
        # One scatter into the stack: writing a scattered copy of the layer back into it made XLA copy the
        # whole stack twice per layer on every step (~0.4 ms of a SmolLM2 step).
        return stack.at[layer, rows, :, at].set(jnp.moveaxis(new, 2, 1).astype(stack.dtype), mode="drop")

    return dataclasses.replace(cache, k_sink=put(cache.k_sink, k), v_sink=put(cache.v_sink, v))


def _q_update(cache: QuantKVCache, layer: int, k, v, k_raw) -> QuantKVCache:
    if cache.spec.pre_rope and k_raw is None:
        raise ValueError("a pre-RoPE quantized cache needs the keys before RoPE (k_raw)")
    keys = k_raw if cache.spec.pre_rope else k
    n_out = cache.spec.n_outliers(cache.head_dim)
    # A written cache's grid is fixed: a decode step computing this step's key range only to discard it (the
    # where() in _set_online_grid) cost 16 of its 51 launches a layer (deviceless H200, Llama-2-7B, int8).
    if cache.spec.online_keys and not cache.written:
        cache = _set_online_grid(cache, layer, keys)
    kernel = kernel_appends(cache.spec, cache.head_dim, keys)
    if cache.sink_slot is not None and not kernel:  # the kernel writes the sinks' float copies as well
        cache = _write_sinks(cache, layer, k, v)
    if native_reads_store(cache.spec, cache.head_dim):  # the native kernel's setting: one in-place native write
        return _native_write(cache, layer, keys, v)
    if kernel:
        return _kernel_write(cache, layer, keys, v, k)
    return dataclasses.replace(
        cache,
        k=_write(cache.k, layer, _quantize_keys(cache, layer, keys), cache.length),
        v=_write(cache.v, layer, kvgrid.quantize_per_token(v, cache.spec.bits, n_out), cache.length),
    )


def _native_write(cache: QuantKVCache, layer: int, keys, v) -> QuantKVCache:
    """:func:`_q_update`'s codes and grids by one native call writing the store in place (``native.kv_store_append``,
    bit for bit XLA's): XLA's quantize-and-write is ~8 small ops a layer, and on a CPU each op's dispatch (a few
    us) costs more than its work -- ~7 fewer ops a layer, a few to ~10 % of SmolLM2's decode (docs/kv-cache.md)."""
    scale, lo, _ = _key_grid(cache, layer)
    kq, vq, vs, vl = native.kv_store_append(cache.k.q, cache.v.q, cache.v.scale, cache.v.lo, keys, v, scale, lo,
                                            cache.length, bits=cache.spec.bits, layer=layer)
    return dataclasses.replace(cache, k=dataclasses.replace(cache.k, q=kq),
                               v=dataclasses.replace(cache.v, q=vq, scale=vs, lo=vl))


def kernel_appends(spec: kvspec.KVSpec, head_dim: int, keys) -> bool:
    """Whether a step's keys [B, KV, T, D] and values go into the store through the Pallas write
    (``pallas_kernels.kv_store_append``): one-token steps where Pallas kernels run, per-channel keys, no outliers.
    On a GPU it is one launch a layer where XLA's quantize-and-write was ~10 (deviceless H200 compile), once it
    passed its gpu cases on one (``pallas_kernels.hardware_checked``: not yet)."""
    return (keys.shape[2] == 1 and kernel_config.kernels_available() and hardware_checked.allowed("store_append")
            and spec.per_channel_keys and not spec.n_outliers(head_dim)
            and kv_append.can_use(head_dim, spec.bits, keys.dtype)[0])


def _kernel_write(cache: QuantKVCache, layer: int, keys, v, k) -> QuantKVCache:
    """:func:`_q_update`'s codes and value grids, and a sink token's float copies (``k`` the keys after RoPE),
    written by the Pallas kernel in place (XLA's bits; the sinks were a select and two scatters a layer)."""
    scale, lo = _key_grids(cache)
    sinks = None
    if cache.sink_slot is not None:
        sinks = (cache.k_sink, cache.v_sink, _sink_targets(cache, 1), k if cache.spec.pre_rope else None)
    written = kv_append.store_append(cache.k.q, cache.v.q, cache.v.scale, cache.v.lo, keys, v, scale, lo,
                                     cache.length, bits=cache.spec.bits, layer=layer, sinks=sinks)
    kq, vq, vs, vl = written[:4]
    if sinks is not None:
        cache = dataclasses.replace(cache, k_sink=written[4], v_sink=written[5])
    return dataclasses.replace(cache, k=dataclasses.replace(cache.k, q=kq),
                               v=dataclasses.replace(cache.v, q=vq, scale=vs, lo=vl))


def _q_read(cache: QuantKVCache, layer: int, slots: int | None = None):
    """``layer``'s keys and values dequantized (float32 [B, KV, S, D]); ``slots``: only the first that many."""
    spec, d = cache.spec, cache.head_dim
    first = (lambda a: a) if slots is None else (lambda a: a[:, :, :slots])  # noqa: E731
    k_store = jax.tree.map(lambda a: first(a[layer]), cache.k)
    v_store = jax.tree.map(lambda a: first(a[layer]), cache.v)
    if spec.per_channel_keys:
        scale, lo, _ = _key_grid(cache, layer)
        keys = kvgrid.dequantize(k_store, spec.bits, d, scale, lo)
    else:
        keys = kvgrid.dequantize(k_store, spec.bits, d)
    if spec.pre_rope:
        keys = apply_rope(keys, cache.slot_pos[:, :keys.shape[2]], cache.inv_freq, heads_axis=1)
    return keys, kvgrid.dequantize(v_store, spec.bits, d)


def _window_slots(cache: QuantKVCache) -> jax.Array:
    """Slot index of each ring entry (oldest first) before this step: ``length - W .. length - 1``."""
    return cache.length - cache.spec.window + jnp.arange(cache.spec.window, dtype=jnp.int32)


def _q_attend(cache: QuantKVCache, layer: int, q, k, v, mask, k_raw):
    """Attention over [dequantized store | float sinks | float window before this step | this step's float K/V].

    Each slot is read from exactly one part: in the window (relative to the query) it
    is float; else a sink slot is float; else it is dequantized. A one-token step reads
    the store where it lies through a kernel or XLA's dots when one takes it (:func:`store_path`);
    the native CPU kernel and the Pallas one also read the float sinks in their softmax (without a window), so
    nothing is merged after them. A prompt without a float window attends to one float layer (:func:`_with_sinks`).
    """
    w, t = cache.spec.window, k.shape[2]
    cache = _q_update(cache, layer, k, v, k_raw)
    if t > 1 and not w:  # a prompt: one float layer (sinks over their slots) for the blocked prefill attention
        seen = None if cache.written else t  # an unwritten cache holds this prompt only, in its first T slots
        k_deq, v_deq = _with_sinks(cache, layer, *_q_read(cache, layer, seen))
        k_half = k_deq.astype(q.dtype)
        if flash_ok(q, k_half):  # a GPU's: cuDNN's flash attention over the layer in q's half precision
            k_deq, v_deq = k_half, v_deq.astype(q.dtype)
        # (no window: the mask, causal, already leaves out every slot after the query's)
        return layer_attention(q, k_deq[None], v_deq[None], 0, mask[:, :, :k_deq.shape[2]]), cache
    query_slots = slots(cache, t)
    plan = cache.plan if cache.plan is not None else step_plan(cache, mask)
    quantized = plan.store_allowed
    float_parts, sinks_seen = [], None
    path = _store_path(cache, q) if t == 1 else None
    if cache.sink_slot is not None:
        sinks = (cache.k_sink[layer], cache.v_sink[layer], plan.sinks_seen)
        if not w and (path in ("pallas", "hopper") or (path == "native" and cache.k_sink.dtype == jnp.float32)):
            # the kernel reads the sinks with the store in one softmax (the Mosaic GPU kernel: in its splits' merge)
            sinks_seen = sinks[2][:, 0]
        else:
            float_parts.append(sinks)
    if w:
        float_parts.append(_window_part(cache, layer, k, v, mask, query_slots))
        cache = _write_window(cache, layer, k, v, query_slots)
    # the GPU kernels' merge writes q's dtype where nothing is merged after it (a conversion's launch less)
    out_dtype = q.dtype if not float_parts else jnp.float32
    store = None if path is None else _kernel_store_part(cache, layer, q, plan, path, sinks_seen, out_dtype)
    if store is None:
        k_deq, v_deq = _q_read(cache, layer)
        return split_attention(q, [(k_deq, v_deq, quantized)] + float_parts), cache
    if not float_parts:
        return store[0].astype(q.dtype), cache
    out, _ = merge_attention(store, split_attention(q, float_parts, with_lse=True))
    return out.astype(q.dtype), cache


def _with_sinks(cache: QuantKVCache, layer: int, k_deq, v_deq):
    """The dequantized layer [B, KV, S, D] with the float sinks written over the slots they hold: one float layer
    that a prompt's queries attend to in one blocked attention (the native kernel on a CPU), where XLA's split
    attention over the store and the sinks materialized the [T, S] scores (3-4x the float cache's prefill time at
    2K-4K tokens)."""
    if cache.sink_slot is None:
        return k_deq, v_deq
    key_slots = jnp.arange(k_deq.shape[2], dtype=jnp.int32)  # the first slots (all max_len, or a fresh prompt's)
    for n in range(cache.sink_slot.shape[1]):
        at = (cache.sink_slot[:, n, None] == key_slots[None, :])[:, None, :, None]  # [B, 1, S, 1]; -1 matches none
        k_deq = jnp.where(at, cache.k_sink[layer][:, :, n, None].astype(k_deq.dtype), k_deq)
        v_deq = jnp.where(at, cache.v_sink[layer][:, :, n, None].astype(v_deq.dtype), v_deq)
    return k_deq, v_deq


def _window_part(cache: QuantKVCache, layer: int, k, v, mask, query_slots):
    """The float window before this step plus this step's K/V as an attention part (k, v, mask [B, T, W + T])."""
    w = cache.spec.window
    ring_slots = _window_slots(cache)
    ring_idx = ring_slots % w
    k_ring, v_ring = cache.k_win[layer][:, :, ring_idx], cache.v_win[layer][:, :, ring_idx]
    f_slots = jnp.concatenate([ring_slots, query_slots])  # [W + T]
    seen = jnp.take(mask, jnp.clip(f_slots, 0, cache.max_len - 1), axis=2)  # causal & valid & sliding
    f_ok = (f_slots >= 0)[None, :] & (query_slots[:, None] - f_slots[None, :] < w)
    return (jnp.concatenate([k_ring, k.astype(k_ring.dtype)], 2),
            jnp.concatenate([v_ring, v.astype(v_ring.dtype)], 2), seen & f_ok[None])


def _write_window(cache: QuantKVCache, layer: int, k, v, query_slots) -> QuantKVCache:
    """The ring keeps this step's last min(T, W) tokens (unique ring indices, so no write order issue)."""
    w, t = cache.spec.window, k.shape[2]
    n = min(t, w)
    new_idx = query_slots[t - n:] % w
    return dataclasses.replace(
        cache,
        k_win=cache.k_win.at[layer, :, :, new_idx].set(jnp.moveaxis(k[:, :, t - n:], 2, 0).astype(cache.k_win.dtype)),
        v_win=cache.v_win.at[layer, :, :, new_idx].set(jnp.moveaxis(v[:, :, t - n:], 2, 0).astype(cache.v_win.dtype)),
    )


def kernel_reads_store(spec: kvspec.KVSpec, head_dim: int, dtype) -> tuple[bool, str]:
    """(True, "") when the Pallas decode kernel can read a store of this setting, else (False, why)."""
    if not spec.per_channel_keys:
        return False, "per-token keys (the kernel folds a per-channel key grid)"
    if spec.n_outliers(head_dim):
        return False, "sparse outliers (the kernel reads dense codes only)"
    return kv_kernels.can_use(head_dim, spec.bits, dtype, rope=spec.pre_rope)


# The most the kept cos/sin tables may add to a store's bytes per token (codes alone): they buy ~6 % of a
# SmolLM2 decode step at 1K slots (+2 % bytes at int8, +4 % at int4); a cache is made for its bytes.
TABLE_SHARE_MAX = 0.05


def tables_are_cheap(num_layers: int, kv_heads: int, bits: int) -> bool:
    """Whether a pre-RoPE store keeps its slots' cos/sin: 4 x D bytes per token (float32, D / 2 each) against
    the codes' 2 x layers x heads x D x bits / 8, at most :data:`TABLE_SHARE_MAX` of them."""
    return 16 <= TABLE_SHARE_MAX * num_layers * kv_heads * bits


def native_reads_store(spec: kvspec.KVSpec, head_dim: int) -> bool:
    """Whether the native CPU kernel (``native.kv_store_attention``) reads a store of this setting where
    it runs (traced for a CPU, native kernels on, no Pallas kernels: interpret mode keeps those)."""
    return (kernel_config.target_backend() == "cpu" and not kernel_config.kernels_available() and native.enabled()
            and spec.bits in (4, 8) and spec.per_channel_keys and not spec.n_outliers(head_dim) and head_dim % 2 == 0)


def store_path(spec: kvspec.KVSpec, head_dim: int, q_dtype, query_rows: int, slots: int) -> str | None:
    """How a one-token step reads the quantized store: "native" (the CPU kernel), "pallas" (the decode
    kernel), "xla" (XLA's dots over the codes, :mod:`llmeq_jax.kv.store_attention`), "hopper" (the Mosaic GPU
    kernel, :mod:`pallas_kernels.kv_attention_hopper`) or None (dequantize the layer, then attend).

    On a CPU the native kernel wherever it reads the setting (pre-RoPE keys too): XLA's dequantized copy
    of every layer made a quantized cache decode at 0.40-0.61x the float cache's speed there (rtn-w4-g128
    weights, 1024 cached tokens, docs/kv-cache.md).

    The kernel where it runs and takes the setting, unless the dispatch table measured XLA's dots
    faster on this device (kernel ``kv_attention``; ``query_rows`` = query heads per KV head times
    the batch, ``slots`` the cache's length, or the nearest length measured within a factor of 8);
    XLA's dots also where no kernel runs on a GPU (kernels disabled). They need what the kernel's
    folding needs, and post-RoPE keys.

    The Mosaic GPU kernel (int8 / int4 stores, head_dim 128, half queries, on Hopper) only where the table measured
    it faster than the path it replaces: kernel ``kv_attention_hopper`` for post-RoPE keys (its "xla_s" the faster
    of the two above), ``kv_attention_hopper_rope`` for pre-RoPE keys (its "xla_s" the Pallas kernel's, which
    rotates them as it does); not yet timed.
    """
    if native_reads_store(spec, head_dim):
        return "native"
    reads, _ = kernel_reads_store(spec, head_dim, q_dtype)
    if not reads:
        return None
    measured, kernel = _measured_store_path(spec.bits, head_dim, q_dtype, query_rows, slots), \
        kernel_config.kernels_available()
    hopper = _measured_store_path(spec.bits, head_dim, q_dtype, query_rows, slots, hopper_table_kernel(spec))
    codes = (1, 1, slots, head_dim * spec.bits // 8)  # the store's bytes a slot (int4: two codes a byte)
    if kernel and hopper == "pallas" and kv_hopper.can_use((1, 1, head_dim), q_dtype, codes, spec.bits)[0]:
        return "hopper"
    if not spec.pre_rope and (measured == "xla" or (not kernel and kernel_config.target_backend() == "gpu")):
        return "xla"
    return "pallas" if kernel else None


def hopper_table_kernel(spec: kvspec.KVSpec) -> str:
    """The dispatch table's kernel name for the Mosaic GPU kernel over this spec's store: pre-RoPE keys (rotated in
    the kernel) are timed apart from post-RoPE ones."""
    return "kv_attention_hopper_rope" if spec.pre_rope else "kv_attention_hopper"


# Cache lengths a measurement of another length stands in for, nearest first (powers of two): the two paths' ratio
# moves slowly with the length, and the benchmark times a few lengths only (4K and 32K).
_NEIGHBOUR_LENGTHS = (1, 2, 1 / 2, 4, 1 / 4, 8, 1 / 8)


def rotates(cache, q, positions) -> bool:
    """Whether :func:`attend` should be handed the step's q and k before RoPE (``rope=``): a float cache's decode
    step through the kernel, which rotates them itself, where the model passes RoPE tables (computed once a step)
    and the setting ``append_decode_attention:rope`` is not "xla". Why: XLA's rotation was a launch of its own
    between the q/k/v product and the kernel, every layer (deviceless H100 compile, Llama-2-7B, rtn-w4-g128's
    word kernels: 7 launches a layer, 6 without it)."""
    return (isinstance(positions, RopeTables) and isinstance(cache, KVCache) and float_path(cache, q) == "pallas"
            and _rotates_in_kernel(q))


def _rotates_in_kernel(q) -> bool:
    """The kernel's own conditions on a pre-RoPE step (a half of each head a dot of its own) and the setting."""
    from pallas_kernels import common, settings

    return (q.shape[-1] // 2 >= common.MIN_DOT
            and settings.of("append_decode_attention", q.shape[0]).rope != "xla")


def float_path(cache: KVCache, q) -> str:
    """How a float cache's step of queries q [B, T, H, D] writes and attends: "pallas" (one kernel,
    ``pallas_kernels.decode_attention``: the token's key and value written in place, the slots up to it read)
    or "xla" (a dynamic-update-slice per cache, then :func:`layer_attention`).

    The kernel for one-token steps on a GPU where it takes the shapes and the dispatch table measured it faster
    than XLA's path (kernel ``kv_attention`` at the cache's width, 16 or 32 bits: ``scripts/bench_kernels.py``'s
    float rows), or measured neither there and the kernel passed its gpu cases on a GPU
    (``pallas_kernels.hardware_checked``: not yet); XLA's path was six launches a layer (deviceless H200 compile,
    Llama-2-7B shapes), the kernel's two. Interpret mode keeps XLA's path (the CPU tests' models stay fast; tests
    force the kernel)."""
    if q.shape[1] != 1 or not (kernel_config.on_gpu() and kernel_config.kernels_available()):
        return "xla"
    b, _, h, d = q.shape
    if not float_kernel.can_use((b, h, d), q.dtype, cache.k.shape, cache.k.dtype)[0]:
        return "xla"
    bits = 8 * jnp.dtype(cache.k.dtype).itemsize
    measured = _measured_store_path(bits, d, q.dtype, b * h // cache.k.shape[2], cache.max_len)
    if measured is None:
        return "pallas" if hardware_checked.allowed("append_decode_attention") else "xla"
    return measured


def _measured_store_path(bits: int, head_dim: int, q_dtype, query_rows: int, slots: int,
                         kernel: str = "kv_attention") -> str | None:
    """The dispatch table's faster path ("pallas" / "xla") for a cache of ``bits`` (4 / 8: a quantized store, 16 /
    32: a float cache), measured at this cache length's bucket or the nearest measured one within a factor of 8;
    None where nothing near was measured. ``kernel``: the table kernel (``kv_attention_hopper``: the Mosaic GPU
    kernel against the faster of the other two)."""
    bucket = dispatch_table.row_bucket(slots)
    for factor in _NEIGHBOUR_LENGTHS:
        n = int(bucket * factor)
        if n < 1:
            continue
        key = dispatch_table.Key(kernel_config.target_device().device_kind, kernel, bits, None, head_dim, n,
                                 dispatch_table.row_bucket(query_rows), jnp.dtype(q_dtype).name)
        measured = dispatch_table.choice(key)
        if measured is not None:
            return measured
    return None


def _store_path(cache: QuantKVCache, q) -> str | None:
    """:func:`store_path` of this cache for a one-token step of queries q [B, 1, H, D]."""
    b, n_heads, d = q.shape[0], q.shape[2], q.shape[3]
    return store_path(cache.spec, d, q.dtype, b * n_heads // cache.k.q.shape[2], cache.max_len)


def _kernel_store_part(cache: QuantKVCache, layer: int, q, plan: StepPlan, path: str, sinks_seen=None,
                       out_dtype=jnp.float32):
    """(out [B, 1, H, D], lse [B, 1, H]) of one query over the quantized store by ``path``
    (:func:`store_path`: the native kernel, the Pallas decode kernel or XLA's dots over the codes).

    Each reads the codes where they lie instead of writing a dequantized float copy of the whole
    layer every step. ``plan``: the step's (the slots to read, to scan). ``sinks_seen`` [B, N] (the native, Pallas
    and Mosaic GPU kernels): the float sinks of this layer seen by each row, read by the kernel in the same softmax
    or merged with its splits (on a GPU the float attention over the sinks and its merge with the store's were ~5
    launches a layer). ``out_dtype``: the GPU kernels' output (XLA's and the native kernel's is float32).
    """
    bits, b, n_heads, d = cache.spec.bits, q.shape[0], q.shape[2], q.shape[3]
    quantized, scan = plan.store_allowed, plan.scan
    # the GPU kernels read the layer's key grid from every layer's in place; XLA and the native kernel take it
    grid = _key_grids(cache) if path in ("pallas", "hopper") else _key_grid(cache, layer)[:2]
    args = (q.reshape(b, n_heads, d), cache.k.q, cache.v.q, *grid, cache.v.scale, cache.v.lo, scan)
    rope = dict(slot_pos=cache.slot_pos, inv_freq=cache.inv_freq) if cache.spec.pre_rope else {}
    if path == "xla":  # post-RoPE keys, one layer's key grid
        out, lse = store_attention(*args, bits=bits, allowed=quantized[:, 0], layer=layer)
        return out[:, None], lse[:, None]
    if path == "hopper":  # the Pallas kernel's contract; the step's one-byte mask (no length: it says it all)
        sinks = None if sinks_seen is None else (cache.k_sink, cache.v_sink, sinks_seen)
        out, lse = kv_hopper.kv_attention_hopper(*args[:-1], None, bits=bits, allowed=plan.store_bytes, layer=layer,
                                                 sinks=sinks, out_dtype=out_dtype, **rope)
        return out[:, None], lse[:, None]
    if path == "native":
        tables = None
        if cache.spec.pre_rope:  # cos/sin of every slot's position: kept with the slots, or computed here
            tables = (cache.rope_cos, cache.rope_sin) if cache.rope_cos is not None else \
                rope_tables(cache.slot_pos, cache.inv_freq)
        extra = None if sinks_seen is None else (cache.k_sink, cache.v_sink, sinks_seen)
        out, lse = native.kv_store_attention(*args, bits=bits, layer=layer, allowed=quantized[:, 0], rope_tables=tables,
                                             extra=extra)
        return out[:, None], lse[:, None]
    # The kernel reads the layer from the stacked store (layer= may be traced: the scan over stacked
    # blocks); slicing it out here would copy the layer's whole store for the custom call every step.
    sinks = None if sinks_seen is None else (cache.k_sink, cache.v_sink, sinks_seen)
    out, lse = kv_kernels.store_decode_attention(*args, bits=bits, allowed=quantized[:, 0], layer=layer, sinks=sinks,
                                                 out_dtype=out_dtype, **rope)
    return out[:, None], lse[:, None]


def _sinks_seen(cache: QuantKVCache, mask: jax.Array, query_slots: jax.Array):
    """(which float sinks each query sees [B, T, N], which slots are sinks [B, S]).

    A sink is seen where its slot is (causal, valid, sliding window) and not already read
    from the float window; unwritten sinks (slot -1) are not seen.
    """
    sink_slot = cache.sink_slot  # [B, N]
    b, t, n = mask.shape[0], query_slots.shape[0], sink_slot.shape[1]
    key_slots = jnp.arange(cache.max_len, dtype=jnp.int32)
    is_sink = jnp.any(sink_slot[:, :, None] == key_slots[None, None, :], axis=1)
    seen = jnp.take_along_axis(mask, jnp.broadcast_to(jnp.clip(sink_slot, 0)[:, None, :], (b, t, n)), axis=2)
    outside_window = query_slots[None, :, None] - sink_slot[:, None, :] >= cache.spec.window
    return seen & (sink_slot >= 0)[:, None, :] & outside_window, is_sink


def step_plan(cache: QuantKVCache, mask: jax.Array) -> StepPlan:
    """The :class:`StepPlan` of a step of T tokens with attention mask ``mask`` [B, T, max_len] (causal, valid,
    sliding window) into ``cache`` (its new slots marked valid already: :func:`append_mask`)."""
    t = mask.shape[1]
    query_slots = slots(cache, t)
    key_slots = jnp.arange(cache.max_len, dtype=jnp.int32)
    allowed = mask & ~(query_slots[:, None] - key_slots[None, :] < cache.spec.window)[None]  # not in the window
    seen = targets = None
    if cache.sink_slot is not None:
        seen, is_sink = _sinks_seen(cache, mask, query_slots)
        allowed = allowed & ~is_sink[:, None, :]
        targets = _sink_targets(cache, t)
    # Slots past query - window are never read from the store: a one-token step scans only up to there.
    scan = jnp.maximum(cache.length + 1 - cache.spec.window, 0).astype(jnp.int32)
    store_bytes = allowed[:, 0].astype(jnp.int8) if t == 1 else None
    return StepPlan(allowed, scan, seen, targets, store_bytes)


def with_step_plan(cache, mask: jax.Array | None):
    """``cache`` with the :class:`StepPlan` of a step under ``mask`` (None: without one), for the layers of a scan
    over stacked blocks to share; other caches (float, none) as they are. A prompt's (T > 1) attention without a
    float window does not read it."""
    if not isinstance(cache, QuantKVCache):
        return cache
    return dataclasses.replace(cache, plan=None if mask is None else step_plan(dataclasses.replace(cache, plan=None),
                                                                                 mask))


# --------------------------------------------------------------------------- online key ranges across requests


def track_key_ranges(kv: kvspec.KVQuantizer, cache) -> kvspec.KVQuantizer:
    """The quantizer with its running key range set to the ranges an online cache used (mean over rows).

    Those already are ``ema * running + (1 - ema) * prompt``, so calling this after every
    request keeps an exponential moving average of the prompts' key ranges.
    """
    if not kv.spec.online_keys:
        raise kvspec.KVSpecError("track_key_ranges is for key_range='online' caches")
    return kvspec.KVQuantizer(kvspec.KeyRanges(jnp.mean(cache.k_lo, axis=1), jnp.mean(cache.k_hi, axis=1)), kv.spec)
