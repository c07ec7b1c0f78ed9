"""Checks that need 8 host devices. Run only through tests/distributed/test_eight_devices.py, which starts
``pytest`` on this file in a subprocess with ``--xla_force_host_platform_device_count=8``
(the rest of the suite keeps its single device)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from llmeq_jax import calibrate, checkpoint
from llmeq_jax import distributed as dist
from llmeq_jax.core.qarray import QArray
from llmeq_jax.core.quantize import Spec, quantize
from llmeq_jax.core.rules import quantize_params
from llmeq_jax.generate import generate
from llmeq_jax.models.model import forward, init_params
from tests.distributed_helpers import tiny

if jax.device_count() != 8:
    pytest.fail(f"these checks need 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8); "
                f"found {jax.device_count()}", pytrace=False)

# (mesh shape, layout of a (96, 64) weight): split rows, columns, both, and 8-way over one dim.
LAYOUTS = [
    ((2, 4), P("data", None)),
    ((2, 4), P(None, "model")),
    ((2, 4), P("data", "model")),
    ((2, 4), P(None, ("data", "model"))),
    ((8, 1), P("data", None)),
]
SPECS = [
    Spec(8, "tensor"),
    Spec(8, "tensor", symmetric=False),
    Spec(8, "channel"),                      # per output channel (axis -1)
    Spec(8, "channel", axis=0, symmetric=False, clip=0.9),
    Spec(4, "group", group_size=12),         # groups along dim 0: whole inside 12-row shards, cross 48-row ones
    Spec(4, "group", group_size=16, symmetric=False),  # crosses 12-row shards
    Spec(3, "group", group_size=16, axis=1),  # groups along dim 1
]


def _weight():
    x = jax.random.normal(jax.random.key(0), (96, 64)) * jnp.linspace(0.1, 3.0, 64)
    return x.at[5, 7].set(40.0)  # one outlier so ranges really differ between shards


def assert_qarray_equal(a: QArray, b: QArray):
    assert (a.bits, a.shape, a.tile, a.pack_axis) == (b.bits, b.shape, b.tile, b.pack_axis)
    for c in ("qvalue", "scale", "zero_point"):
        x, y = getattr(a, c), getattr(b, c)
        assert (x is None) == (y is None), c
        if x is not None:
            xa, ya = dist.to_host(x), dist.to_host(y)
            assert xa.dtype == ya.dtype and np.array_equal(xa, ya), f"{c} differs"


@pytest.mark.parametrize("mesh_shape,pspec", LAYOUTS, ids=[f"{m}-{p}" for m, p in LAYOUTS])
def test_sharded_quantize_is_bit_identical(mesh_shape, pspec):
    mesh = dist.make_mesh(*mesh_shape)
    x = _weight()
    for spec in SPECS:
        ref = jax.jit(lambda w, spec=spec: quantize(w, spec))(x)
        got = dist.quantize_sharded(x, spec, mesh, pspec)
        assert_qarray_equal(got, ref)
        if pspec == LAYOUTS[0][1]:  # jit and eager agree too (once is enough: it is the core's property)
            assert_qarray_equal(got, quantize(x, spec))
        assert got.qvalue.sharding.is_equivalent_to(NamedSharding(mesh, pspec), 2)


def _collectives(spec, mesh, pspec, **kw):
    fn, _ = dist.sharded_quantize_fn(spec, mesh, pspec, (96, 64), **kw)
    hlo = fn.lower(jax.ShapeDtypeStruct((96, 64), jnp.float32, sharding=NamedSharding(mesh, pspec))).as_text()
    return {op for op in ("all_reduce", "all_gather", "all-reduce", "all-gather") if op in hlo}


def test_which_collective_applies():
    mesh = dist.make_mesh(2, 4)
    rows = P("data", None)  # 48-row shards
    # Groups of 12 rows lie inside a shard: no collective at all; scales stay sharded with the values.
    assert [p.kind for p in dist.scale_sync_plan(Spec(4, "group", group_size=12), (96, 64), rows, mesh)] == ["local", "none"]
    assert _collectives(Spec(4, "group", group_size=12), mesh, rows) == set()
    # ... unless every device must hold all scales: then they are all-gathered.
    assert {"all_gather", "all-gather"} & _collectives(Spec(4, "group", group_size=12), mesh, rows, replicate_scales=True)
    # Per output channel reduces over the (split) rows: pmax of the absmax.
    assert [p.kind for p in dist.scale_sync_plan(Spec(8, "channel"), (96, 64), rows, mesh)] == ["reduce", "none"]
    assert {"all_reduce", "all-reduce"} & _collectives(Spec(8, "channel"), mesh, rows)
    # Groups of 32 rows cross 12-row shards of an 8-way split: partial ranges, then pmax/pmin.
    eight = P(("data", "model"), None)
    plan = dist.scale_sync_plan(Spec(4, "group", group_size=32), (96, 64), eight, mesh)
    assert plan[0].kind == "straddle" and plan[0].shards == 8
    assert {"all_reduce", "all-reduce"} & _collectives(Spec(4, "group", group_size=32, symmetric=False), mesh, eight)


def test_replicated_scales_equal_unsharded():
    mesh = dist.make_mesh(2, 4)
    spec = Spec(4, "group", group_size=12)
    got = dist.quantize_sharded(_weight(), spec, mesh, P("data", "model"), replicate_scales=True)
    assert got.scale.sharding.is_fully_replicated
    assert_qarray_equal(got, quantize(_weight(), spec))


def test_mse_clip_across_shards_is_refused():
    mesh = dist.make_mesh(2, 4)
    with pytest.raises(dist.DistributedError, match="clip='mse'"):
        dist.quantize_sharded(_weight(), Spec(8, "channel", clip="mse"), mesh, P("data", None))
    # Where tiles are whole per shard the MSE search is local and still exact.
    got = dist.quantize_sharded(_weight(), Spec(8, "channel", clip="mse"), mesh, P(None, "model"))
    assert_qarray_equal(got, jax.jit(lambda w: quantize(w, Spec(8, "channel", clip="mse")))(_weight()))


def test_sharded_calibration_equals_single_device():
    config = dataclasses.replace(tiny.CONFIG, num_layers=1)  # one block: fewer compilations
    params, windows = init_params(config, jax.random.key(0)), tiny.windows(8)
    ref, _ = calibrate.calibrate(config, params, windows, wants=tiny.WANTS, batch_size=1)
    mesh = dist.make_mesh(4, 2)
    exact, _ = dist.calibrate_sharded(config, params, windows, mesh, wants=tiny.WANTS, batch_size=1,
                                      ordered_sums=True)
    summed, _ = dist.calibrate_sharded(config, params, windows, mesh, wants=tiny.WANTS, batch_size=1)
    assert set(exact) == set(ref) == set(summed) and len(ref) == 7
    for path in ref:
        for k in tiny.WANTS:
            r = np.asarray(ref[path][k])
            assert np.array_equal(dist.to_host(exact[path][k]), r), (path, k)
            s = dist.to_host(summed[path][k])
            if k in ("absmax", "min", "max", "count", "sample"):  # pmax / pmin / psum of integers / gathered rows: exact
                assert np.array_equal(s, r), (path, k)
            else:  # psum: same sum, backend's order
                np.testing.assert_allclose(s, r, rtol=2e-6, atol=1e-6, err_msg=f"{path} {k}")
    assert float(ref["layers_0/attn/q_proj/kernel"]["count"]) == windows.size


@pytest.mark.parametrize("method,args,act", [
    ("gptq", {"damp": 0.01, "block_size": 8}, None),          # sequential: quantized blocks feed the next
    ("smoothquant", {"alpha": 0.5}, Spec(8, "tensor")),       # float-model statistics, static act scales
])
def test_sharded_calibrated_method_equals_single_device(method, args, act):
    from llmeq_jax.core.rules import Recipe, Rule
    from llmeq_jax.methods import quantize_model

    recipe = Recipe((Rule(r"lm_head/kernel", skip=True),
                     Rule(r".*/kernel", weight=Spec(4, "group", group_size=16), act=act, act_static=act is not None)),
                    method=method, method_args=args, name=f"{method}-dist")
    windows = tiny.windows(8)
    ref, _ = quantize_model(tiny.CONFIG, tiny.params(), recipe, windows, calibrate_fn=functools.partial(
        calibrate.calibrate, batch_size=1))
    got, _ = dist.quantize_model_sharded(tiny.CONFIG, tiny.params(), recipe, windows, dist.make_mesh(4, 2),
                                         batch_size=1)
    n = 0
    for kp, leaf in jax.tree_util.tree_leaves_with_path(ref, is_leaf=lambda x: isinstance(x, QArray)):
        other = functools.reduce(lambda t, k: t[k.key], kp, got)
        if isinstance(leaf, QArray):
            assert_qarray_equal(other, leaf)
            if leaf.act_scale is not None:
                assert np.array_equal(dist.to_host(other.act_scale), np.asarray(leaf.act_scale))
            n += 1
        else:
            assert np.array_equal(dist.to_host(other), np.asarray(leaf)), kp
    assert n == 7 * tiny.CONFIG.num_layers


def test_uneven_calibration_split_is_refused():
    mesh = dist.make_mesh(4, 2)
    with pytest.raises(calibrate.CalibrationError, match="multiple of 4"):
        dist.calibrate_sharded(tiny.CONFIG, tiny.params(), tiny.windows(6), mesh)


def online_quantize_reference(x, state=None, *, alpha=0.9, eps=float(jnp.finfo(jnp.float32).tiny), per_channel=True,
                              bits=8):
    """One device's EMA step: range ``alpha * state + (1 - alpha) * max(absmax, eps)``, then symmetric int8."""
    qmax = 2 ** (bits - 1) - 1
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=0) if per_channel else jnp.max(jnp.abs(xf))
    observed = jnp.maximum(amax, eps)
    new = observed if state is None else alpha * state.astype(jnp.float32) + (1.0 - alpha) * observed
    scale = new / qmax
    return jnp.clip(jnp.round(xf / scale), -qmax, qmax).astype(jnp.int8), new, scale, None


def test_online_scales_agree_across_shards():
    mesh = dist.make_mesh(8, 1)
    xs = [jax.random.normal(jax.random.key(i), (64, 24)) * (1 + i) for i in range(3)]
    for per_channel in (True, False):
        ref = jax.jit(functools.partial(online_quantize_reference, alpha=0.8, per_channel=per_channel))
        state = ref_state = None
        for step, x in enumerate(xs):
            q, state, scale = dist.online_quantize_sharded(x, state, mesh, alpha=0.8, per_channel=per_channel)
            rq, ref_state, rscale, _ = ref(x, ref_state)
            # Every device holds the same tracked range and scale, bit for bit.
            for arr in (state, scale):
                shards = [np.asarray(s.data) for s in arr.addressable_shards]
                assert len(shards) == 8 and all(np.array_equal(shards[0], s) for s in shards[1:])
            if step == 0:  # first step: the range is the (pmax-ed) absmax itself, exact
                assert np.array_equal(np.asarray(state), np.asarray(ref_state))
            # Later steps: the EMA's multiply-add may round differently in another fusion (1-2 ulp).
            np.testing.assert_allclose(np.asarray(state), np.asarray(ref_state), rtol=1e-6)
            np.testing.assert_allclose(np.asarray(scale), np.asarray(rscale), rtol=1e-6)
            assert np.mean(np.asarray(q) != np.asarray(rq)) < 1e-3


def test_sharded_model_matches_single_device():
    params, windows = tiny.params(), tiny.windows(8)
    stats, _ = calibrate.calibrate(tiny.CONFIG, params, windows, wants=("absmax",), batch_size=2)
    qparams = quantize_params(params, tiny.recipe(), stats)
    mesh = dist.make_mesh(2, 4)
    sq = dist.quantize_params_sharded(params, tiny.recipe(), mesh, stats)
    # Quantizing where the weights live gives the same tree as quantizing on one device.
    for path in ("layers_0/attn/q_proj/kernel", "layers_1/mlp/down_proj/kernel", "lm_head/kernel"):
        a, b = sq, qparams
        for k in path.split("/"):
            a, b = a[k], b[k]
        assert_qarray_equal(a, b)
    assert sq["layers_0"]["mlp"]["up_proj"]["kernel"].qvalue.sharding.spec == P(None, "model")
    on_mesh = dist.shard_params(qparams, mesh)
    want = np.asarray(forward(tiny.CONFIG, qparams, windows))
    got = dist.forward_on_mesh(tiny.CONFIG, on_mesh, windows, mesh)
    assert got.sharding.spec[0] == dist.DATA
    # Column-parallel matmuls compute whole outputs; only XLA's fusion order may differ.
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # Perplexity (DESIGN §6 protocol) with each batch split over the data axis.
    from llmeq_jax.evaluate import perplexity

    ppl_1 = perplexity(lambda t: forward(tiny.CONFIG, qparams, t), windows, batch_size=4)
    ppl_m = dist.perplexity_on_mesh(tiny.CONFIG, on_mesh, windows, mesh, batch_size=4)
    assert ppl_m["tokens"] == ppl_1["tokens"] and abs(ppl_m["nll"] - ppl_1["nll"]) < 1e-5
    prompt = windows[:2, :5]
    assert np.array_equal(np.asarray(generate(tiny.CONFIG, on_mesh, prompt, 3)),
                          np.asarray(generate(tiny.CONFIG, qparams, prompt, 3)))


def test_checkpoint_saved_on_2x4_restores_on_8x1(tmp_path):
    params, windows = tiny.params(), tiny.windows(8)
    stats, _ = calibrate.calibrate(tiny.CONFIG, params, windows, wants=("absmax",), batch_size=2)
    mesh_a, mesh_b = dist.make_mesh(2, 4), dist.make_mesh(8, 1)
    sq = dist.quantize_params_sharded(params, tiny.recipe(), mesh_a, stats)
    checkpoint.save_model_checkpoint(tmp_path / "ck", tiny.CONFIG, sq, recipe=tiny.recipe())
    restored = dist.restore_on_mesh(tmp_path / "ck", mesh_b, partition=lambda p, s, m: P("data") if p.endswith(
        "kernel") and s[0] % 8 == 0 else P())
    k = restored["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert k.qvalue.sharding.is_equivalent_to(NamedSharding(mesh_b, P("data")), 2)
    # Groups of 16 rows cross the 4-row shards of the (8, 1) mesh, so that scale is replicated.
    assert k.scale.sharding.is_fully_replicated
    flat_a = jax.tree_util.tree_leaves_with_path(sq, is_leaf=lambda x: isinstance(x, QArray))
    flat_b = dict(jax.tree_util.tree_leaves_with_path(restored, is_leaf=lambda x: isinstance(x, QArray)))
    assert len(flat_a) == len(flat_b)
    for path, leaf in flat_a:
        other = flat_b[path]
        if isinstance(leaf, QArray):
            assert_qarray_equal(other, leaf)
            assert (leaf.act_scale is None) == (other.act_scale is None)
        else:
            assert np.array_equal(dist.to_host(other), dist.to_host(leaf))
    want = np.asarray(forward(tiny.CONFIG, quantize_params(params, tiny.recipe(), stats), windows))
    got = dist.forward_on_mesh(tiny.CONFIG, restored, windows, mesh_b)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_prefill_kernels_stay_in_xla_with_several_devices():
    """Prefill-sized native products are custom calls, which XLA's SPMD partitioner runs
    replicated: with several devices the many-row paths, the packed panels and the RoPE
    conditional stay off, so a data-sharded program stays sharded."""
    from llmeq_jax import decode_layout, native, ops

    assert jax.device_count() == 8 and not native.prefill_kernels_ok()
    w = quantize(jnp.asarray(np.random.default_rng(0).standard_normal((64, 48)), jnp.float32), Spec(bits=8))
    hlo = jax.jit(lambda a: ops.linear(a, w)).lower(jnp.ones((ops.NATIVE_PANEL_MIN_ROWS + 36, 64))).as_text()
    assert "llmeq_" not in hlo
    packed = decode_layout.for_prefill(tiny.params())
    assert not any(isinstance(a, decode_layout.PanelKernel)
                   for a in jax.tree_util.tree_leaves(packed, is_leaf=lambda a: isinstance(a, decode_layout.PanelKernel)))
    from llmeq_jax.core.rope import apply_rope, rope_inv_freq

    inv = rope_inv_freq(16, 10000.0, None)
    rope_hlo = jax.jit(lambda x, p: apply_rope(x, p, inv)).lower(jnp.ones((1, 32, 2, 16)), jnp.arange(32)[None]).as_text()
    assert "conditional" not in rope_hlo and "case" not in rope_hlo
    # nor the float GEMV (a float model sharded over the devices keeps XLA's sharded dots), stacked or not
    from llmeq_jax.models import stacked

    wb = jnp.ones((64, 48), jnp.bfloat16)
    assert "llmeq_" not in jax.jit(lambda a: ops.linear(a, wb)).lower(jnp.ones((1, 64), jnp.bfloat16)).as_text()
    assert not stacked.float_views(False)
