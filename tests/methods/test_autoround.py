"""AutoRound: the learned-rounding quantizer (pure functions) and one real block of stories260K."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import calibrate, ops
from llmeq_jax.core.quantize import Spec, quantize
from llmeq_jax.core.rules import RecipeError, Rule, get_path
from llmeq_jax.methods import autoround as ar

SPECS = [Spec(4, "group", group_size=16, symmetric=False), Spec(3, "group", group_size=12, symmetric=True),
         Spec(2, "channel", symmetric=False)]


@pytest.mark.parametrize("spec", SPECS)
def test_initial_parameters_are_round_to_nearest(spec):
    """V = 0, alpha = beta = 1 gives exactly RTN's integer codes (groups that do not divide 40 included)."""
    w = jnp.asarray(np.random.default_rng(0).normal(size=(40, 6)), jnp.float32)
    p = ar.init_params(w, spec)
    qa = ar.to_qarray(w, p, spec)
    rtn = quantize(w, spec)
    np.testing.assert_array_equal(np.asarray(qa.values()), np.asarray(rtn.values()))
    np.testing.assert_allclose(np.asarray(qa.dequantize()), np.asarray(rtn.dequantize()), rtol=1e-6, atol=1e-7)
    fq = ar.fake_quant_rounded(w, p["v"], p["alpha"], p["beta"], spec)
    np.testing.assert_allclose(np.asarray(fq), np.asarray(rtn.dequantize()), rtol=1e-6, atol=1e-7)


def test_gradients_reach_offsets_and_clips_and_projection_keeps_ranges():
    spec = SPECS[0]
    w = jnp.asarray(np.random.default_rng(1).normal(size=(32, 5)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(7, 32)), jnp.float32)
    p = ar.init_params(w, spec)
    g = jax.grad(lambda p: jnp.sum((x @ ar.fake_quant_rounded(w, p["v"], p["alpha"], p["beta"], spec) - x @ w) ** 2))(p)
    assert all(float(jnp.abs(g[k]).sum()) > 0 for k in ("v", "alpha", "beta"))
    moved = ar.project({"k": {"v": p["v"] + 3.0, "alpha": p["alpha"] * 2, "beta": p["beta"] * 0.1}}, 0.5)["k"]
    assert float(moved["v"].max()) == 0.5 and float(moved["alpha"].max()) == 1.0 and float(moved["beta"].min()) == 0.5


def test_bad_rules_and_args_are_one_clear_error():
    with pytest.raises(RecipeError, match="act"):
        ar.check_rule("layers_0/x/kernel", Rule(".*", weight=Spec(8), act=Spec(8, "token")))
    with pytest.raises(RecipeError, match="input dim"):
        ar.check_rule("layers_0/x/kernel", Rule(".*", weight=Spec(4, "group", group_size=8, axis=1)))
    with pytest.raises(RecipeError, match="clip"):
        ar.check_rule("layers_0/x/kernel", Rule(".*", weight=Spec(4, "group", group_size=8, clip="mse")))
    with pytest.raises(RecipeError, match="steps"):
        ar.parse_args({"steps": -1})
    with pytest.raises(RecipeError, match="unknown"):
        ar.parse_args({"iters": 3})


@pytest.fixture(scope="module")
def stories_block():
    from llmeq_jax.models import load_model
    from tests.shared_data import shared_data_path

    config, params, tok = load_model(str(shared_data_path("stories260K.gguf")))
    windows = calibrate.calibration_windows(tok, shared_data_path("wikitext2_valid.txt"), 4, 64)
    inputs = calibrate._block_inputs(config, params, windows, batch_size=2)
    return config, params["layers_0"], inputs


def test_training_lowers_the_block_error_below_rtn_and_gives_a_checkpoint_ops_runs(stories_block):
    config, block, inputs = stories_block
    spec = Spec(4, "group", group_size=32, symmetric=False)
    from llmeq_jax.methods.blockwise import block_kernel_paths

    specs = {r: spec for r in block_kernel_paths(block)}
    args = ar.parse_args({"steps": 24})
    learned, info = ar.train_block(config, 0, block, specs, inputs, args)
    assert info["loss_after"] < 0.8 * info["loss_rtn"], info  # on the calibration data it trained on
    for rel, p in learned.items():
        assert float(jnp.abs(p["v"]).max()) <= 0.5
        assert 0.5 <= float(p["alpha"].min()) and float(p["alpha"].max()) <= 1.0
        assert 0.5 <= float(p["beta"].min()) and float(p["beta"].max()) <= 1.0
    rel = "attn/q_proj/kernel"
    w = get_path(block, rel)
    qa = ar.to_qarray(w, learned[rel], spec)
    assert qa.bits == 4 and qa.zero_point is not None and qa.tile == (32, 1)
    zp = np.asarray(qa.zero_point)
    assert zp.min() >= -8 and zp.max() <= 7
    p = learned[rel]
    np.testing.assert_allclose(np.asarray(qa.dequantize()),
                               np.asarray(ar.fake_quant_rounded(w, p["v"], p["alpha"], p["beta"], spec)),
                               rtol=1e-5, atol=1e-6)
    x = inputs[0][0][0, :5]
    np.testing.assert_allclose(np.asarray(ops.linear(x, qa)), np.asarray(x @ qa.dequantize()), rtol=1e-4, atol=1e-5)


LOW_BIT = {"rtn-w4-g128": (4, 128), "gptq-w4-g128": (4, 128), "gptq-w3-g128": (3, 128), "awq-w4-g128": (4, 128),
           "autoround-w4-g128": (4, 128), "autoround-w3-g128": (3, 128), "autoround-w2-g64": (2, 64)}


@pytest.mark.parametrize("name", sorted(LOW_BIT))
def test_low_bit_recipes_load_asymmetric_and_their_sym_twins_symmetric(name):
    """2-4-bit recipes default to zero-point grids; the symmetric ones stay available as -sym."""
    from llmeq_jax.pipeline import read_recipe
    from llmeq_jax.methods import METHODS

    recipe = read_recipe(name)
    assert recipe.method in METHODS  # the method name resolves
    spec = recipe.rule_for("layers_0/mlp/down_proj/kernel").weight
    assert (spec.bits, spec.group_size, spec.symmetric) == (*LOW_BIT[name], False)
    if recipe.method == "autoround":
        ar.parse_args(dict(recipe.method_args))
    if not name.startswith("autoround"):
        twin = read_recipe(f"{name}-sym")
        tspec = twin.rule_for("layers_0/mlp/down_proj/kernel").weight
        assert twin.name == f"{name}-sym" and tspec.symmetric and tspec.bits == spec.bits


def test_float_targets_are_the_float_models_block_outputs(monkeypatch):
    """float_targets: block i trains toward the float model's output of block i (the float blocks
    chained on the float stream), not the float block i on the quantized stream's inputs."""
    from llmeq_jax.core.rules import Recipe
    from llmeq_jax.methods import quantize_model
    from tests.methods.tiny_models import tiny_model, tiny_windows

    config, params = tiny_model("qwen2", seed=3)
    windows = tiny_windows(config, n=4, t=16)
    rules = (Rule(".*lm_head.*", skip=True), Rule(".*/kernel", weight=Spec(3, "group", group_size=16, symmetric=False)))
    seen = {}
    train = ar.train_block

    def spy(config, layer, block, specs, inputs, opts, targets=None):
        seen[(opts.float_targets, layer)] = (inputs, targets)
        return train(config, layer, block, specs, inputs, opts, targets)

    monkeypatch.setattr(ar, "train_block", spy)
    for flag in (False, True):
        quantize_model(config, params, Recipe(rules=rules, method="autoround",
                                              method_args={"steps": 2, "float_targets": flag}), windows)
    assert seen[(False, 1)][1] is None  # the default: the float block on the quantized stream's inputs
    inputs0, _ = seen[(True, 0)]
    float_h1 = ar.float_outputs(config, 0, params["layers_0"], inputs0)
    want = ar.float_outputs(config, 1, params["layers_1"], [(h, p) for h, (_, p) in zip(float_h1, inputs0)])
    inputs1, got = seen[(True, 1)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    on_quantized = ar.float_outputs(config, 1, params["layers_1"], inputs1)
    assert not np.allclose(np.asarray(on_quantized[0]), np.asarray(want[0]), atol=1e-4)  # the two objectives differ


def test_per_token_loss_is_each_tokens_error_relative_to_its_target_rms(stories_block):
    """loss: per_token divides each token's error by its target's RMS (so a token with massive
    activations weighs as much as any other); the default is the plain MSE."""
    config, block, inputs = stories_block
    from llmeq_jax.methods.blockwise import block_kernel_paths

    spec = Spec(4, "group", group_size=32, symmetric=False)
    specs = {r: spec for r in block_kernel_paths(block)}
    kernels = {r: get_path(block, r).astype(jnp.float32) for r in specs}
    learned = {r: ar.init_params(w, spec) for r, w in kernels.items()}
    hidden, positions = inputs[0]
    target = ar.float_outputs(config, 0, block, [inputs[0]])[0]
    out = ar._student_out(config, 0, block, kernels, learned, specs, hidden, positions)
    err = np.asarray(out - target, np.float64)
    rms = np.sqrt(np.mean(np.asarray(target, np.float64) ** 2, axis=-1, keepdims=True))
    got = float(ar.block_loss(config, 0, block, kernels, learned, specs, hidden, positions, target, per_token=True))
    assert got == pytest.approx(np.mean((err / rms) ** 2), rel=1e-4)
    assert float(ar.block_loss(config, 0, block, kernels, learned, specs, hidden, positions, target)) == \
        pytest.approx(np.mean(err**2), rel=1e-4)
    with pytest.raises(RecipeError, match="loss"):
        ar.parse_args({"loss": "l1"})
