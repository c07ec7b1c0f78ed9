"""Checkpoints on a mesh: restore a (quantized) checkpoint straight into shards, whatever mesh saved it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llmeq_jax.checkpoint import abstract_tree, read_manifest, restore
from llmeq_jax.distributed.sharding import param_partition, qarray_partitions


def checkpoint_shardings(path: str | Path, mesh: Mesh, partition: Callable = param_partition) -> Callable:
    """A ``shardings`` callable for ``checkpoint.abstract_tree``: the checkpoint's leaves laid out
    on ``mesh`` (whatever mesh it was saved from), QArray children kept consistent."""
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
    target = abstract_tree(path, shardings=checkpoint_shardings(path, mesh, partition))
    return restore(path, target)
