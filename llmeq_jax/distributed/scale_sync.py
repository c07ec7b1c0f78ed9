"""Quantizing sharded weights under ``shard_map`` with scales synchronised across devices,
and online (EMA) activation scales kept equal on every shard.

Which collective synchronises a scale (DESIGN §4)
  A weight ``x`` sharded along dim ``d`` into ``k`` shards of length ``L`` and
  a spec whose tile along ``d`` is ``t`` fall into one of three cases
  (:func:`scale_sync_plan` names them per dim):

  ``local``    ``L % t == 0``: every tile (a channel, ``t == 1``, or a group
               lying inside one shard) is whole on one device, so its range is
               complete there -- **no collective**. The scale stays sharded
               like the values. With ``replicate_scales=True`` the per-shard
               scales are kept and then ``all_gather``-ed so every device holds
               all of them (e.g. for a consumer that wants the whole scale).
  ``reduce``   ``t == n`` (per-tensor, or per-channel where ``d`` is the
               reduced axis): each shard holds a slice of the one tile, so the
               range is combined with ``pmax`` of the absmax (symmetric) or
               ``pmin``/``pmax`` of min/max (asymmetric). The scale is
               replicated along ``d``.
  ``straddle`` ``1 < t < n`` and ``L % t != 0``: a group crosses a shard
               boundary. Each shard reduces its part of every *global* group
               (``segment_max``/``segment_min`` with global group ids; groups it
               does not touch give the reduction's identity), then
               ``pmax``/``pmin`` completes them. The scale is replicated along ``d``.

  Max and min are exact in floating point, so the synchronised scale -- and
  with it every rounded value -- is bit-identical to quantizing the unsharded
  array. MSE and percentile clipping are not reductions; they are allowed
  only where every tile is ``local``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llmeq_jax.core.qarray import QArray, is_qarray, pack
from llmeq_jax.core import ema
from llmeq_jax.core.quantize import (Spec, _parse_clip, compute_scale, quantize_values, scale_from_range, storable_scale,
                                     tile_for, tile_reduce)
from llmeq_jax.core.rules import map_rules, static_act_scale
from llmeq_jax.distributed.mesh import DATA, DistributedError, axis_size, global_array, mesh_axes, pspec_entries, to_host
from llmeq_jax.distributed.sharding import param_partition, qarray_partitions, shard_params


@dataclasses.dataclass(frozen=True)
class DimPlan:
    """How dim ``d`` of a sharded weight gets its scale: ``none`` (not split), ``local``, ``reduce`` or ``straddle``."""

    kind: str
    axes: tuple[str, ...]
    shards: int
    local: int  # shard length
    tile: int  # elements per scale along the dim (global)


def scale_sync_plan(spec: Spec, shape: tuple[int, ...], pspec: P, mesh: Mesh) -> tuple[DimPlan, ...]:
    """Per dim, which of the cases in the module docstring applies (and so which collective)."""
    tile = tile_for(spec, shape)
    out = []
    for d, (n, t, e) in enumerate(zip(shape, tile, pspec_entries(pspec, len(shape)))):
        k = axis_size(mesh, e)
        if k > 1 and n % k:
            raise DistributedError(f"dim {d} of size {n} cannot be split into {k} shards over {e}")
        local = n // k
        if k == 1:
            kind = "none"
        elif t == n:
            kind = "reduce"
        elif local % t == 0:
            kind = "local"
        else:
            kind = "straddle"
        out.append(DimPlan(kind, mesh_axes(e), k, local, t))
    return tuple(out)


def _segment_reduce(a: jax.Array, d: int, plan: DimPlan, n: int, op: str) -> jax.Array:
    """Reduce the per-element dim ``d`` of this shard into the *global* groups it overlaps."""
    offset = jax.lax.axis_index(plan.axes) * plan.local
    ids = (offset + jnp.arange(plan.local)) // plan.tile
    groups = -(-n // plan.tile)
    seg = jax.ops.segment_max if op == "max" else jax.ops.segment_min
    r = seg(jnp.moveaxis(a, d, 0), ids, num_segments=groups, indices_are_sorted=True)
    return jnp.moveaxis(r, 0, d)


def _local_scale(xl: jax.Array, spec: Spec, shape: tuple[int, ...], plans: tuple[DimPlan, ...]):
    """(scale, zero_point) of the tiles this shard touches, synchronised across shards where tiles cross them."""
    kind, ratio = _parse_clip(spec.clip)
    crossing = [p for p in plans if p.kind in ("reduce", "straddle")]
    # Tile of the local reduction: whole local tiles; the whole shard along `reduce` dims;
    # element-wise along `straddle` dims (grouped afterwards with global group ids).
    ltile = tuple(
        p.local if p.kind == "reduce" else 1 if p.kind == "straddle" else p.tile for p in plans
    )
    if not crossing:
        return compute_scale(xl, spec, ltile)  # every tile is whole here: no collective at all
    if kind in ("mse", "percentile"):
        raise DistributedError(
            f"clip={spec.clip!r} is not a max/min reduction, so it cannot be synchronised across shards; "
            "shard the weight along a dim where its tiles are whole (or use clip=None / a ratio)"
        )
    if spec.symmetric:
        lo, hi = None, tile_reduce(xl, ltile, "absmax")
    else:
        lo, hi = tile_reduce(xl, ltile, "min"), tile_reduce(xl, ltile, "max")
    for d, p in enumerate(plans):
        if p.kind == "straddle":
            hi = _segment_reduce(hi, d, p, shape[d], "max")
            lo = None if lo is None else _segment_reduce(lo, d, p, shape[d], "min")
    axes = tuple(a for p in crossing for a in p.axes)
    # absmax / max -> pmax, min -> pmin: exact, so every shard gets the unsharded range.
    hi = jax.lax.pmax(hi, axes)
    lo = None if lo is None else jax.lax.pmin(lo, axes)
    if kind == "ratio":
        lo = None if lo is None else lo * ratio
        hi = hi * ratio
    return storable_scale(*scale_from_range(lo, hi, spec.bits, spec.symmetric), spec)


def _values_tile_and_scale(scale, plans):
    """Scale laid out over this shard's elements: straddle dims gathered per element with global group ids."""
    vtile = []
    for d, p in enumerate(plans):
        if p.kind == "straddle":
            offset = jax.lax.axis_index(p.axes) * p.local
            scale = jnp.take(scale, (offset + jnp.arange(p.local)) // p.tile, axis=d)
            vtile.append(1)
        elif p.kind == "reduce":
            vtile.append(p.local)
        else:
            vtile.append(p.tile)
    return scale, tuple(vtile)


def sharded_quantize_fn(
    spec: Spec, mesh: Mesh, pspec: P, shape: tuple[int, ...], *, replicate_scales: bool = False,
    pack_axis: int | None = None,
) -> tuple[Callable, int]:
    """(jitted ``x -> (qvalue, scale[, zero_point])`` over ``mesh``, pack axis) -- the engine of
    :func:`quantize_sharded`, exposed so its collectives can be inspected and timed."""
    shape = tuple(int(s) for s in shape)
    if pack_axis is None:
        pack_axis = (spec.axis if spec.axis is not None else spec.default_axis) if spec.granularity == "group" else 0
    pack_axis %= len(shape)
    return _sharded_quantize_fn(spec, mesh, P(*pspec_entries(pspec, len(shape))), shape, replicate_scales, pack_axis), pack_axis


@functools.lru_cache(maxsize=256)
def _sharded_quantize_fn(spec, mesh, pspec, shape, replicate_scales, pack_axis):
    tile = tile_for(spec, shape)
    plans = scale_sync_plan(spec, shape, pspec, mesh)
    qarray_partitions(shape, tile, spec.bits, pack_axis, pspec, mesh)  # checks packed dims split on whole bytes
    entries = pspec_entries(pspec, len(shape))
    # Out specs name every axis a value may vary over (size-1 axes included, as shard_map's
    # replication check wants): values like x; scales like x where tiles are whole per shard
    # ("none"/"local"), replicated where pmax/pmin (or all_gather) made them equal everywhere.
    vspec = P(*entries)
    keep = ("none",) if replicate_scales else ("none", "local")
    sspec = P(*[e if p.kind in keep else None for e, p in zip(entries, plans)])
    local_dims = [(d, p.axes) for d, p in enumerate(plans) if p.kind == "local"]

    def body(xl):
        scale, zp = _local_scale(xl, spec, shape, plans)
        s_el, vtile = _values_tile_and_scale(scale, plans)
        z_el = None if zp is None else _values_tile_and_scale(zp, plans)[0]
        q = pack(quantize_values(xl, s_el, z_el, spec.bits, vtile), spec.bits, pack_axis)
        if replicate_scales:
            # Per-shard scales are kept as computed, then gathered so every device holds them all.
            for d, axes in local_dims:
                scale = jax.lax.all_gather(scale, axes, axis=d, tiled=True, to="invarying")
                zp = None if zp is None else jax.lax.all_gather(zp, axes, axis=d, tiled=True, to="invarying")
        if zp is None:
            return q, scale.astype(jnp.float32)
        return q, scale.astype(jnp.float32), zp.astype(jnp.int8)

    out_specs = (vspec, sspec) if spec.symmetric else (vspec, sspec, sspec)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(pspec,), out_specs=out_specs))


def quantize_sharded(
    x: jax.Array,
    spec: Spec,
    mesh: Mesh,
    pspec: P,
    *,
    replicate_scales: bool = False,
    pack_axis: int | None = None,
    act_spec: Spec | None = None,
    act_scale: jax.Array | None = None,
) -> QArray:
    """Quantize ``x`` laid out as ``pspec`` on ``mesh``; bit-identical to ``quantize(x, spec)`` unsharded.

    Values stay sharded like ``x``; the scale (and zero point) is sharded where its tiles
    are whole per shard and replicated elsewhere (see :func:`scale_sync_plan`).
    ``replicate_scales`` all-gathers per-shard scales so every device holds all of them.
    ``x`` may be a global array already laid out on the mesh or a host array every process holds.
    """
    shape = tuple(int(s) for s in x.shape)
    if spec.grid != "uniform":  # the shard_map engine encodes uniform integers only
        raise DistributedError(f"sharded quantization supports uniform grids; got grid={spec.grid!r} "
                               "(quantize it unsharded with core.quantize.quantize, then shard the QArray)")
    fn, pack_axis = sharded_quantize_fn(spec, mesh, pspec, shape, replicate_scales=replicate_scales,
                                        pack_axis=pack_axis)
    want = NamedSharding(mesh, P(*pspec_entries(pspec, len(shape))))
    if not (isinstance(x, jax.Array) and x.sharding.is_equivalent_to(want, len(shape))):
        x = global_array(to_host(x) if isinstance(x, jax.Array) else np.asarray(x), want)
    out = fn(x)
    return QArray(
        qvalue=out[0],
        scale=out[1],
        zero_point=None if spec.symmetric else out[2],
        act_scale=act_scale,
        bits=spec.bits,
        shape=shape,
        tile=tile_for(spec, shape),
        dtype=jnp.dtype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.dtype(jnp.float32),
        pack_axis=pack_axis,
        act_spec=act_spec,
    )


def quantize_params_sharded(
    params: Any, recipe: Any, mesh: Mesh, stats: dict | None = None, partition: Callable = param_partition
) -> Any:
    """RTN over a param tree on ``mesh``: each kernel quantized where it lives with :func:`quantize_sharded`.

    Same rules walk and static activation scales as ``core.rules.quantize_params``. Leaves
    no rule quantizes are placed on the mesh too (``partition``), so the result is one
    tree of global arrays: it can be saved from every process (``checkpoint.save``).
    """
    def one(path, w, rule):
        act_scale = static_act_scale(path, stats, rule.act_clip, rule.act) if rule.act_static else None
        if act_scale is not None:
            act_scale = global_array(np.asarray(act_scale), NamedSharding(mesh, P()))
        q = quantize_sharded(
            w, rule.weight, mesh, partition(path, tuple(w.shape), mesh), act_spec=rule.act, act_scale=act_scale
        )
        # One collective program at a time: on the CPU backend, programs with collectives
        # dispatched back to back can interleave across device threads and deadlock in the
        # rendezvous when threads are few (seen on 2 cores with 2+ devices).
        return jax.block_until_ready(q)

    # map_rules checks every kernel is finite on the host; a kernel spread over several
    # processes is first gathered for that (quantize_sharded places it back).
    params = jax.tree_util.tree_map(
        lambda a: to_host(a) if isinstance(a, jax.Array) and not a.is_fully_addressable else a,
        params, is_leaf=is_qarray,
    )
    return shard_params(map_rules(params, recipe, one), mesh, partition)


# --------------------------------------------------------------------------- online activation scales


def online_quantize_synced(x, state=None, *, axis_name, alpha: float = 0.9, eps: float | None = None,
                           per_channel: bool = True, bits: int = 8):
    """EMA-tracked activation quantization inside ``shard_map`` with rows (tokens) split over ``axis_name``.

    One EMA observer step (range ``alpha * state + (1 - alpha) * max(absmax, eps)``): the step's absmax is
    ``pmax``-ed over the shards *before* the EMA update, so every shard tracks the same
    range and quantizes with the same scale. Returns (q int8, new_state, scale).
    """
    eps = ema.TINY if eps is None else eps
    qmax = 2 ** (bits - 1) - 1
    xf = x.astype(jnp.float32)
    # absmax is a max: pmax over the shards gives the unsharded observation exactly.
    amax = jax.lax.pmax(ema.absmax(xf, per_channel), axis_name)
    new = ema.update(state, amax, alpha, eps)
    scale = ema.scale(new, bits)
    q = jnp.clip(jnp.round(xf / scale), -qmax, qmax).astype(jnp.int8)
    return q, new, scale


def online_quantize_sharded(x, state, mesh: Mesh, *, axis: str = DATA, **kw):
    """One tracking step on ``x (rows, channels)`` whose rows are split over ``axis``."""
    row = P(axis, None)
    body = functools.partial(online_quantize_synced, axis_name=axis, **kw)
    if state is None:
        fn = jax.shard_map(lambda xl: body(xl), mesh=mesh, in_specs=(row,), out_specs=(row, P(), P()))
        return jax.jit(fn)(x)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(row, P()), out_specs=(row, P(), P()))
    return jax.jit(fn)(x, state)
