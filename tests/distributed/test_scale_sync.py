"""llmeq_jax/distributed/scale_sync.py and sharding.py: which collective keeps a sharded scale whole, how a
QArray's values and scales are partitioned, and that a 1-device mesh quantizes like the plain path.
(The 8-device checks, tests/distributed/test_eight_devices.py, run the same plans across shards.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from llmeq_jax import distributed as dist
from llmeq_jax.core.quantize import Spec
from llmeq_jax.core.rules import quantize_params

MESH_2x4 = AbstractMesh((2, 4), (dist.DATA, dist.MODEL))


@pytest.mark.parametrize(
    "spec,pspec,kinds",
    [
        (Spec(8, "tensor"), P("data", "model"), ["reduce", "reduce"]),
        (Spec(8, "channel"), P("data", "model"), ["reduce", "local"]),  # pmax over rows; columns whole
        (Spec(8, "channel", axis=0), P("data", None), ["local", "none"]),
        (Spec(4, "group", group_size=16), P("data", None), ["local", "none"]),  # 48-row shards hold 3 groups
        (Spec(4, "group", group_size=32), P("data", None), ["straddle", "none"]),  # group 2 crosses row 48
        (Spec(4, "group", group_size=16), P(("data", "model"), None), ["straddle", "none"]),  # 12-row shards
    ],
)
def test_scale_sync_plan(spec, pspec, kinds):
    assert [p.kind for p in dist.scale_sync_plan(spec, (96, 64), pspec, MESH_2x4)] == kinds


def test_qarray_partitions_keep_values_and_scales_consistent():
    # Groups of 16 inside 48-row shards: the scale is split like the values.
    assert dist.qarray_partitions((96, 64), (16, 1), 4, 0, P("data", "model"), MESH_2x4) == (
        P("data", "model"), P("data", "model"))
    # One scale per column: the row split leaves the scale dim whole (replicated).
    assert dist.qarray_partitions((96, 64), (96, 1), 8, 0, P("data", "model"), MESH_2x4) == (
        P("data", "model"), P(None, "model"))
    with pytest.raises(dist.DistributedError, match="whole bytes"):
        dist.qarray_partitions((6, 64), (1, 64), 4, 0, P("data", None), AbstractMesh((6, 1), ("data", "model")))
    # 3-bit: eight values in three bytes, so 4-row shards cut a chunk and 8-row ones do not
    with pytest.raises(dist.DistributedError, match="8 in 3 bytes.*shards of 4"):
        dist.qarray_partitions((8, 64), (8, 1), 3, 0, P("data", None), AbstractMesh((2, 1), ("data", "model")))
    assert dist.qarray_partitions((16, 64), (8, 1), 3, 0, P("data", None), AbstractMesh((2, 1), ("data", "model")))[0] \
        == P("data", None)
    with pytest.raises(dist.DistributedError, match="cannot be split"):
        dist.qarray_partitions((95, 64), (1, 64), 8, 0, P("data", None), MESH_2x4)


def test_single_device_mesh_matches_plain_quantize():
    mesh = dist.make_mesh(1, 1)
    w = jax.random.normal(jax.random.key(3), (32, 48))
    spec = Spec(4, "group", group_size=8, symmetric=False)
    got = dist.quantize_sharded(w, spec, mesh, P("data", "model"))
    ref = quantize_params({"k": {"kernel": w}}, _one_rule(spec))["k"]["kernel"]  # the jitted RTN path
    for c in ("qvalue", "scale", "zero_point"):
        assert np.array_equal(np.asarray(getattr(got, c)), np.asarray(getattr(ref, c)))


def _one_rule(spec):
    from llmeq_jax.core.rules import Recipe, Rule

    return Recipe((Rule(".*", weight=spec),), name="one")
