"""One of two processes (2 CPU devices each) started by scripts/launch_multihost.py from
tests/distributed/test_two_processes.py: calibrate and quantize the tiny llama on the 4-device mesh, then
write what this process holds to ``<out>/process_<id>.npz`` and save one Orbax checkpoint of the
quantized tree from both processes to ``<out>/ckpt`` for the test to compare."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

from llmeq_jax import checkpoint
from llmeq_jax import distributed as dist
from llmeq_jax.core.qarray import QArray
from llmeq_jax.core.rules import path_str
from tests.distributed_helpers import tiny


def main(out: Path) -> None:
    assert jax.process_count() == 2 and jax.local_device_count() == 2 and jax.device_count() == 4, (
        jax.process_count(), jax.local_device_count(), jax.device_count())
    mesh = dist.make_mesh(2, 2)  # data over the two processes' halves, model inside them
    stats, _ = dist.calibrate_sharded(tiny.CONFIG, tiny.params(), tiny.windows(8), mesh, wants=tiny.WANTS,
                                      batch_size=2)
    qparams = dist.quantize_params_sharded(tiny.params(), tiny.recipe(), mesh, stats)
    saved = {}
    for path, s in stats.items():
        for k, v in s.items():
            saved[f"stats:{path}:{k}"] = dist.to_host(v)
    for kp, leaf in jax.tree_util.tree_leaves_with_path(qparams, is_leaf=lambda x: isinstance(x, QArray)):
        if isinstance(leaf, QArray):
            for c in ("qvalue", "scale", "zero_point", "act_scale"):
                if getattr(leaf, c) is not None:
                    saved[f"q:{path_str(kp)}:{c}"] = dist.to_host(getattr(leaf, c))
    # The quantized kernels are global arrays spanning both processes, not local copies.
    k = qparams["layers_0"]["mlp"]["up_proj"]["kernel"]
    saved["meta:fully_addressable"] = np.asarray(k.qvalue.is_fully_addressable)
    # A calibrated method across the processes: GPTQ with data-parallel calibration.
    gq, _ = dist.quantize_model_sharded(tiny.CONFIG, tiny.params(), tiny.gptq_recipe(), tiny.windows(8), mesh,
                                        batch_size=1)
    for kp, leaf in jax.tree_util.tree_leaves_with_path(gq, is_leaf=lambda x: isinstance(x, QArray)):
        if isinstance(leaf, QArray):
            saved[f"gptq:{path_str(kp)}:qvalue"] = dist.to_host(leaf.qvalue)
            saved[f"gptq:{path_str(kp)}:scale"] = dist.to_host(leaf.scale)
    np.savez(out / f"process_{jax.process_index()}.npz", **saved)
    # Both processes write their shards of one checkpoint; it exists once save returns on either.
    checkpoint.save(out / "ckpt", qparams, recipe=tiny.recipe(), metadata={"written_by": jax.process_count()})
    assert (out / "ckpt" / checkpoint.MANIFEST).exists()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
