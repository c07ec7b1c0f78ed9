"""Distributed quantization on JAX's own runtime: mesh, shardings, shard_map scale sync, multi-host start.

Everything here runs the same on one CPU, N forced host devices
(``--xla_force_host_platform_device_count=N``), several processes on one
machine (CPU collectives over gloo) and GPUs: only the mesh changes.

Mesh
  Two named axes: ``data`` (calibration/evaluation batches are split over it)
  and ``model`` (weights are split over it). :func:`make_mesh` builds it over
  ``jax.devices()``, i.e. the devices of *all* processes.

Modules (imports run one way: mesh -> sharding -> scale_sync / calibrate / evaluate / checkpoint)
  :mod:`~llmeq_jax.distributed.mesh`        mesh, multi-host start, host <-> global arrays
  :mod:`~llmeq_jax.distributed.sharding`    where params and QArray children live on the mesh
  :mod:`~llmeq_jax.distributed.scale_sync`  sharded quantization with synced scales; online EMA scale sync
  :mod:`~llmeq_jax.distributed.calibrate`   data-parallel calibration (the one block driver of
                                            :mod:`llmeq_jax.calibrate` with a ``shard_map`` block runner)
  :mod:`~llmeq_jax.distributed.evaluate`    logits and perplexity on a mesh
  :mod:`~llmeq_jax.distributed.checkpoint`  restoring a checkpoint into shards
"""

from __future__ import annotations

from llmeq_jax.distributed.mesh import (
    DATA,
    DistributedError,
    global_array,
    initialize,
    initialize_from_env,
    make_mesh,
    MODEL,
    replicate,
    to_host,
)
from llmeq_jax.distributed.sharding import (
    param_partition,
    param_shardings,
    qarray_partitions,
    shard_params,
)
from llmeq_jax.distributed.scale_sync import (
    DimPlan,
    online_quantize_sharded,
    online_quantize_synced,
    quantize_params_sharded,
    quantize_sharded,
    scale_sync_plan,
    sharded_quantize_fn,
)
from llmeq_jax.distributed.calibrate import (
    calibrate_sharded,
    quantize_model_sharded,
    reduce_stats,
    STAT_COLLECTIVE,
)
from llmeq_jax.distributed.evaluate import (
    forward_on_mesh,
    perplexity_on_mesh,
)
from llmeq_jax.distributed.checkpoint import (
    checkpoint_shardings,
    restore_on_mesh,
)

__all__ = [
    "DATA", "MODEL", "STAT_COLLECTIVE", "DimPlan", "DistributedError", "calibrate_sharded", "checkpoint_shardings",
    "forward_on_mesh", "global_array", "initialize", "initialize_from_env", "make_mesh", "online_quantize_sharded",
    "online_quantize_synced", "param_partition", "param_shardings", "perplexity_on_mesh", "qarray_partitions",
    "quantize_model_sharded", "quantize_params_sharded", "quantize_sharded", "reduce_stats", "replicate", "restore_on_mesh", "scale_sync_plan",
    "shard_params", "sharded_quantize_fn", "to_host",
]
