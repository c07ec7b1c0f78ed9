"""FP8 (E4M3) grids: codes, scales, QArray round trip, FP8 W8A8 in ops.linear, recipes, checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import ops
from llmeq_jax.core import fp8grid
from llmeq_jax.core.quantize import Spec, fake_quant, quantize, quantize_dequantize
from llmeq_jax.core.rules import RecipeError, Rule, recipe_from_dict, static_act_scale

W8 = Spec(8, "channel", grid="fp8")
A8 = Spec(8, "token", grid="fp8")


def _every_code() -> np.ndarray:
    """All 254 finite E4M3FN bit patterns (0x7F / 0xFF are NaN) as int8."""
    codes = np.arange(-128, 128, dtype=np.int8)
    return codes[(codes.view(np.uint8) & 0x7F) != 0x7F]


def test_every_finite_code_decodes_to_its_float_and_encodes_back():
    codes = jnp.asarray(_every_code())
    values = fp8grid.decode(codes)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(codes).view(jnp.float8_e4m3fn).astype(np.float32))
    assert float(jnp.max(values)) == fp8grid.MAX == 448.0
    back = np.asarray(fp8grid.encode(values))
    # +0 and -0 are two codes of one value: compare values, and codes where the value is not zero
    np.testing.assert_array_equal(np.asarray(fp8grid.decode(back)), np.asarray(values))
    nonzero = np.asarray(values) != 0
    np.testing.assert_array_equal(back[nonzero], np.asarray(codes)[nonzero])


def test_encode_rounds_to_nearest_and_saturates_instead_of_nan():
    # 1.0 and 1.125 are neighbours (3 mantissa bits): 1.06 -> 1.0, 1.07 -> 1.125; 1.0625 ties to even (1.0)
    r = jnp.array([1.06, 1.07, 1.0625, 500.0, -1e6, 448.0, 0.0])
    np.testing.assert_array_equal(np.asarray(fp8grid.decode(fp8grid.encode(r))),
                                  [1.0, 1.125, 1.0, 448.0, -448.0, 448.0, 0.0])


def test_quantize_maps_each_channels_absmax_onto_448():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((300, 16)).astype(np.float32))
    q = quantize(w, W8)
    assert q.grid == "fp8" and q.qvalue.dtype == jnp.int8 and q.qvalue.shape == (300, 16)
    assert q.nbytes == 300 * 16 + 16 * 4  # one byte per value, one float32 scale per channel
    np.testing.assert_allclose(np.asarray(q.scale)[0], np.abs(np.asarray(w)).max(axis=0) / 448.0, rtol=1e-6)
    y = np.asarray(q.dequantize())
    np.testing.assert_array_equal(y, np.asarray(quantize_dequantize(w, W8)))
    # the channel absmax is exact; every value within E4M3's half-ulp (2^-4 relative) above the subnormals
    np.testing.assert_allclose(np.abs(y).max(axis=0), np.abs(np.asarray(w)).max(axis=0), rtol=1e-6)
    big = np.abs(np.asarray(w)) > np.asarray(q.scale)[0] * 2.0 ** -6
    assert np.all(np.abs(y - np.asarray(w))[big] <= np.abs(np.asarray(w))[big] * 2.0 ** -4 + 1e-7)


def test_fp8_keeps_small_values_of_an_outlier_tile_better_than_int8():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    x[:, 7] *= 100.0  # one outlier feature per token
    x = jnp.asarray(x)

    def err(spec):
        return float(jnp.linalg.norm(quantize_dequantize(x, spec)[:, 8:] - x[:, 8:]))

    assert err(A8) < 0.5 * err(Spec(8, "token"))


def test_fake_quant_matches_and_gradient_is_straight_through():
    x = jnp.array([[0.1, -0.7, 2.0, 0.0]], jnp.float32)
    spec = Spec(8, "tensor", grid="fp8", clip=0.5)
    np.testing.assert_array_equal(np.asarray(fake_quant(x, spec)), np.asarray(quantize_dequantize(x, spec)))
    g = jax.grad(lambda v: jnp.sum(fake_quant(v, spec)))(x)
    np.testing.assert_array_equal(np.asarray(g), [[1, 1, 0, 1]])  # 2.0 lies beyond the clipped range 1.0


def test_linear_runs_fp8_dots_that_match_their_definition():
    """y = sum_k fp8(x / sx) fp8(w / sw) * sx * sw, per token and channel; beats int8 W8A8 on an outlier input."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((256, 40)).astype(np.float32))
    x = rng.standard_normal((5, 256)).astype(np.float32)
    x[:, 3] *= 50.0
    x = jnp.asarray(x)
    q = quantize(w, W8, act_spec=A8)
    sx = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 448.0
    xq = fp8grid.decode(fp8grid.encode(x / sx)) * sx
    want = xq @ q.dequantize()
    y = ops.linear(x, q)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-4)
    exact = x @ w
    fp8_err = float(jnp.linalg.norm(y - exact))
    int8_err = float(jnp.linalg.norm(ops.linear(x, quantize(w, Spec(8, "channel"), act_spec=Spec(8, "token"))) - exact))
    assert fp8_err < int8_err
    # groups along K; and without an act spec, a weight-only product of the E4M3 values
    qg = quantize(w, Spec(8, "group", group_size=64, grid="fp8"), act_spec=A8)
    np.testing.assert_allclose(np.asarray(ops.linear(x, qg)), np.asarray(xq @ qg.dequantize()), rtol=1e-5, atol=1e-3)
    qw = quantize(w, W8)
    np.testing.assert_allclose(np.asarray(ops.linear(x, qw)), np.asarray(x @ qw.dequantize()), rtol=1e-6, atol=1e-4)


def test_fp8_dots_stay_fp8_in_the_program():
    q = quantize(jnp.ones((64, 32)), W8, act_spec=A8)
    text = jax.jit(lambda x: ops.linear(x, q, backend="xla")).lower(jnp.ones((2, 64))).as_text()
    assert "f8E4M3FN" in text and "dot_general" in text


def test_static_fp8_activation_scale_maps_the_calibrated_absmax_onto_448():
    stats = {"p": {"absmax": jnp.array([3.0, 8.96])}}
    assert float(static_act_scale("p", stats, act=A8)) == pytest.approx(8.96 / 448.0)
    assert float(static_act_scale("p", stats)) == pytest.approx(8.96 / 127.0)


def test_bad_specs_and_mixed_grids_fail_with_what_was_expected():
    with pytest.raises(ValueError, match="needs bits=8"):
        Spec(4, grid="fp8")
    with pytest.raises(ValueError, match="symmetric=True"):
        Spec(8, grid="fp8", symmetric=False)
    with pytest.raises(ValueError, match="clip='mse'"):
        Spec(8, grid="fp8", clip="mse")
    with pytest.raises(RecipeError, match="need an fp8 weight grid"):
        Rule(".*", weight=Spec(8, "channel"), act=A8)
    with pytest.raises(RecipeError, match="need a uniform weight grid"):
        Rule(".*", weight=W8, act=Spec(8, "token"))
    with pytest.raises(RecipeError, match="act_ema"):
        Rule(".*", weight=W8, act=Spec(8, "tensor", grid="fp8"), act_ema=0.9)
    with pytest.raises(ValueError, match="cannot meet"):
        ops.w8a8_xla(jnp.ones((2, 64)), quantize(jnp.ones((64, 8)), W8), Spec(8, "token"))
    with pytest.raises(ValueError, match="cannot meet"):  # one row: no native int8 kernel may take fp8 activations
        ops.linear(jnp.ones((1, 64)), quantize(jnp.ones((64, 8)), Spec(8, "channel")), act=A8)


def test_recipe_and_checkpoint_round_trips_keep_the_grid(tmp_path):
    from llmeq_jax import checkpoint as ck
    from llmeq_jax.pipeline import read_recipe

    r = read_recipe("fp8-w8a8")
    assert r.rules[-1].weight.grid == "fp8" and r.rules[-1].act.grid == "fp8"
    assert recipe_from_dict(r.to_dict()).rules[-1] == r.rules[-1]
    w = jnp.asarray(np.random.default_rng(3).standard_normal((64, 32)).astype(np.float32))
    q = quantize(w, W8, act_spec=A8)
    saved = ck.save(tmp_path / "c", {"l": {"kernel": q}}, metadata={"model_type": "llama"})
    back = ck.restore(saved)["l"]["kernel"]
    assert back.grid == "fp8" and back.act_spec == A8
    assert [r["grid"] for r in ck.describe_layout(ck.read_manifest(saved)["layout"])] == ["fp8"]  # llmeq inspect
    np.testing.assert_array_equal(np.asarray(back.dequantize()), np.asarray(q.dequantize()))


def test_calibrated_methods_refuse_fp8_rules():
    from llmeq_jax.methods import quantize_model

    recipe = recipe_from_dict({"name": "g", "method": "gptq", "rules": [{"pattern": ".*/kernel", "weight": {
        "bits": 8, "granularity": "channel", "grid": "fp8"}}]})
    with pytest.raises(RecipeError, match="use method rtn for log2 and fp8"):
        quantize_model(None, {"layers_0": {"q": {"kernel": jnp.ones((4, 4))}}}, recipe, np.zeros((1, 4), np.int32))


def test_fp8_recipes_on_a_real_model_stay_near_float_and_scan_like_unrolled():
    """stories260K: both FP8 recipes within 3 % of the float perplexity (int8 W8A8's neighbourhood); the
    stacked (scanned) model computes the unrolled one's logits; greedy generation runs end to end."""
    from llmeq_jax import evaluate, pipeline
    from llmeq_jax.generate import generate
    from llmeq_jax.models import forward
    from llmeq_jax.models import stacked
    from tests.shared_data import stories_with_windows

    config, params, wins = stories_with_windows(128, 4)

    def ppl(p):
        return evaluate.perplexity(lambda q, t: forward(config, q, t), wins, batch_size=4, params=p)["ppl"]

    base = ppl(params)
    for name in ("fp8-w8a8", "fp8-w8a8-static"):
        recipe = pipeline.read_recipe(name)
        from llmeq_jax.methods import quantize_model

        qp, _ = quantize_model(config, params, recipe, wins[:2])
        kernel = qp["layers_0"]["attn"]["q_proj"]["kernel"]
        assert kernel.grid == "fp8" and kernel.act_spec.grid == "fp8"
        assert (kernel.act_scale is not None) == name.endswith("static")
        assert abs(ppl(qp) / base - 1) < 0.03, (name, ppl(qp), base)
    tokens = jnp.asarray(wins[:2, :16])
    np.testing.assert_allclose(np.asarray(forward(config, stacked.stack_blocks(config, qp), tokens)),
                               np.asarray(forward(config, qp, tokens)), rtol=1e-5, atol=1e-4)
    out = generate(config, qp, tokens[:, :4], 6)
    assert out.shape == (2, 6)  # the new tokens
