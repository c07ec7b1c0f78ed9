"""Fine-tuning a quantized model against the float one (methods/distill.py) on stories260K and small arrays."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import methods
from llmeq_jax.core.quantize import Spec, quantize
from llmeq_jax.core.rules import RecipeError, recipe_from_dict
from llmeq_jax.methods import distill
from tests.shared_data import shared_data_path, stories_with_windows

RULES = [{"pattern": ".*/kernel", "weight": {"bits": 4, "granularity": "group", "group_size": 32,
                                             "symmetric": False}}]


@pytest.fixture(scope="module")
def stories():
    return stories_with_windows(64)


def _kernel(tree, path):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def test_step_zero_is_the_quantized_model_and_finalize_keeps_it(stories):
    config, params, _ = stories
    q, _ = methods.quantize_model(config, params, recipe_from_dict({"rules": RULES}), None)
    trainable = distill.init_trainable(q)
    assert "layers_0/attn/q_proj/kernel" in trainable and not any("embed" in p for p in trainable)
    student = distill.student_tree(q, trainable)
    for path in trainable:
        np.testing.assert_array_equal(np.asarray(_kernel(student, path)), np.asarray(_kernel(q, path).dequantize()))
    same = distill.finalize(q, trainable)
    for path in trainable:
        a, b = _kernel(same, path), _kernel(q, path)
        np.testing.assert_array_equal(np.asarray(a.qvalue), np.asarray(b.qvalue))
        np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
        assert (a.bits, a.tile, a.pack_axis) == (b.bits, b.tile, b.pack_axis)


def test_the_saved_model_is_what_training_saw(stories):
    """finalize() re-encodes moved weights and scales exactly as the training forward quantized them."""
    config, params, _ = stories
    q, _ = methods.quantize_model(config, params, recipe_from_dict({"rules": RULES}), None)
    trainable = distill.init_trainable(q)
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 2 * len(trainable)))
    moved = {p: {"w": t["w"] + 0.02 * jax.random.normal(next(keys), t["w"].shape),
                 "d": 0.1 * jax.random.normal(next(keys), t["d"].shape)} for p, t in trainable.items()}
    final = distill.finalize(q, moved)
    student = distill.student_tree(q, moved)
    changed = 0
    for path in moved:
        got = np.asarray(_kernel(final, path).dequantize())
        np.testing.assert_allclose(got, np.asarray(_kernel(student, path)), rtol=1e-6, atol=1e-7)
        changed += int(np.sum(np.asarray(_kernel(final, path).values()) != np.asarray(_kernel(q, path).values())))
    assert changed > 0


def test_scale_gradient_is_lsq():
    """Inside the grid d(w_hat)/ds = round(w/s) - w/s; at a clipped end it is that end's code."""
    w = jnp.array([[0.26, -0.9, 0.49, 3.0]], jnp.float32).T  # (4, 1): one channel scale
    q = quantize(w, Spec(4, "channel", axis=1), scale=jnp.array([[0.1]], jnp.float32))
    grad = jax.grad(lambda d: jnp.sum(distill.fake_quant_learned(q, w, d)))(jnp.zeros((1, 1)))
    s = 0.1
    x = np.asarray(w)[:, 0] / s
    inside = np.clip(x, -7, 7) == x
    expected = np.sum(np.where(inside, np.round(x) - x, np.sign(x) * 7)) * s  # d/dd = s * d/ds
    np.testing.assert_allclose(float(grad[0, 0]), expected, rtol=1e-5)
    wgrad = jax.grad(lambda w: jnp.sum(distill.fake_quant_learned(q, w, jnp.zeros((1, 1)))))(w)
    np.testing.assert_array_equal(np.asarray(wgrad)[:, 0], inside.astype(np.float32))  # STE, zero where clipped


def test_recipe_finetune_trains_and_reports(stories):
    config, params, wins = stories
    recipe = recipe_from_dict({"rules": RULES, "finetune": {"steps": 8, "learn": "both", "scale_lr": 0.01,
                                                            "weight_lr": 1e-4, "seq_len": 32}})
    assert recipe.finetune["loss"] == "kl" and recipe_from_dict(recipe.to_dict()).finetune == recipe.finetune
    assert methods.needs_calibration(recipe)
    plain, _ = methods.quantize_model(config, params, recipe_from_dict({"rules": RULES}), None)
    tuned, info = methods.quantize_model(config, params, recipe, wins)
    ft = info["finetune"]
    assert ft["kernels"] == len(distill.init_trainable(plain)) and np.isfinite(ft["last_loss"])
    path = "layers_0/mlp/down_proj/kernel"
    a, b = _kernel(tuned, path), _kernel(plain, path)
    assert a.nbytes == b.nbytes and not np.array_equal(np.asarray(a.scale), np.asarray(b.scale))

    def kl(qp):
        from llmeq_jax.models import forward

        toks = jnp.asarray(wins)
        return float(distill.kl_to_teacher(forward(config, qp, toks), forward(config, params, toks)))

    assert kl(tuned) < kl(plain)


def test_scales_only_leaves_the_latent_weights():
    opts = distill.DistillOptions(learn="scales")
    trainable = {"k": {"w": jnp.ones((4, 4)), "d": jnp.zeros((1, 4))}}
    opt = distill.make_optimizer(opts, trainable)
    grads = {"k": {"w": jnp.ones((4, 4)), "d": jnp.ones((1, 4))}}
    updates, _ = opt.update(grads, opt.init(trainable), trainable)
    assert float(jnp.abs(updates["k"]["w"]).max()) == 0.0 and float(jnp.abs(updates["k"]["d"]).min()) > 0


@pytest.mark.parametrize("finetune, message", [
    ({"stepz": 3}, "unknown finetune"),
    ({"learn": "everything"}, "finetune.learn must be"),
    ({"steps": 0}, "finetune.steps must be"),
    ("yes", "finetune must be a mapping"),
])
def test_bad_finetune_is_one_clear_error(finetune, message):
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict({"rules": RULES, "finetune": finetune})


def test_training_windows_cut_when_they_divide():
    w = np.arange(2 * 512).reshape(2, 512)
    assert distill.training_windows(w, 256).shape == (4, 256)
    np.testing.assert_array_equal(distill.training_windows(w, 256)[1], w[0, 256:])
    assert distill.training_windows(w, 300).shape == (2, 512)


def test_nothing_to_learn_is_an_error(stories):
    config, params, wins = stories
    with pytest.raises(ValueError, match="no kernel"):
        distill.train(config, params, params, wins, distill.DistillOptions(steps=1))


def test_options_dataclass_fields_are_the_yaml_keys():
    assert {f.name for f in dataclasses.fields(distill.DistillOptions)} == set(distill.parse_finetune({}))


def test_pipeline_trains_on_fresh_windows_of_the_calibration_text(stories, tmp_path):
    from llmeq_jax import evaluate
    from llmeq_jax.models import load_model
    from llmeq_jax.pipeline import finetune_windows

    config, _, tok = load_model(str(shared_data_path("stories260K.gguf")))
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i}" for i in range(3000)))
    recipe = recipe_from_dict({"rules": RULES, "finetune": {"steps": 5, "batch_size": 2, "seq_len": 64}})
    wins = finetune_windows(config, tok, recipe, text)
    ids = evaluate.tokenize_text(tok, text.read_text())
    assert wins.shape == (10, 64) and len(np.unique(wins, axis=0)) == 10
    np.testing.assert_array_equal(wins.reshape(-1), ids[:640])
    assert finetune_windows(config, tok, recipe_from_dict({"rules": RULES}), text) is None


@pytest.mark.parametrize("data", distill.DATA)
def test_training_data_by_option(data):
    calib = np.arange(6 * 4).reshape(6, 4)
    asked = []

    def sample(n):
        asked.append(n)
        return -np.arange(1, n * 4 + 1).reshape(n, 4)

    opts = distill.DistillOptions(steps=5, batch_size=1, seq_len=4, data=data)
    out = distill.training_data(opts, calib, sample)
    if data == "calibration":
        assert out is calib and asked == []
    elif data == "sampled":
        assert asked == [5] and (out < 0).all()
    else:  # calibration and sampled windows alternate, steps x batch_size in all
        assert asked == [2] and out.shape == (5, 4)
        np.testing.assert_array_equal(out[0::2], calib[:3])
        np.testing.assert_array_equal(out[1::2], sample(2))


def test_mixed_data_needs_windows_of_seq_len():
    opts = distill.DistillOptions(steps=2, seq_len=8, data="mixed")
    with pytest.raises(ValueError, match="seq_len 8"):
        distill.training_data(opts, np.zeros((4, 16), np.int32), lambda n: np.zeros((n, 8), np.int32))


def test_recipe_finetune_on_sampled_text(stories):
    config, params, wins = stories
    recipe = recipe_from_dict({"rules": RULES, "finetune": {"steps": 4, "batch_size": 2, "seq_len": 32,
                                                            "data": "sampled", "scale_lr": 0.01}})
    assert recipe.finetune["data"] == "sampled" and recipe_from_dict(recipe.to_dict()).finetune == recipe.finetune
    plain, _ = methods.quantize_model(config, params, recipe_from_dict({"rules": RULES}), None)
    # the calibration windows are not what it trains on: garbage there changes nothing
    tuned, info = methods.quantize_model(config, params, recipe, wins)
    same, _ = methods.quantize_model(config, params, recipe, np.zeros_like(wins))
    path = "layers_0/mlp/down_proj/kernel"
    assert not np.array_equal(np.asarray(_kernel(tuned, path).scale), np.asarray(_kernel(plain, path).scale))
    np.testing.assert_array_equal(np.asarray(_kernel(tuned, path).scale), np.asarray(_kernel(same, path).scale))
    assert np.isfinite(info["finetune"]["last_loss"])


def test_bad_finetune_data_is_one_clear_error():
    with pytest.raises(RecipeError, match=r"finetune.data must be one of \['calibration', 'sampled', 'mixed'\]"):
        recipe_from_dict({"rules": RULES, "finetune": {"data": "web"}})
