"""Power-of-two (log2) grids: codes, packing, QArray round trip, ops.linear, recipes, checkpoints."""

import numpy as np
import jax.numpy as jnp
import pytest

from llmeq_jax import ops
from llmeq_jax.core import log2grid
from llmeq_jax.core.qarray import unpack
from llmeq_jax.core.quantize import Spec, fake_quant, quantize, quantize_dequantize
from llmeq_jax.core.rules import RecipeError, Rule, recipe_from_dict


def test_levels_are_powers_of_two_up_to_the_scale():
    np.testing.assert_array_equal(np.asarray(log2grid.magnitudes(4)), 2.0 ** np.arange(-6, 1))
    assert log2grid.qmax(3) == 3


def test_encode_picks_the_nearest_level_in_linear_space():
    # 0.74 < 1.5 * 0.5 -> 0.5; 0.76 -> 1; below half the smallest level (2^-6) -> 0.
    r = jnp.array([0.0, 0.007, 0.009, 0.74, 0.76, 1.0, 3.0, -0.3, -1.0])
    codes = np.asarray(log2grid.encode(r, 4))
    np.testing.assert_array_equal(codes, [0, 0, 1, 6, 7, 7, 7, -5, -7])
    np.testing.assert_array_equal(np.asarray(log2grid.decode(codes, 4)),
                                  [0, 0, 2**-6, 0.5, 1, 1, 1, -0.25, -1])


def test_every_code_round_trips():
    for bits in (2, 3, 4, 7):
        m = log2grid.qmax(bits)
        codes = jnp.arange(-m, m + 1, dtype=jnp.int8)
        np.testing.assert_array_equal(np.asarray(log2grid.encode(log2grid.decode(codes, bits), bits)), np.asarray(codes))


def test_quantize_packs_4bit_codes_two_per_byte_and_dequantizes_to_grid_points():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((300, 16)).astype(np.float32))
    spec = Spec(bits=4, granularity="group", group_size=128, grid="log2")
    q = quantize(x, spec)
    assert q.grid == "log2" and q.qvalue.dtype == jnp.uint8 and q.qvalue.shape == (150, 16)
    codes = np.asarray(unpack(q.qvalue, 4, 0, 300))
    assert codes.min() >= -7 and codes.max() <= 7
    y = np.asarray(q.dequantize())
    np.testing.assert_array_equal(y, np.asarray(quantize_dequantize(x, spec)))
    # every value is 0 or +-scale * 2^k, and each group's absmax is exact
    scale = np.repeat(np.asarray(q.scale), 128, axis=0)[:300]
    rel = np.abs(y) / scale
    assert np.all((rel == 0) | np.isin(rel, 2.0 ** np.arange(-6, 1)))
    assert np.allclose(np.max(np.abs(y[:128]), axis=0), np.max(np.abs(np.asarray(x)[:128]), axis=0))


def test_log2_beats_uniform_on_heavy_tails_and_loses_on_gaussians():
    rng = np.random.default_rng(1)
    heavy = jnp.asarray(rng.standard_t(2, size=(512, 64)).astype(np.float32))
    gauss = jnp.asarray(rng.standard_normal((512, 64)).astype(np.float32))

    def mse(x, grid):
        return float(jnp.mean((quantize_dequantize(x, Spec(bits=4, granularity="channel", grid=grid)) - x) ** 2))

    assert mse(heavy, "log2") < 0.5 * mse(heavy, "uniform")
    assert mse(gauss, "log2") > mse(gauss, "uniform")


def test_linear_uses_the_log2_values():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((256, 24)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((5, 256)).astype(np.float32))
    q = quantize(w, Spec(bits=4, granularity="group", group_size=128, grid="log2"))
    np.testing.assert_allclose(np.asarray(ops.linear(x, q)), np.asarray(x @ q.dequantize()), rtol=1e-5, atol=1e-4)
    t = quantize(w.T, Spec(bits=4, granularity="channel", axis=0, grid="log2"), pack_axis=1)  # (out, in) rows
    np.testing.assert_allclose(np.asarray(ops.linear_nk(x, t)), np.asarray(x @ t.dequantize().T), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ops.take_rows(t, jnp.array([3, 0]))), np.asarray(t.dequantize())[[3, 0]])


def test_fake_quant_forward_matches_and_gradient_passes_inside_the_range():
    import jax

    x = jnp.array([[0.1, -0.7, 2.0, 0.0]], jnp.float32)
    spec = Spec(bits=4, granularity="tensor", grid="log2", clip=0.5)
    np.testing.assert_array_equal(np.asarray(fake_quant(x, spec)), np.asarray(quantize_dequantize(x, spec)))
    g = jax.grad(lambda v: jnp.sum(fake_quant(v, spec)))(x)
    np.testing.assert_array_equal(np.asarray(g), [[1, 1, 0, 1]])  # 2.0 lies beyond the clipped scale 1.0


def test_bad_specs_fail_with_what_was_expected():
    with pytest.raises(ValueError, match="grid='cubic' is not one of"):
        Spec(bits=4, grid="cubic")
    with pytest.raises(ValueError, match="symmetric=True"):
        Spec(bits=4, grid="log2", symmetric=False)
    with pytest.raises(ValueError, match="2 to 7 bits"):
        Spec(bits=8, grid="log2")
    with pytest.raises(ValueError, match="clip='mse'"):
        Spec(bits=4, grid="log2", clip="mse")
    with pytest.raises(RecipeError, match="uniform weight grid"):
        Rule(".*", weight=Spec(bits=4, grid="log2"), act=Spec(bits=8, granularity="token"))


def test_recipe_yaml_round_trip_keeps_the_grid():
    r = recipe_from_dict({"name": "l", "rules": [{"pattern": ".*/kernel", "weight": {
        "bits": 4, "granularity": "group", "group_size": 128, "grid": "log2"}}]})
    assert r.rules[0].weight.grid == "log2"
    assert recipe_from_dict(r.to_dict()).rules[0].weight == r.rules[0].weight


def test_checkpoint_round_trip_keeps_log2_codes(tmp_path):
    from llmeq_jax import checkpoint as ck

    w = jnp.asarray(np.random.default_rng(3).standard_normal((256, 32)).astype(np.float32))
    q = quantize(w, Spec(bits=4, granularity="group", group_size=128, grid="log2"))
    back = ck.restore(ck.save(tmp_path / "c", {"l": {"kernel": q}}, metadata={"model_type": "llama"}))["l"]["kernel"]
    assert back.grid == "log2"
    np.testing.assert_array_equal(np.asarray(back.dequantize()), np.asarray(q.dequantize()))


def test_calibrated_methods_refuse_log2_rules():
    from llmeq_jax.methods import quantize_model

    recipe = recipe_from_dict({"name": "g", "method": "gptq", "rules": [{"pattern": ".*/kernel", "weight": {
        "bits": 4, "granularity": "group", "group_size": 128, "grid": "log2"}}]})
    with pytest.raises(RecipeError, match="use method rtn for log2"):
        quantize_model(None, {"layers_0": {"q": {"kernel": jnp.ones((4, 4))}}}, recipe, np.zeros((1, 4), np.int32))


def test_a_manifest_with_an_unknown_grid_is_refused(tmp_path):
    from llmeq_jax import checkpoint as ck

    q = quantize(jnp.ones((8, 4)), Spec(bits=4, granularity="channel", grid="log2"))
    out = ck.save(tmp_path / "c", {"l": {"kernel": q}}, metadata={"model_type": "llama"})
    manifest = ck.read_manifest(out)
    manifest["layout"]["l/kernel"]["static"]["grid"] = "cubic"
    with pytest.raises(ck.CheckpointError, match="grid 'cubic' is not one of"):
        ck.validate_manifest(manifest)
