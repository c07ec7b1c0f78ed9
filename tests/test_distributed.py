"""llmeq_jax.distributed: plans and layouts in this process; 8-device checks and a real
2-process run in subprocesses (so this suite keeps its single device)."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from llmeq_jax import calibrate, checkpoint
from llmeq_jax import distributed as dist
from llmeq_jax.core.qarray import QArray, is_qarray
from llmeq_jax.core.quantize import Spec
from llmeq_jax.core.rules import path_str, quantize_params
from llmeq_jax.methods import quantize_model
from tests.distributed_helpers import tiny

REPO = Path(__file__).resolve().parents[1]
HELPERS = REPO / "tests" / "distributed_helpers"
MESH_2x4 = AbstractMesh((2, 4), (dist.DATA, dist.MODEL))


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("XLA_FLAGS", None)
    env.update(extra)
    return env


# --------------------------------------------------------------------------- in this process


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
    with pytest.raises(dist.DistributedError, match="cannot be split"):
        dist.qarray_partitions((95, 64), (1, 64), 8, 0, P("data", None), MESH_2x4)


def test_every_statistic_has_its_collective():
    assert set(dist.STAT_COLLECTIVE) == set(calibrate.STATS)
    assert dist.STAT_COLLECTIVE["absmax"] is jax.lax.pmax and dist.STAT_COLLECTIVE["min"] is jax.lax.pmin
    assert all(dist.STAT_COLLECTIVE[k] is jax.lax.psum for k in ("abs_sum", "count", "hessian"))


def test_bad_mesh_and_launch_settings():
    with pytest.raises(dist.DistributedError, match="needs 4 devices"):
        dist.make_mesh(4, 1, devices=jax.devices()[:1])
    with pytest.raises(dist.DistributedError, match="model=2 does not divide"):
        dist.make_mesh(None, 2, devices=jax.devices()[:1])
    with pytest.raises(dist.DistributedError, match="HOST:PORT"):
        dist.initialize("localhost", 2, 0)
    with pytest.raises(dist.DistributedError, match="process_id=2"):
        dist.initialize("127.0.0.1:1234", 2, 2)


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


# --------------------------------------------------------------------------- 8 host devices


def test_eight_device_checks():
    """Bit-identical sharded quantization, sharded calibration, model and checkpoint on 8 devices."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HELPERS / "eight_device_checks.py")],
        cwd=REPO, env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


# --------------------------------------------------------------------------- two real processes


def test_two_processes_calibrate_and_quantize_identically(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "launch_multihost.py"), "--local", "2", "--cpu-devices", "2",
         "--timeout", "300", str(HELPERS / "two_process_worker.py"), str(tmp_path)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=360,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    p0, p1 = (dict(np.load(tmp_path / f"process_{i}.npz")) for i in range(2))
    assert set(p0) == set(p1)
    for key in p0:  # both processes hold the same statistics, scales and values, bit for bit
        assert np.array_equal(p0[key], p1[key]), key
    assert not p0["meta:fully_addressable"]

    # ... and they equal one process on one device.
    params = tiny.params()
    stats, _ = calibrate.calibrate(tiny.CONFIG, params, tiny.windows(8), wants=tiny.WANTS, batch_size=2)
    qparams = quantize_params(params, tiny.recipe(), stats)
    n_stats = 0
    for path, s in stats.items():
        for k, v in s.items():
            got, want = p0[f"stats:{path}:{k}"], np.asarray(v)
            n_stats += 1
            if k in ("abs_sum", "hessian"):  # psum adds in the backend's order
                np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6, err_msg=f"{path} {k}")
            else:
                assert np.array_equal(got, want), (path, k)
    assert n_stats == len(tiny.WANTS) * 7 * tiny.CONFIG.num_layers
    n_q = 0
    for kp, leaf in jax.tree_util.tree_leaves_with_path(qparams, is_leaf=lambda x: isinstance(x, QArray)):
        if isinstance(leaf, QArray):
            for c in ("qvalue", "scale", "zero_point", "act_scale"):
                if getattr(leaf, c) is not None:
                    assert np.array_equal(p0[f"q:{path_str(kp)}:{c}"], np.asarray(getattr(leaf, c))), (kp, c)
                    n_q += 1
    assert n_q >= 3 * 7 * tiny.CONFIG.num_layers  # every kernel: values + scale + (zero point or act scale)

    # GPTQ with calibration split over the processes equals GPTQ in one process, bit for bit.
    gq, _ = quantize_model(tiny.CONFIG, params, tiny.gptq_recipe(), tiny.windows(8),
                           calibrate_fn=functools.partial(calibrate.calibrate, batch_size=1))
    n_g = 0
    for kp, leaf in jax.tree_util.tree_leaves_with_path(gq, is_leaf=is_qarray):
        if isinstance(leaf, QArray):
            for c in ("qvalue", "scale"):
                assert np.array_equal(p0[f"gptq:{path_str(kp)}:{c}"], np.asarray(getattr(leaf, c))), (kp, c)
                n_g += 1
    assert n_g == 2 * 7 * tiny.CONFIG.num_layers

    # The checkpoint both processes wrote restores in one process to the same tree, bit for bit.
    assert not list(tmp_path.glob(".ckpt.tmp-*"))
    assert checkpoint.metadata(tmp_path / "ckpt")["metadata"] == {"written_by": 2}
    restored = checkpoint.restore(tmp_path / "ckpt")
    want_leaves = jax.tree_util.tree_leaves_with_path(qparams, is_leaf=is_qarray)
    got_leaves = dict(jax.tree_util.tree_leaves_with_path(restored, is_leaf=is_qarray))
    assert len(got_leaves) == len(want_leaves)
    for kp, leaf in want_leaves:
        got = got_leaves[kp]
        if isinstance(leaf, QArray):
            assert isinstance(got, QArray) and got.bits == leaf.bits and got.tile == leaf.tile, kp
            for c in ("qvalue", "scale", "zero_point", "act_scale"):
                if getattr(leaf, c) is not None:
                    assert np.array_equal(np.asarray(getattr(got, c)), np.asarray(getattr(leaf, c))), (kp, c)
        else:
            assert np.array_equal(np.asarray(got), np.asarray(leaf)), kp
