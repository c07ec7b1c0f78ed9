"""Where parameters live on a mesh: the default layout of a param path, and QArray layouts whose
values, scales and zero points stay consistent (a scale dim is split only where its tiles are whole)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llmeq_jax.core.qarray import QArray, is_qarray, packing
from llmeq_jax.core.rules import path_str
from llmeq_jax.distributed.mesh import MODEL, DistributedError, axis_size, global_array, pspec_entries, to_host


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
    entries = pspec_entries(logical, len(shape))
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
        per_chunk, nbytes = packing(bits)
        if d == pack_axis and local % per_chunk:
            raise DistributedError(
                f"dim {d} holds packed int{bits} values ({per_chunk} in {nbytes} byte{'s' if nbytes > 1 else ''}); "
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
