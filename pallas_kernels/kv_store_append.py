"""A decode step's key and value quantized and written into the quantized KV store in one kernel, in place.

Why: through XLA a one-token write into ``llmeq_jax.kv.cache.QuantKVCache``'s store -- the key on its
per-channel grid, the value on its own float16 min/max grid, four dynamic-update-slices (key codes, value codes,
value scale, value min) -- is ~10 small launches a layer on a GPU (deviceless H200 compile, Llama-2-7B shapes,
``scripts/gpu_aot.py``: reductions, converts, selects and the slices), each a few microseconds of a step whose
useful work there is nanoseconds. Here it is one launch.

Grid (batch, kv head): a program quantizes its head's key and value and writes the codes (int4 packed two to a
byte along the head dim, ``core.qarray.pack``'s order) and the value's grid at the step's slot of the stacked
store; the outputs alias the store's inputs, as XLA's dynamic-update-slices did. The math is bit for bit
``kv.grid.quantize_per_channel`` and ``kv.grid.quantize_per_token`` (no outliers): the value grid rounded to the
store's dtype with the low end rounded down and the scale up (``kv.grid.grid_from_range``), the codes
``clip(round((x - lo) / scale), 0, 2^bits - 1)`` with ties to even (an IEEE division: ``common.div_rn``), shifted
into the signed range.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from llmeq_jax.core.qarray import int_range
from pallas_kernels import config
from pallas_kernels.common import FLOAT_DTYPES, check_int_scalar, compiler_params, div_rn, is_pow2, pack_nibbles, \
    round_half_even, split_pairs

SUPPORTED_BITS = (4, 8)
GRID_DTYPES = (jnp.float16, jnp.float32)
_F16_TINY = float(jnp.finfo(jnp.float16).tiny)  # the smallest scale kv.grid lets a grid have


def can_use(head_dim: int, bits: int, dtype) -> tuple[bool, str]:
    """(True, "") when the kernel writes a store of ``bits`` with keys / values of ``dtype`` and ``head_dim``."""
    if bits not in SUPPORTED_BITS:
        return False, f"{bits}-bit codes (the kernel writes {SUPPORTED_BITS})"
    if not (is_pow2(head_dim) and 16 <= head_dim <= 256):
        return False, f"head_dim {head_dim} is not a power of two in [16, 256]"
    if jnp.dtype(dtype) not in FLOAT_DTYPES:
        return False, f"keys / values of dtype {jnp.dtype(dtype).name} (float32/bfloat16/float16)"
    return True, ""


def _next_float16(x16, up: bool):
    """The float16 next to ``x16`` (finite) toward +inf (``up``) or -inf: ``jnp.nextafter``, which the Triton
    lowering has for float32 only, on the bit pattern (sign and magnitude, as int16)."""
    b = jax.lax.bitcast_convert_type(x16, jnp.int16)
    if up:  # only for positive scales
        return jax.lax.bitcast_convert_type(b + 1, jnp.float16)
    smallest_below_zero = jnp.int16(-32767)  # 0x8001: -2^-24
    down = jnp.where(x16 > 0, b - 1, jnp.where(x16 < 0, b + 1, smallest_below_zero))
    return jax.lax.bitcast_convert_type(down.astype(jnp.int16), jnp.float16)


def _grid(lo, hi, levels: int, interpreted: bool):
    """``kv.grid.grid_from_range(lo, hi, bits, float16)``: (scale, lo) as float32 holding float16 values (the
    store may hold them as float32; the grid is float16's whatever it is stored as, as XLA's path writes it)."""
    lo16 = lo.astype(jnp.float16)
    lo_s = jnp.where(lo16.astype(jnp.float32) > lo, _next_float16(lo16, up=False), lo16).astype(jnp.float32)
    span = hi - lo_s
    scale = jnp.maximum(jnp.where(span > 0, div_rn(span, jnp.float32(levels), interpreted), 1.0), _F16_TINY)
    s16 = scale.astype(jnp.float16)
    return jnp.where(s16.astype(jnp.float32) < scale, _next_float16(s16, up=True), s16).astype(jnp.float32), lo_s


def _codes(x, scale, lo, bits: int, interpreted: bool):
    """``kv.grid.quantize_grid`` then ``qarray.pack`` along the row: int8 codes, or int4 pairs as uint8 bytes."""
    qmin, _ = int_range(bits)
    c = jnp.clip(round_half_even(div_rn(x - lo, scale, interpreted)), 0, 2**bits - 1).astype(jnp.int32) + qmin
    if bits == 8:
        return c.astype(jnp.int8)
    return pack_nibbles(*split_pairs(c)).astype(jnp.uint8)


def _kernel(*refs, kv: int, bits: int, per_row_keys: bool, stacked: bool, grid_stacked: bool, interpreted: bool,
            sinks: int, rotated_row: int):
    refs = list(refs)
    at = (refs.pop(0)[0],) if stacked else ()  # the layer of a stacked store, written in place
    slot_ref, new_ref, ks_ref, kl_ref = refs[:4]
    sink_at_ref = refs[4] if sinks else None
    kc_out, vc_out, vs_out, vl_out = refs[-6:-2] if sinks else refs[-4:]
    b, h = pl.program_id(0), pl.program_id(1)
    slot = jnp.minimum(slot_ref[0], kc_out.shape[-2] - 1)  # as XLA's dynamic-update-slice clamps its start
    key = plgpu.load(new_ref.at[b, pl.ds(h, 1), :]).astype(jnp.float32)  # (1, D)
    value = plgpu.load(new_ref.at[b, pl.ds(kv + h, 1), :]).astype(jnp.float32)
    g = (*(at if grid_stacked else ()), b if per_row_keys else jnp.int32(0))  # the key grid's (layer,) row
    k_scale, k_lo = plgpu.load(ks_ref.at[(*g, pl.ds(h, 1), slice(None))]), \
        plgpu.load(kl_ref.at[(*g, pl.ds(h, 1), slice(None))])
    v_scale, v_lo = _grid(jnp.min(value, axis=1, keepdims=True), jnp.max(value, axis=1, keepdims=True), 2**bits - 1,
                          interpreted)
    row = (*at, b, h, pl.ds(slot, 1), slice(None))
    plgpu.store(kc_out.at[row], _codes(key, k_scale, k_lo, bits, interpreted))
    plgpu.store(vc_out.at[row], _codes(value, v_scale, v_lo, bits, interpreted))
    plgpu.store(vs_out.at[row], v_scale.astype(vs_out.dtype))
    plgpu.store(vl_out.at[row], v_lo.astype(vl_out.dtype))
    if sinks:  # a token at a position < N also goes to the float sink store, its key after RoPE
        ks_out, vs_sink_out = refs[-2:]
        n = sink_at_ref[b]
        write = jnp.broadcast_to(n < sinks, (1, key.shape[1]))
        sink_row = (*at, b, h, pl.ds(jnp.minimum(n, sinks - 1), 1), slice(None))
        rotated = plgpu.load(new_ref.at[b, pl.ds(rotated_row + h, 1), :])
        plgpu.store(ks_out.at[sink_row], rotated.astype(ks_out.dtype), mask=write)
        # the value as loaded, widened to float32 above: narrowing it again is exact
        plgpu.store(vs_sink_out.at[sink_row], value.astype(vs_sink_out.dtype), mask=write)


def store_append(k_codes, v_codes, v_scale, v_lo, k, v, k_scale, k_lo, slot, *, bits: int, layer=None, sinks=None,
                 interpret: bool | None = None):
    """One token's key and value per row quantized into the store at ``slot``: -> ``(k_codes, v_codes, v_scale,
    v_lo)`` updated in place (the outputs alias those inputs).

    k, v ``[B, KV, D]`` (or ``[B, KV, 1, D]``); k_scale, k_lo the per-channel key grid ``[1 or B, KV, D]`` (or with
    a 1 before D) -- or, with ``layer``, every layer's grid ``[L, 1 or B, KV, 1, D]``, read at ``layer`` in place
    (the slice was a launch of its own every layer); codes ``[L, B, KV, S, D or D / 2]`` with ``layer`` (an
    integer scalar, may be traced) or ``[B, KV, S, ...]`` without; value grids the codes' shape with a last dim
    of 1, float16 or float32; ``slot`` an integer scalar (clamped into the store, as XLA's dynamic-update-slice
    clamps). The arguments of ``native.kv_store_append`` for a one-token step, the same bits written.

    ``sinks``: optional ``(k_sink, v_sink, at, k_rotated)``, the cache's float sink stores (the codes' lead dims, N
    tokens, D; returned updated in place after the four) with ``at`` [B] int32, the sink index of each row's token
    (N or more: not a sink), and ``k_rotated`` the keys after RoPE (as ``k``; None: ``k`` itself): the token's key
    and value written there too, in the stores' dtype, as ``kv.cache``'s scatter writes them."""
    stacked = layer is not None
    lead = 5 if stacked else 4
    if k.ndim == 4:
        if k.shape[2] != 1 or v.shape != k.shape:
            raise ValueError(f"store_append: one token a row, k / v [B, KV, 1, D]; got {k.shape} / {v.shape}")
        k, v = k[:, :, 0], v[:, :, 0]
    if k.ndim != 3 or v.shape != k.shape:
        raise ValueError(f"store_append: k and v must be [B, KV, D] (or [B, KV, 1, D]), got {k.shape} / {v.shape}")
    bsz, kv, d = k.shape
    ok, why = can_use(d, bits, k.dtype)
    if not ok:
        raise ValueError(f"store_append: {why}")
    row = d if bits == 8 else d // 2
    code_dtype = jnp.int8 if bits == 8 else jnp.uint8
    if k_codes.ndim != lead or k_codes.shape[-4:] != (bsz, kv, k_codes.shape[-2], row) \
            or k_codes.dtype != code_dtype or v_codes.shape != k_codes.shape or v_codes.dtype != code_dtype:
        want = ("[L, " if stacked else "[") + f"{bsz}, {kv}, S, {row}] {jnp.dtype(code_dtype).name}"
        raise ValueError(f"store_append: codes must be {want} for {bits}-bit rows of {d} values, got "
                         f"{k_codes.dtype} {k_codes.shape} / {v_codes.dtype} {v_codes.shape}")
    grid_shape = (*k_codes.shape[:-1], 1)
    if v_scale.shape != grid_shape or v_lo.shape != grid_shape or v_lo.dtype != v_scale.dtype \
            or jnp.dtype(v_scale.dtype) not in GRID_DTYPES:
        raise ValueError(f"store_append: value grids must be {grid_shape} float16/float32, got {v_scale.dtype} "
                         f"{v_scale.shape} / {v_lo.dtype} {v_lo.shape}")
    k_scale, k_lo = (jnp.asarray(a, jnp.float32) for a in (k_scale, k_lo))
    grid_stacked = stacked and k_scale.ndim == 5
    per_layer = k_scale.size // k_scale.shape[0] if grid_stacked else k_scale.size
    if per_layer not in (kv * d, bsz * kv * d) or k_lo.shape != k_scale.shape or (
            grid_stacked and k_scale.shape[0] != k_codes.shape[0]):
        raise ValueError(f"store_append: the key grid must be [1 or {bsz}, {kv}, {d}] (with layer=, or every layer's "
                         f"[L, 1 or {bsz}, {kv}, 1, {d}]), got {k_scale.shape} / {k_lo.shape}")
    lead_grid = (k_scale.shape[0],) if grid_stacked else ()
    k_scale, k_lo = (a.reshape(*lead_grid, -1, kv, d) for a in (k_scale, k_lo))
    for name, s in (("slot", slot), ("layer", layer)):
        if s is not None:
            check_int_scalar("store_append", name, s)
    at = [] if layer is None else [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))]
    # The key and value (and a rotated key for the sinks) as one operand: XLA makes it in the fusion that
    # finishes the q/k/v projection.
    parts, sink_args, n_sinks = [k, v], [], 0
    if sinks is not None:
        k_sink, v_sink, sink_at, k_rotated = sinks
        n_sinks = k_sink.shape[-2]
        if k_sink.shape != (*k_codes.shape[:-2], n_sinks, d) or v_sink.shape != k_sink.shape \
                or jnp.dtype(k_sink.dtype) not in FLOAT_DTYPES or jnp.shape(sink_at) not in ((bsz,), (bsz, 1)):
            raise ValueError(f"store_append: sinks must be stores {(*k_codes.shape[:-2], 'N', d)} float and indices "
                             f"[{bsz}], got {k_sink.dtype} {k_sink.shape} / {v_sink.shape} / {jnp.shape(sink_at)}")
        if k_rotated is not None:
            k_rotated = k_rotated[:, :, 0] if k_rotated.ndim == 4 else k_rotated
            if k_rotated.shape != k.shape:
                raise ValueError(f"store_append: the rotated keys must be shaped as k {k.shape}, got {k_rotated.shape}")
            parts.append(k_rotated.astype(k.dtype))
        sink_args = [jnp.reshape(sink_at, (bsz,)).astype(jnp.int32)]
    new = jnp.concatenate(parts, axis=1)
    stores = [k_codes, v_codes, v_scale, v_lo] + ([k_sink, v_sink] if sinks is not None else [])
    args = [*at, jnp.reshape(jnp.asarray(slot, jnp.int32), (1,)), new, k_scale, k_lo, *sink_args, *stores]
    first = len(args) - len(stores)
    interpret = config.resolve_interpret(interpret)
    kernel = functools.partial(_kernel, kv=kv, bits=bits, per_row_keys=k_scale.shape[-3] == bsz and bsz > 1,
                               stacked=stacked, grid_stacked=grid_stacked, interpreted=interpret, sinks=n_sinks,
                               rotated_row=2 * kv if len(parts) == 3 else 0)
    return pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in stores),
        grid=(bsz, kv),
        input_output_aliases={first + i: i for i in range(len(stores))},
        compiler_params=compiler_params(1, 1),
        interpret=interpret,
        name=f"kv_store_append_int{bits}",
    )(*args)


def store_append_reference(k_codes, v_codes, v_scale, v_lo, k, v, k_scale, k_lo, slot, *, bits: int, layer=None,
                           sinks=None):
    """Pure-jnp reference: ``kv.grid``'s quantizers and a dynamic-update-slice per array (the sinks: a scatter)."""
    from llmeq_jax.kv import grid as kvgrid

    k = k if k.ndim == 4 else k[:, :, None]
    v = v if v.ndim == 4 else v[:, :, None]
    d = k.shape[-1]
    if layer is not None and jnp.ndim(k_scale) == 5:  # every layer's grid: this layer's
        k_scale, k_lo = k_scale[layer], k_lo[layer]
    ks, kl = (jnp.asarray(a, jnp.float32).reshape(-1, k.shape[1], 1, d) for a in (k_scale, k_lo))
    keys = kvgrid.quantize_per_channel(k, ks, kl, None, bits, 0)
    values = kvgrid.quantize_per_token(v, bits, 0)
    start = (0, 0, slot, 0) if layer is None else (layer, 0, 0, slot, 0)

    def put(a, new):
        new = new.astype(a.dtype)
        return jax.lax.dynamic_update_slice(a, new if layer is None else new[None], start)

    out = (put(k_codes, keys.q), put(v_codes, values.q), put(v_scale, values.scale.astype(v_scale.dtype)),
           put(v_lo, values.lo.astype(v_lo.dtype)))
    if sinks is None:
        return out
    k_sink, v_sink, sink_at, k_rotated = sinks
    k_rotated = k if k_rotated is None else (k_rotated if k_rotated.ndim == 4 else k_rotated[:, :, None])
    rows, at = jnp.arange(k.shape[0]), jnp.reshape(sink_at, (-1,))

    def scatter(stack, new):  # stack [(L,) B, KV, N, D] <- new [B, KV, 1, D] at (layer, row, :, at[row]); N+: dropped
        new = new[:, :, 0].astype(stack.dtype)
        if layer is None:
            return stack.at[rows, :, at].set(new, mode="drop")
        return stack.at[layer, rows, :, at].set(new, mode="drop")

    return (*out, scatter(k_sink, k_rotated), scatter(v_sink, v))


__all__ = ["SUPPORTED_BITS", "can_use", "store_append", "store_append_reference"]
