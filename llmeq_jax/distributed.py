"""Distributed quantization on JAX's own runtime: mesh, shardings, shard_map scale sync, multi-host start.

Everything here runs the same on one CPU, N forced host devices
(``--xla_force_host_platform_device_count=N``), several processes on one
machine (CPU collectives over gloo) and GPUs: only the mesh changes.

Mesh
  Two named axes: ``data`` (calibration/evaluation batches are split over it)
  and ``model`` (weights are split over it). :func:`make_mesh` builds it over
  ``jax.devices()``, i.e. the devices of *all* processes.

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

Statistics (calibration) combine with the collective that matches them:
absmax/max -> ``pmax``, min -> ``pmin``, sums (``abs_sum``, ``count``,
Hessians ``X^T X``) -> ``psum`` (:data:`STAT_COLLECTIVE`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llmeq_jax.core.qarray import QArray, is_qarray, pack, values_per_byte
from llmeq_jax.core.quantize import (Spec, _parse_clip, compute_scale, quantize_values, scale_from_range, storable_scale,
                                     tile_for, tile_reduce)
from llmeq_jax.core.rules import path_str

DATA = "data"
MODEL = "model"


class DistributedError(ValueError):
    """A mesh, sharding or launch setting that cannot work, with the reason."""


# --------------------------------------------------------------------------- multi-host start


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    cpu_devices: int | None = None,
    timeout_s: int = 120,
) -> None:
    """Join a multi-process JAX job (call before anything touches a device).

    ``cpu_devices`` asks the CPU backend for that many local devices; on CPU the
    cross-process collectives go over gloo. GPUs need no extra setting: the same
    call works unchanged there.
    """
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise DistributedError(
            f"process_id={process_id} / num_processes={num_processes}: expected 0 <= process_id < num_processes"
        )
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit():
        raise DistributedError(f"coordinator address {coordinator_address!r} is not HOST:PORT")
    if cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    # Harmless on GPU (only the CPU client reads it); required for CPU cross-process collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout_s,
    )


def initialize_from_env() -> bool:
    """:func:`initialize` from ``LLMEQ_COORDINATOR``/``LLMEQ_NUM_PROCESSES``/``LLMEQ_PROCESS_ID``
    (+ optional ``LLMEQ_CPU_DEVICES``), as set by ``scripts/launch_multihost.py``. False if unset."""
    addr = os.environ.get("LLMEQ_COORDINATOR")
    if not addr:
        return False
    cpu = os.environ.get("LLMEQ_CPU_DEVICES")
    initialize(
        addr,
        int(os.environ["LLMEQ_NUM_PROCESSES"]),
        int(os.environ["LLMEQ_PROCESS_ID"]),
        cpu_devices=int(cpu) if cpu else None,
    )
    return True


# --------------------------------------------------------------------------- mesh


def make_mesh(data: int | None = None, model: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``(data, model)`` mesh over ``devices`` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if model < 1 or n % model:
        raise DistributedError(f"model={model} does not divide the {n} devices")
    data = n // model if data is None else data
    if data * model != n:
        raise DistributedError(f"mesh (data={data}, model={model}) needs {data * model} devices; there are {n}")
    # Devices are grouped by process first (jax.devices() order), so the model axis stays within a host
    # where it can.
    return Mesh(np.asarray(devices, dtype=object).reshape(data, model), (DATA, MODEL))


def axis_size(mesh: Mesh, entry: Any) -> int:
    """Number of shards a PartitionSpec entry (None, a name or a tuple of names) makes."""
    return math.prod(mesh.shape[a] for a in _axes(entry))


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entries(pspec: P, ndim: int) -> list:
    entries = list(pspec) + [None] * (ndim - len(pspec))
    if len(entries) != ndim:
        raise DistributedError(f"PartitionSpec {pspec} has more entries than the array's {ndim} dims")
    return entries


def global_array(host: Any, sharding: NamedSharding) -> jax.Array:
    """A global jax.Array from a host array every process holds in full (works across processes)."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Every leaf replicated on every device of ``mesh`` (QArrays child by child)."""
    rep = NamedSharding(mesh, P())
    return jax.tree_util.tree_map(lambda a: global_array(np.asarray(a), rep), tree)


def to_host(a: jax.Array) -> np.ndarray:
    """The full value of a (possibly multi-process) global array as numpy on this process."""
    if a.is_fully_addressable:
        return np.asarray(a)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


# --------------------------------------------------------------------------- shardings of params / QArrays


def param_partition(path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
    """Default layout: linear kernels ``(in, out)`` split their output features over ``model``
    (column-parallel: each device computes whole outputs, no partial sums); everything else
    is replicated. A dim the model axis does not divide stays whole."""
    if path.endswith("kernel") and len(shape) >= 2 and shape[-1] % mesh.shape[MODEL] == 0 and mesh.shape[MODEL] > 1:
        return P(*([None] * (len(shape) - 1)), MODEL)
    return P()


def qarray_partitions(
    shape: tuple[int, ...], tile: tuple[int, ...], bits: int, pack_axis: int, logical: P, mesh: Mesh
) -> tuple[P, P]:
    """(values spec, scale/zero-point spec) for a QArray whose logical array is laid out as ``logical``.

    The values follow the logical layout. A scale dim is split the same way only where
    each shard's tiles are whole (``L % t == 0``, so scale shard ``j`` belongs to value
    shard ``j``); otherwise (one scale for the dim, or groups crossing shards) it is
    replicated. A packed dim must split on whole bytes.
    """
    entries = _entries(logical, len(shape))
    vals, scales = [], []
    for d, (n, t, e) in enumerate(zip(shape, tile, entries)):
        k = axis_size(mesh, e)
        if k == 1:
            vals.append(None)
            scales.append(None)
            continue
        if n % k:
            raise DistributedError(f"dim {d} of size {n} cannot be split into {k} shards ({e})")
        local = n // k
        if d == pack_axis and local % values_per_byte(bits):
            raise DistributedError(
                f"dim {d} holds packed int{bits} values ({values_per_byte(bits)} per byte); "
                f"shards of {local} do not split on whole bytes"
            )
        vals.append(e)
        scales.append(e if (local % t == 0 and t < n) else None)
    return P(*vals), P(*scales)


def _leaf_sharding(path: str, leaf: Any, mesh: Mesh, partition: Callable) -> Any:
    if isinstance(leaf, QArray):
        vs, ss = qarray_partitions(leaf.shape, leaf.tile, leaf.bits, leaf.pack_axis, partition(path, leaf.shape, mesh), mesh)
        return dataclasses.replace(
            leaf,
            qvalue=NamedSharding(mesh, vs),
            scale=NamedSharding(mesh, ss),
            zero_point=None if leaf.zero_point is None else NamedSharding(mesh, ss),
            act_scale=None if leaf.act_scale is None else NamedSharding(mesh, P()),
        )
    return NamedSharding(mesh, partition(path, tuple(leaf.shape), mesh))


def param_shardings(params: Any, mesh: Mesh, partition: Callable = param_partition) -> Any:
    """A tree like ``params`` of NamedShardings (QArray values, scales and zero points kept consistent)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, leaf: _leaf_sharding(path_str(kp), leaf, mesh, partition),
        params,
        is_leaf=is_qarray,
    )


def shard_params(params: Any, mesh: Mesh, partition: Callable = param_partition) -> Any:
    """Place ``params`` (floats and QArrays) on ``mesh``; every process must pass the same values."""
    shardings = param_shardings(params, mesh, partition)
    def place(a, s):
        if isinstance(a, jax.Array) and a.sharding.is_equivalent_to(s, a.ndim):
            return a
        return global_array(to_host(a) if isinstance(a, jax.Array) else np.asarray(a), s)

    return jax.tree_util.tree_map(place, params, shardings)


# --------------------------------------------------------------------------- shard_map scale synchronisation


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
    for d, (n, t, e) in enumerate(zip(shape, tile, _entries(pspec, len(shape)))):
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
        out.append(DimPlan(kind, _axes(e), k, local, t))
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
    return _sharded_quantize_fn(spec, mesh, P(*_entries(pspec, len(shape))), shape, replicate_scales, pack_axis), pack_axis


@functools.lru_cache(maxsize=256)
def _sharded_quantize_fn(spec, mesh, pspec, shape, replicate_scales, pack_axis):
    tile = tile_for(spec, shape)
    plans = scale_sync_plan(spec, shape, pspec, mesh)
    qarray_partitions(shape, tile, spec.bits, pack_axis, pspec, mesh)  # checks packed dims split on whole bytes
    entries = _entries(pspec, len(shape))
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
    want = NamedSharding(mesh, P(*_entries(pspec, len(shape))))
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
    from llmeq_jax.core.rules import map_rules, static_act_scale

    def one(path, w, rule):
        act_scale = static_act_scale(path, stats) if rule.act_static else None
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

    The XLA twin of ``pallas_kernels.online_scale.online_quantize``: the step's absmax is
    ``pmax``-ed over the shards *before* the EMA update, so every shard tracks the same
    range and quantizes with the same scale. Returns (q int8, new_state, scale).
    """
    from llmeq_jax.core import ema

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


# --------------------------------------------------------------------------- sharded calibration

# Which collective combines each calibration statistic over the data axis, and why:
# extrema are order-free (pmax/pmin, exact); sums and counts add (psum); the Hessian
# X^T X is a sum over tokens, so it adds too.
def _gather_sample(v: jax.Array, axis_name: Any) -> jax.Array:
    """Input rows are not reduced: gather every shard's rows in shard order and keep the
    first ``SAMPLE_TOKENS``, as one device keeps the first rows it sees."""
    from llmeq_jax.calibrate import SAMPLE_TOKENS

    return jax.lax.all_gather(v, axis_name, tiled=True, to="invarying")[:SAMPLE_TOKENS]


STAT_COLLECTIVE = {
    "absmax": jax.lax.pmax,
    "max": jax.lax.pmax,
    "min": jax.lax.pmin,
    "abs_sum": jax.lax.psum,
    "count": jax.lax.psum,
    "hessian": jax.lax.psum,
    "sample": _gather_sample,  # AWQ / SmoothQuant alpha search: rows, gathered (all_gather)
}


def reduce_stats(stats: dict, axis_name: Any, *, ordered_sums: bool = False) -> dict:
    """Combine per-shard statistics ``{path: {name: array}}`` across ``axis_name`` (inside shard_map).

    ``ordered_sums``: instead of ``psum`` (whose summation order is the backend's), sums are
    ``all_gather``-ed as ``[shards, ...]`` so the caller can add them in a fixed order --
    that reproduces single-device calibration bit for bit, at the cost of gathering.
    """

    def one(k, v):
        if ordered_sums and STAT_COLLECTIVE[k] is jax.lax.psum:
            return jax.lax.all_gather(v, axis_name, to="invarying")
        return STAT_COLLECTIVE[k](v, axis_name)

    return {path: {k: one(k, v) for k, v in s.items()} for path, s in stats.items()}


def _fold_ordered(block_stats: dict | None, found: dict, shards: int) -> dict:
    """Add gathered per-shard sums one shard at a time, in shard order (= single-device batch order)."""
    from llmeq_jax.calibrate import combine

    summed = [k for k, f in STAT_COLLECTIVE.items() if f is jax.lax.psum]

    def shard_part(k, v, j):
        if k in summed:
            return v[j]
        # Already combined over shards: extrema are idempotent, gathered rows must enter once.
        return v[:0] if (k == "sample" and j > 0) else v

    for j in range(shards):
        part = {p: {k: shard_part(k, v, j) for k, v in s.items()} for p, s in found.items()}
        block_stats = part if block_stats is None else combine(block_stats, part)
    return block_stats


@functools.lru_cache(maxsize=None)
def _sharded_block_fn(config, layer: int, wants: tuple, mesh: Mesh, data_axis: str, with_stats: bool,
                      ordered_sums: bool = False):
    from llmeq_jax.calibrate import input_stats, run_block_capturing
    from llmeq_jax.models.model import apply_block

    def body(block_params, hidden, positions):
        if not with_stats:
            return apply_block(config, block_params, hidden, positions, layer=layer)
        found: dict[str, dict] = {}

        def record(path, x):
            found[path + "/kernel"] = input_stats(x, wants)

        out = run_block_capturing(lambda: apply_block(config, block_params, hidden, positions, layer=layer), record)
        return out, reduce_stats(found, data_axis, ordered_sums=ordered_sums)

    batch = P(data_axis)
    out_specs = (batch, P()) if with_stats else batch
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), batch, batch), out_specs=out_specs))


def calibrate_sharded(
    config: Any,
    params: dict,
    windows: np.ndarray,
    mesh: Mesh,
    *,
    wants: Iterable[str] = ("absmax", "abs_sum", "count"),
    batch_size: int = 4,
    process_block: Callable[[int, dict, dict, list], dict] | None = None,
    data_axis: str = DATA,
    ordered_sums: bool = False,
    sequential: bool = True,
) -> tuple[dict, dict]:
    """``calibrate.calibrate`` with the windows split over ``data_axis``; same contract and results.

    Each step takes ``batch_size`` windows per data shard; every shard runs the block on
    its own windows and the statistics are combined with :data:`STAT_COLLECTIVE`, so all
    devices (and processes) end with the same, replicated statistics. Extrema and counts
    equal single-device calibration (same ``batch_size``) exactly; with ``psum`` the sums
    equal it up to float summation order, and with ``ordered_sums=True`` (all_gather, then
    add shard by shard in batch order) bit for bit.
    """
    from llmeq_jax.calibrate import STATS, CalibrationError, combine
    from llmeq_jax.models.model import embed

    wants = tuple(dict.fromkeys(wants))
    unknown = [w for w in wants if w not in STATS]
    if unknown:
        raise CalibrationError(f"unknown statistic(s) {unknown}; available: {list(STATS)}")
    shards = mesh.shape[data_axis]
    windows = np.asarray(windows)
    if len(windows) % shards:
        raise CalibrationError(
            f"{len(windows)} calibration windows cannot be split evenly over the {shards} shards of mesh axis "
            f"{data_axis!r}; use a multiple of {shards}"
        )
    step = batch_size * shards
    batch_sharding = NamedSharding(mesh, P(data_axis))
    embed_fn = jax.jit(embed, static_argnums=0)
    params = replicate(params, mesh)
    inputs = []
    for start in range(0, len(windows), step):
        toks = windows[start : start + step]
        pos = np.broadcast_to(np.arange(toks.shape[1]), toks.shape)
        toks, pos = global_array(toks, batch_sharding), global_array(pos, batch_sharding)
        inputs.append((embed_fn(config, params, toks, pos), pos))
    stats: dict[str, dict] = {}
    new_params = dict(params)
    for i in range(config.num_layers):
        name = f"layers_{i}"
        bp = params[name]
        with_stats = _sharded_block_fn(config, i, wants, mesh, data_axis, True, ordered_sums)
        block_stats = None
        for h, pos in inputs:
            _, found = jax.block_until_ready(with_stats(bp, h, pos))  # see quantize_params_sharded
            if ordered_sums:
                block_stats = _fold_ordered(block_stats, found, shards)
            else:
                block_stats = found if block_stats is None else combine(block_stats, found)
        if process_block is not None:
            bp = process_block(i, bp, block_stats, inputs)
            new_params[name] = bp
        stats.update({f"{name}/{p}": s for p, s in block_stats.items()})
        plain = _sharded_block_fn(config, i, wants, mesh, data_axis, False)
        feed = bp if sequential else params[name]  # sequential=False: the float model's activations
        inputs = [(jax.block_until_ready(plain(feed, h, pos)), pos) for h, pos in inputs]
    return stats, new_params


def quantize_model_sharded(config: Any, params: dict, recipe: Any, windows: np.ndarray, mesh: Mesh, *,
                           batch_size: int = 4, ordered_sums: bool = True) -> tuple[dict, dict]:
    """``methods.quantize_model`` (any method: GPTQ, AWQ, SmoothQuant, ...) with data-parallel calibration.

    The calibration windows are split over the mesh's data axis (:func:`calibrate_sharded`);
    every device holds the same replicated statistics and runs the method's block step on
    them, so all processes end with the same quantized tree. ``ordered_sums`` (default)
    adds Hessians and sums shard by shard in batch order: the result is bit-identical to
    ``quantize_model`` on one device with the same per-shard ``batch_size``.
    """
    from llmeq_jax.methods import quantize_model

    def calib(config, params, windows, *, wants, process_block=None, keep=None, progress=False, sequential=True):
        del keep, progress  # statistics live on the mesh, replicated; no progress bar across processes
        return calibrate_sharded(config, params, windows, mesh, wants=wants, batch_size=batch_size,
                                 process_block=process_block, ordered_sums=ordered_sums, sequential=sequential)

    return quantize_model(config, params, recipe, windows, calibrate_fn=calib)


# --------------------------------------------------------------------------- running a model on the mesh


def forward_on_mesh(config: Any, params: Any, tokens: Any, mesh: Mesh, attention_mask: Any = None) -> jax.Array:
    """Logits of (sharded) ``params`` on ``tokens`` split over the data axis, under ``jit``."""
    batch = NamedSharding(mesh, P(DATA))
    tokens = global_array(np.asarray(tokens, np.int32), batch)
    mask = None if attention_mask is None else global_array(np.asarray(attention_mask, np.int32), batch)
    return _jit_forward(config, params, tokens, mask)


@functools.partial(jax.jit, static_argnums=0)
def _jit_forward(config, params, tokens, mask):
    from llmeq_jax.models.model import forward

    return forward(config, params, tokens, mask)


def perplexity_on_mesh(config: Any, params: Any, windows: np.ndarray, mesh: Mesh, batch_size: int | None = None) -> dict:
    """``evaluate.perplexity`` with each batch split over the data axis (DESIGN §6 protocol)."""
    from llmeq_jax.evaluate import perplexity
    from llmeq_jax.models.model import forward

    batch_size = mesh.shape[DATA] if batch_size is None else batch_size
    if batch_size % mesh.shape[DATA]:
        raise DistributedError(f"batch_size={batch_size} must be a multiple of the data axis ({mesh.shape[DATA]})")
    batch = NamedSharding(mesh, P(DATA))

    def logits(toks):
        toks = jax.lax.with_sharding_constraint(toks, batch)
        return forward(config, params, toks)

    return perplexity(logits, windows, batch_size=batch_size)


# --------------------------------------------------------------------------- checkpoints on a mesh


def checkpoint_shardings(path: str | Path, mesh: Mesh, partition: Callable = param_partition) -> Callable:
    """A ``shardings`` callable for ``checkpoint.abstract_tree``: the checkpoint's leaves laid out
    on ``mesh`` (whatever mesh it was saved from), QArray children kept consistent."""
    from llmeq_jax.checkpoint import read_manifest

    layout = read_manifest(path)["layout"]

    def sharding(p: str, child: str | None, meta: dict):
        leaf = layout[p]
        if leaf["kind"] != "qarray":
            return NamedSharding(mesh, partition(p, tuple(meta["shape"]), mesh))
        st = leaf["static"]
        shape = tuple(st["shape"])
        vs, ss = qarray_partitions(shape, tuple(st["tile"]), st["bits"], st["pack_axis"], partition(p, shape, mesh), mesh)
        return NamedSharding(mesh, {"qvalue": vs, "scale": ss, "zero_point": ss}.get(child, P()))

    return sharding


def restore_on_mesh(path: str | Path, mesh: Mesh, partition: Callable = param_partition) -> Any:
    """Restore a (quantized) checkpoint directly into shards on ``mesh``; no float model is built."""
    from llmeq_jax.checkpoint import abstract_tree, restore

    target = abstract_tree(path, shardings=checkpoint_shardings(path, mesh, partition))
    return restore(path, target)


__all__ = [
    "DATA", "MODEL", "STAT_COLLECTIVE", "DimPlan", "DistributedError", "calibrate_sharded", "checkpoint_shardings",
    "forward_on_mesh", "global_array", "initialize", "initialize_from_env", "make_mesh", "online_quantize_sharded",
    "online_quantize_synced", "param_partition", "param_shardings", "perplexity_on_mesh", "qarray_partitions",
    "quantize_params_sharded", "quantize_sharded", "reduce_stats", "replicate", "restore_on_mesh", "scale_sync_plan",
    "shard_params", "to_host",
]
