"""Rotations (methods/rotate.py): exact invariance, the online Hadamard before down_proj, composition, errors."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import calibrate, evaluate, methods
from llmeq_jax.core.qarray import QArray
from llmeq_jax.core.rules import RecipeError, recipe_from_dict
from llmeq_jax.methods import rotate
from llmeq_jax.models import forward, load_model
from llmeq_jax.models.layers import apply_kron
from tests.methods.tiny_models import tiny_model, tiny_windows
from tests.shared_data import shared_data_path

SPEC = rotate.parse_rotate({"kind": "hadamard", "seed": 0, "online_down_proj": True, "rotate_vo": True})


def _rules(act_static=True, bits=8, group=None):
    w = {"bits": bits, "granularity": "channel"} if group is None else \
        {"bits": bits, "granularity": "group", "group_size": group, "symmetric": False}
    kernel = {"pattern": ".*/kernel", "weight": w}
    if act_static:
        kernel.update(act={"bits": 8, "granularity": "tensor"}, act_static=True)
    return [{"pattern": "embed/embedding", "weight": {"bits": 8, "granularity": "channel"}},
            {"pattern": ".*lm_head.*", "skip": True}, kernel]


@pytest.mark.parametrize("n", [4, 12, 20, 24, 48, 576, 1536])
def test_hadamard_is_orthogonal(n):
    h = rotate.kron(rotate.kron_factors(n, "test"))
    assert h.shape == (n, n)
    np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-12)
    np.testing.assert_allclose(np.abs(h), 1 / math.sqrt(n), atol=1e-12)  # a true Hadamard: all entries +-1/sqrt(n)


def test_smollm2_sizes_factor_into_known_hadamards():
    assert math.prod(rotate.hadamard_factors(576)) == 576 and math.prod(rotate.hadamard_factors(1536)) == 1536
    assert rotate.hadamard_factors(172) is None  # stories260K's intermediate size: online rotation falls back


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("spec", [SPEC, rotate.parse_rotate({"kind": "random", "online_down_proj": False}),
                                  rotate.parse_rotate({"online_down_proj": True, "seed": 3})])
def test_rotation_keeps_the_float_model(tied, spec):
    config, params = tiny_model("llama")
    if tied:
        config = dataclasses.replace(config, tie_word_embeddings=True)
        params = {k: v for k, v in params.items() if k != "lm_head"}
    toks = jnp.asarray(tiny_windows(config, 2, 16))
    ref = forward(config, params, toks)
    r = rotate.rotate_params(config, params, spec)
    assert "lm_head" in r  # a tied head is untied (the table is rotated, the head holds the final norm)
    assert all(float(jnp.max(jnp.abs(r[f"layers_{i}"]["input_norm"]["scale"] - 1))) == 0 for i in range(2))
    assert ("down_rot" in r["layers_0"]["mlp"]) == spec["online_down_proj"]
    np.testing.assert_allclose(forward(config, r, toks), ref, atol=2e-4, rtol=1e-4)


def test_rotation_keeps_stories260k():
    config, params, _ = load_model(str(shared_data_path("stories260K.gguf")))
    toks = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 32)))
    ref = forward(config, params, toks)
    r = rotate.rotate_params(config, params, SPEC)
    np.testing.assert_allclose(forward(config, r, toks), ref, atol=2e-4 * float(jnp.max(jnp.abs(ref))))


def test_online_rotation_is_the_kron_product_and_calibration_sees_it():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, 48)), jnp.float32)
    fs = rotate.kron_factors(48, "test")
    np.testing.assert_allclose(apply_kron(x, [jnp.asarray(f) for f in fs]), x @ rotate.kron(fs), atol=1e-5)

    config, params = tiny_model("llama")
    r = rotate.rotate_params(config, params, SPEC)
    factors = [r["layers_0"]["mlp"]["down_rot"][f"f_{i}"] for i in range(len(r["layers_0"]["mlp"]["down_rot"]))]
    h = rotate.kron([np.asarray(f, np.float64) for f in factors])
    windows = tiny_windows(config, 2, 16)
    stats, _ = calibrate.calibrate(config, r, windows, wants=("sample",))
    # Without the online rotation, down_proj's input is silu(gate) * up; the rotated model's kernel is
    # H^T W Q, so its captured input must be (silu(gate) * up) @ H: check against the same block without it.
    plain = {**r, "layers_0": {**r["layers_0"], "mlp": {k: v for k, v in r["layers_0"]["mlp"].items()
                                                          if k != "down_rot"}}}
    plain_stats, _ = calibrate.calibrate(config, plain, windows, wants=("sample",))
    xs = np.asarray(plain_stats["layers_0/mlp/down_proj/kernel"]["sample"], np.float64)
    np.testing.assert_allclose(stats["layers_0/mlp/down_proj/kernel"]["sample"], xs @ h, atol=1e-4)


@pytest.mark.parametrize("method,rules,args", [
    ("rtn", _rules(), {}),
    ("smoothquant", _rules(), {"alpha": "auto"}),
    ("gptq", _rules(act_static=True, bits=4, group=32), {"act_order": True}),
    ("awq", _rules(act_static=False, bits=4, group=32), {}),
])
def test_rotation_composes_with_methods(method, rules, args):
    config, params = tiny_model("llama")
    windows = tiny_windows(config, 4, 32)
    rec = recipe_from_dict({"name": "t", "method": method, "method_args": args, "rules": rules,
                            "rotate": {"kind": "hadamard", "seed": 0}})
    q, info = methods.quantize_model(config, params, rec, windows)
    assert info["rotate"]["online_down_proj"] is True
    assert isinstance(q["layers_0"]["mlp"]["down_proj"]["kernel"], QArray)
    assert "down_rot" in q["layers_0"]["mlp"] and "lm_head" in q
    toks = jnp.asarray(windows[:2])
    ref, out = forward(config, params, toks), forward(config, q, toks)
    assert bool(jnp.all(jnp.isfinite(out)))
    assert float(jnp.mean((out - ref) ** 2)) < 0.05 * float(jnp.mean(ref ** 2))


def test_rotated_static_w8a8_on_stories260k():
    config, params, tok = load_model(str(shared_data_path("stories260K.gguf")))
    windows = calibrate.calibration_windows(tok, shared_data_path("wikitext2_valid.txt"), 4, 128)
    ev = evaluate.make_windows(evaluate.tokenize_text(tok, shared_data_path("wikitext2_test.txt").read_text()), 128, 4)
    ppl = {}
    for name, rot in (("fp32", None), ("static", None), ("quarot", {"kind": "hadamard"})):
        if name == "fp32":
            q = params
        else:
            rec = recipe_from_dict({"name": name, "method": "rtn", "rules": _rules(), "rotate": rot})
            q, _ = methods.quantize_model(config, params, rec, windows)
        ppl[name] = evaluate.perplexity(lambda t: forward(config, q, t), ev, batch_size=4)["ppl"]
    assert all(math.isfinite(p) for p in ppl.values()), ppl
    assert abs(ppl["quarot"] / ppl["fp32"] - 1) < 0.05, ppl


@pytest.mark.parametrize("rot,msg", [
    ({"kind": "hadamrd"}, "kind must be one of"),
    ({"sede": 1}, "unknown key"),
    ({"seed": "1"}, "seed must be int"),
    ({"online_down_proj": "yes"}, "true or false"),
    ({"smooth_down": 1.5}, r"smooth_down must be in \[0, 1\]"),
    ({"smooth_down": "0.5"}, "smooth_down must be float"),
    ({"smooth_down": 0.5, "online_down_proj": False}, "needs online_down_proj"),
    ("hadamard", "expected a mapping"),
])
def test_bad_rotate_config_is_one_clear_error(rot, msg):
    with pytest.raises(RecipeError, match=msg):
        recipe_from_dict({"name": "bad", "rules": _rules(), "rotate": rot})


def test_rotation_refuses_what_it_cannot_do():
    config, params = tiny_model("gpt2")
    with pytest.raises(RecipeError, match="RMSNorm"):
        rotate.rotate_params(config, params, SPEC)
    config, params = tiny_model("llama")
    odd = dataclasses.replace(config, hidden_size=36)  # 36 = 4 * 9: no Sylvester/Paley product
    with pytest.raises(RecipeError, match="kind: random"):
        rotate.residual_rotation(odd.hidden_size, SPEC)


def test_recipe_round_trips_rotate():
    rec = recipe_from_dict({"name": "r", "rules": _rules(), "rotate": {"seed": 2}})
    assert rec.rotate == {"kind": "hadamard", "seed": 2, "online_down_proj": True, "rotate_vo": False,
                          "smooth_down": 0.0}
    assert recipe_from_dict(rec.to_dict()).rotate == rec.rotate


def test_act_clip_scales_the_static_scale_and_is_checked():
    from llmeq_jax.core.rules import static_act_scale

    stats = {"p/kernel": {"absmax": jnp.asarray([1.0, 2.54])}}
    assert float(static_act_scale("p/kernel", stats, 0.5)) == pytest.approx(0.5 * 2.54 / 127)
    for bad, msg in ((0.0, r"\(0, 1\]"), (1.5, r"\(0, 1\]"), (True, r"\(0, 1\]")):
        rules = _rules()
        rules[-1]["act_clip"] = bad
        with pytest.raises(RecipeError, match=msg):
            recipe_from_dict({"name": "bad", "rules": rules})
    rules = _rules(act_static=False)
    rules[-1]["act_clip"] = 0.8
    with pytest.raises(RecipeError, match="act_clip applies to static"):
        recipe_from_dict({"name": "bad", "rules": rules})
    rules = _rules()
    rules[-1]["act_clip"] = 0.8
    assert recipe_from_dict(recipe_from_dict({"name": "ok", "rules": rules}).to_dict()).rules[-1].act_clip == 0.8


def test_smooth_down_keeps_the_function_and_shrinks_down_proj_input():
    config, params = tiny_model("llama")
    windows = tiny_windows(config, 4, 32)
    sm = methods.smooth_down_proj(config, params, windows, 0.5)
    toks = jnp.asarray(windows[:2])
    np.testing.assert_allclose(forward(config, sm, toks), forward(config, params, toks), atol=2e-4, rtol=1e-4)
    for name in ("q_proj", "o_proj"):  # only up_proj's columns and down_proj's rows change
        np.testing.assert_array_equal(sm["layers_0"]["attn"][name]["kernel"], params["layers_0"]["attn"][name]["kernel"])
    assert not np.allclose(sm["layers_0"]["mlp"]["up_proj"]["kernel"], params["layers_0"]["mlp"]["up_proj"]["kernel"])
    before, _ = calibrate.calibrate(config, params, windows, wants=("absmax",))
    after, _ = calibrate.calibrate(config, sm, windows, wants=("absmax",))
    k = "layers_0/mlp/down_proj/kernel"
    # max|h_j| / s_j with s_j = sqrt(max|h_j| / max|W_j|): the channels' spread shrinks
    spread = lambda a: float(jnp.max(a) / jnp.median(a))  # noqa: E731
    assert spread(after[k]["absmax"]) < spread(before[k]["absmax"])


def test_smooth_down_recipe_composes_and_needs_calibration():
    config, params = tiny_model("llama")
    windows = tiny_windows(config, 4, 32)
    rec = recipe_from_dict({"name": "t", "method": "rtn", "rules": _rules(),
                            "rotate": {"kind": "hadamard", "seed": 0, "smooth_down": 0.5}})
    assert methods.needs_calibration(rec)
    q, info = methods.quantize_model(config, params, rec, windows)
    assert info["rotate"]["smooth_down"] == 0.5
    toks = jnp.asarray(windows[:2])
    ref, out = forward(config, params, toks), forward(config, q, toks)
    assert float(jnp.mean((out - ref) ** 2)) < 0.05 * float(jnp.mean(ref ** 2))
    weight_only = recipe_from_dict({"name": "w", "method": "rtn", "rules": _rules(act_static=False),
                                    "rotate": {"smooth_down": 0.5}})
    assert methods.needs_calibration(weight_only)
    with pytest.raises(RecipeError, match="needs calibration windows"):
        methods.quantize_model(config, params, weight_only, None)


@pytest.mark.parametrize("name,method,act,bits,group", [
    ("quarot-gptq-w4-g128", "gptq", None, 4, 128),
    ("quarot-rtn-w4-g128", "rtn", None, 4, 128),
    ("quarot-gptq-w4a8-dynamic", "gptq", ("token", False), 4, 128),
    ("quarot-gptq-w3-g128", "gptq", None, 3, 128),
    ("quarot-gptq-w2-g64", "gptq", None, 2, 64),
])
def test_quarot_low_bit_recipes_load_and_run_on_stories260k(name, method, act, bits, group):
    from llmeq_jax.pipeline import read_recipe

    recipe = read_recipe(name)
    assert recipe.method == method and recipe.rotate["online_down_proj"] is True
    rule = recipe.rule_for("layers_0/mlp/down_proj/kernel")
    assert (rule.weight.bits, rule.weight.group_size, rule.weight.symmetric) == (bits, group, False)
    assert (None if rule.act is None else (rule.act.granularity, rule.act_static)) == act
    config, params, tok = load_model(str(shared_data_path("stories260K.gguf")))
    windows = calibrate.calibration_windows(tok, shared_data_path("wikitext2_valid.txt"), 2, 64)
    q, info = methods.quantize_model(config, params, recipe, windows if methods.needs_calibration(recipe) else None)
    assert "down_rot" in q["layers_0"]["mlp"] and isinstance(q["layers_0"]["mlp"]["down_proj"]["kernel"], QArray)
    toks = jnp.asarray(windows[:1])
    ref, out = forward(config, params, toks), forward(config, q, toks)
    assert bool(jnp.all(jnp.isfinite(out)))
    # 2-bit groups lose more of the function than 3-4 bits; still bounded (and finite)
    assert float(jnp.mean((out - ref) ** 2)) < (0.5 if bits == 2 else 0.2) * float(jnp.mean(ref ** 2))


def test_quarot_w8a8_static_smooth_recipe_smooths_down_proj_before_rotating():
    from llmeq_jax.pipeline import read_recipe

    recipe = read_recipe("quarot-w8a8-static-smooth")
    assert recipe.method == "rtn" and recipe.rotate["smooth_down"] == 0.6 and recipe.rotate["online_down_proj"]
    rule = recipe.rule_for("layers_0/mlp/down_proj/kernel")
    assert (rule.weight.bits, rule.act.bits, rule.act.granularity, rule.act_static) == (8, 8, "tensor", True)
    assert methods.needs_calibration(recipe)
