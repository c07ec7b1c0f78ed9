"""llmeq_jax/distributed/calibrate.py: the collectives that combine statistics, and the one calibration
driver with its two block runners."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from llmeq_jax import calibrate
from llmeq_jax import distributed as dist
from tests.distributed_helpers import tiny


def test_every_statistic_has_its_collective():
    assert set(dist.STAT_COLLECTIVE) == set(calibrate.STATS)
    assert dist.STAT_COLLECTIVE["absmax"] is jax.lax.pmax and dist.STAT_COLLECTIVE["min"] is jax.lax.pmin
    assert all(dist.STAT_COLLECTIVE[k] is jax.lax.psum for k in ("abs_sum", "count", "hessian"))


def test_block_runners_give_the_same_statistics():
    """One calibration driver, two block runners (plain jit; shard_map on a 1-device mesh): the same
    statistics, the same ``keep`` filter and the same processed params. (The 8-device checks compare
    the runners across shards.)"""
    from llmeq_jax.distributed.calibrate import ShardedBlockRunner
    from llmeq_jax.models.model import init_params

    config = dataclasses.replace(tiny.CONFIG, num_layers=2)
    params, windows = init_params(config, jax.random.key(0)), tiny.windows(4)

    def halve_block(layer, block_params, block_stats, inputs):  # a sequential "method": block i+1 sees it
        return jax.tree.map(lambda a: a * 0.5, block_params)

    kw = dict(wants=("absmax", "hessian", "count"), batch_size=2, keep=("absmax", "count"), process_block=halve_block)
    ref, ref_params = calibrate.calibrate(config, params, windows, **kw)
    runner = ShardedBlockRunner(dist.make_mesh(1, 1, devices=jax.devices()[:1]), ordered_sums=True)
    got, got_params = calibrate.calibrate(config, params, windows, runner=runner, **kw)
    assert set(got) == set(ref) and len(ref) == 14
    for path in ref:
        assert set(got[path]) == set(ref[path]) == {"absmax", "count"}, path  # the sharded driver keeps only `keep`
        for k in ref[path]:
            np.testing.assert_allclose(dist.to_host(got[path][k]), np.asarray(ref[path][k]), rtol=1e-6, err_msg=f"{path} {k}")
    for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(ref_params)):
        np.testing.assert_array_equal(dist.to_host(a), np.asarray(b))
