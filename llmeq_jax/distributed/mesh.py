"""The device mesh and multi-host start: ``(data, model)`` mesh over all processes' devices,
``jax.distributed.initialize``, and moving host arrays onto / off a mesh.

Mesh
  Two named axes: ``data`` (calibration/evaluation batches are split over it)
  and ``model`` (weights are split over it). :func:`make_mesh` builds it over
  ``jax.devices()``, i.e. the devices of *all* processes.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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
    return math.prod(mesh.shape[a] for a in mesh_axes(entry))


def mesh_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axis names of a PartitionSpec entry (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def pspec_entries(pspec: P, ndim: int) -> list:
    """The entries of ``pspec`` padded with None to ``ndim`` (one per dim)."""
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
