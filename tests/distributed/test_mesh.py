"""llmeq_jax/distributed/mesh.py: meshes and the multi-process start, checked in this process."""

from __future__ import annotations

import jax
import pytest

from llmeq_jax import distributed as dist


def test_bad_mesh_and_launch_settings():
    with pytest.raises(dist.DistributedError, match="needs 4 devices"):
        dist.make_mesh(4, 1, devices=jax.devices()[:1])
    with pytest.raises(dist.DistributedError, match="model=2 does not divide"):
        dist.make_mesh(None, 2, devices=jax.devices()[:1])
    with pytest.raises(dist.DistributedError, match="HOST:PORT"):
        dist.initialize("localhost", 2, 0)
    with pytest.raises(dist.DistributedError, match="process_id=2"):
        dist.initialize("127.0.0.1:1234", 2, 2)
