"""Rules and recipes: first match wins, unused-rule warnings, what stays float, YAML schema errors."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.core.qarray import QArray, tree_nbytes
from llmeq_jax.core.quantize import Spec
from llmeq_jax.core.rules import (
    Recipe,
    RecipeError,
    Rule,
    UnusedRuleWarning,
    leaf_paths,
    load_recipe,
    quantize_params,
    recipe_from_dict,
)


def _rand(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def tiny_params():
    """A Flax-style param tree: embeddings, norms, biases and (in, out) kernels."""
    layer = lambda i: {  # noqa: E731
        "attn": {
            "q_proj": {"kernel": _rand((16, 16), i), "bias": _rand((16,), i + 1)},
            "o_proj": {"kernel": _rand((16, 16), i + 2)},
        },
        "mlp": {"up_proj": {"kernel": _rand((16, 40), i + 3)}, "down_proj": {"kernel": _rand((40, 16), i + 4)}},
        "input_norm": {"scale": jnp.ones(16)},
    }
    return {
        "embed": {"embedding": _rand((50, 16), 90)},
        "layers_0": layer(0),
        "layers_1": layer(10),
        "final_norm": {"scale": jnp.ones(16)},
        "lm_head": {"kernel": _rand((16, 50), 91)},
    }


def _quietly(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedRuleWarning)
        return fn(*args, **kwargs)


W8 = Spec(bits=8, granularity="channel")
W4 = Spec(bits=4, granularity="group", group_size=8)


# --------------------------------------------------------------------------- matching


def test_first_matching_rule_wins():
    recipe = Recipe(
        rules=(
            Rule(".*/mlp/.*/kernel", weight=W4),
            Rule(".*/kernel", weight=W8),  # also matches the mlp kernels, but comes second
        )
    )
    out = _quietly(quantize_params, tiny_params(), recipe)
    assert out["layers_0"]["mlp"]["up_proj"]["kernel"].bits == 4
    assert out["layers_1"]["mlp"]["down_proj"]["kernel"].tile == (8, 1)
    assert out["layers_0"]["attn"]["q_proj"]["kernel"].bits == 8
    assert out["lm_head"]["kernel"].bits == 8


def test_skip_rule_keeps_float():
    recipe = Recipe(rules=(Rule("lm_head/kernel", skip=True), Rule(".*", weight=W8)))
    out = _quietly(quantize_params, tiny_params(), recipe)
    assert not isinstance(out["lm_head"]["kernel"], QArray)
    assert isinstance(out["layers_1"]["attn"]["o_proj"]["kernel"], QArray)


def test_fullmatch_not_search():
    # "q_proj" alone would match by re.search but not by re.fullmatch.
    recipe = Recipe(rules=(Rule("q_proj", weight=W8), Rule(".*q_proj/kernel", weight=W4)))
    with pytest.warns(UnusedRuleWarning, match="'q_proj' matched no parameter"):
        out = quantize_params(tiny_params(), recipe)
    assert out["layers_0"]["attn"]["q_proj"]["kernel"].bits == 4


def test_only_kernels_and_the_token_table_are_quantized():
    params = tiny_params()
    out = _quietly(quantize_params, params, Recipe(rules=(Rule(".*", weight=W8),)))
    quantizable = [p for p in leaf_paths(params) if p.endswith("/kernel") or p == "embed/embedding"]
    for path, leaf in jax.tree_util.tree_leaves_with_path(out, is_leaf=lambda x: isinstance(x, QArray)):
        name = "/".join(str(k.key) for k in path)
        assert isinstance(leaf, QArray) == (name in quantizable), name
    np.testing.assert_array_equal(
        np.asarray(out["layers_0"]["attn"]["q_proj"]["bias"]), np.asarray(params["layers_0"]["attn"]["q_proj"]["bias"])
    )
    assert tree_nbytes(out) < tree_nbytes(params)


def test_a_rule_for_a_non_kernel_leaf_is_reported_not_silently_applied():
    recipe = Recipe(rules=(Rule("final_norm/scale", weight=W8), Rule(".*/kernel", weight=W8)))
    with pytest.warns(UnusedRuleWarning, match="final_norm/scale"):
        out = quantize_params(tiny_params(), recipe)
    assert not isinstance(out["final_norm"]["scale"], QArray)


def test_unused_rules_warn_with_recipe_and_pattern():
    recipe = Recipe(rules=(Rule(".*/kernel", weight=W8), Rule(".*/gate_proj/kernel", weight=W4)), name="demo")
    with pytest.warns(UnusedRuleWarning) as record:
        quantize_params(tiny_params(), recipe)
    messages = [str(w.message) for w in record]
    assert messages == ["recipe 'demo': rule '.*/gate_proj/kernel' matched no parameter"]


def test_a_head_rule_is_not_reported_on_a_tied_model():
    """Tied head (the embedding table, no lm_head kernel): the ready recipes' ".*lm_head.*" skip rule
    cannot apply and is not reported; a typo'd head rule, or the rule on a tree without the table, is."""
    tied = {"embed": {"embedding": _rand((16, 8))}, "layers_0": {"q_proj": {"kernel": _rand((8, 8))}}}
    head_rule = Rule(".*lm_head.*", skip=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedRuleWarning)
        quantize_params(tied, Recipe(rules=(head_rule, Rule(".*/kernel", weight=W8)), name="tied"))
    with pytest.warns(UnusedRuleWarning, match="'.*lm_haed.*' matched no parameter"):
        quantize_params(tied, Recipe(rules=(Rule(".*lm_haed.*", skip=True), Rule(".*/kernel", weight=W8))))
    with pytest.warns(UnusedRuleWarning, match="'.*lm_head.*' matched no parameter"):
        quantize_params({"layers_0": tied["layers_0"]}, Recipe(rules=(head_rule, Rule(".*/kernel", weight=W8))))


def test_recipe_matching_nothing_is_an_error():
    recipe = Recipe(rules=(Rule(".*/gate_proj/kernel", weight=W4),), name="wrong-model")
    with pytest.raises(RecipeError, match="'wrong-model' matched no quantizable parameter.*kernel paths look like"):
        quantize_params(tiny_params(), recipe)


def test_lists_in_the_tree_give_index_paths():
    params = {"layers": [{"kernel": _rand((8, 8))}, {"kernel": _rand((8, 8), 1)}]}
    out = _quietly(quantize_params, params, Recipe(rules=(Rule("layers/1/kernel", weight=W8), Rule(".*", skip=True))))
    assert isinstance(out["layers"][1]["kernel"], QArray)
    assert not isinstance(out["layers"][0]["kernel"], QArray)


def test_already_quantized_leaves_are_left_alone():
    first = Recipe(rules=(Rule(".*/mlp/.*/kernel", weight=W4), Rule(".*", skip=True)))
    once = _quietly(quantize_params, tiny_params(), first)
    twice = _quietly(quantize_params, once, Recipe(rules=(Rule(".*", weight=W8),)))
    assert twice["layers_0"]["mlp"]["up_proj"]["kernel"] is once["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert twice["layers_0"]["attn"]["q_proj"]["kernel"].bits == 8


def test_quantized_values_follow_the_spec():
    params = tiny_params()
    out = _quietly(quantize_params, params, Recipe(rules=(Rule(".*", weight=W4),)))
    w = params["layers_0"]["mlp"]["down_proj"]["kernel"]
    q = out["layers_0"]["mlp"]["down_proj"]["kernel"]
    err = np.abs(np.asarray(q.dequantize()) - np.asarray(w))
    step = np.repeat(np.asarray(q.scale), 8, axis=0)[: w.shape[0]]
    assert np.all(err <= 0.5 * step * (1 + 1e-6))


# --------------------------------------------------------------------------- activations (W8A8)


def test_dynamic_activation_spec_is_attached():
    act = Spec(bits=8, granularity="token")
    out = _quietly(quantize_params, tiny_params(), Recipe(rules=(Rule(".*", weight=W8, act=act),)))
    q = out["layers_0"]["attn"]["q_proj"]["kernel"]
    assert q.act_spec == act and q.act_scale is None
    assert "act=int8/dynamic" in repr(q)


def test_static_activation_scale_from_stats():
    act = Spec(bits=8, granularity="tensor")
    recipe = Recipe(rules=(Rule("lm_head/kernel", weight=W8, act=act, act_static=True), Rule(".*", skip=True)))
    stats = {"lm_head/kernel": {"absmax": jnp.asarray([0.5, 2.54, 1.0])}}
    out = _quietly(quantize_params, tiny_params(), recipe, stats)
    q = out["lm_head"]["kernel"]
    np.testing.assert_allclose(float(q.act_scale), 2.54 / 127, rtol=1e-6)
    assert q.act_scale.shape == ()
    with pytest.raises(RecipeError, match="static activation scale for 'lm_head/kernel' needs calibration"):
        _quietly(quantize_params, tiny_params(), recipe)


# --------------------------------------------------------------------------- bad input


def test_nan_or_inf_weight_names_the_leaf():
    params = tiny_params()
    bad = np.asarray(params["layers_1"]["mlp"]["up_proj"]["kernel"]).copy()
    bad[3, 4] = np.nan
    bad[0, 0] = np.inf
    params["layers_1"]["mlp"]["up_proj"]["kernel"] = jnp.asarray(bad)
    with pytest.raises(ValueError, match=r"'layers_1/mlp/up_proj/kernel' holds 2 NaN/Inf"):
        quantize_params(params, Recipe(rules=(Rule(".*", weight=W8),)))


def test_an_accelerators_weights_are_counted_where_they_live():
    """Off the host the count runs on the device (one number comes back): it agrees with NumPy's."""
    from llmeq_jax.core import rules

    a = np.random.default_rng(0).normal(size=(64, 48)).astype(np.float32)
    a[[1, 5, 9], [2, 2, 40]] = [np.nan, np.inf, -np.inf]
    for dtype in (jnp.float32, jnp.bfloat16):
        assert int(rules._nonfinite(jnp.asarray(a, dtype))) == 3
    assert int(rules._nonfinite(jnp.ones((3, 3), jnp.bfloat16))) == 0


def test_nan_in_a_skipped_or_float_leaf_is_not_an_error():
    params = tiny_params()
    params["final_norm"]["scale"] = jnp.full(16, jnp.nan)
    _quietly(quantize_params, params, Recipe(rules=(Rule(".*", weight=W8),)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pattern="(", weight=W8), "not a valid regular expression"),
        (dict(pattern=".*", weight=W8, skip=True), "says skip and also gives a spec"),
        (dict(pattern=".*"), "has no weight spec"),
        (dict(pattern=".*", weight=W8, act=Spec(bits=8, granularity="channel")), "must be 'token' or 'tensor'"),
        (dict(pattern=".*", weight=W8, act=Spec(bits=4, granularity="token")), "symmetric int8 or fp8"),
        (dict(pattern=".*", weight=W8, act=Spec(granularity="token", symmetric=False)), "symmetric int8 or fp8"),
        (dict(pattern=".*", weight=W8, act=Spec(granularity="token"), act_static=True), "act_static needs"),
        (dict(pattern=".*", weight=W8, act_static=True), "act_static needs"),
    ],
)
def test_bad_rule(kwargs, match):
    with pytest.raises(RecipeError, match=match):
        Rule(**kwargs)


# --------------------------------------------------------------------------- YAML

GOOD_YAML = """\
method: rtn
method_args: {}
rules:
  - pattern: "lm_head/kernel"
    skip: true
  - pattern: ".*/mlp/.*/kernel"
    weight: {bits: 4, granularity: group, group_size: 8, symmetric: false}
  - pattern: ".*/kernel"
    weight: {bits: 8, granularity: channel}
    act: {bits: 8, granularity: token}
"""


def test_load_recipe_from_yaml(tmp_path):
    path = tmp_path / "w4-mlp.yaml"
    path.write_text(GOOD_YAML)
    recipe = load_recipe(path)
    assert recipe.name == "w4-mlp"  # defaults to the file stem
    assert recipe.rules[0].skip
    assert recipe.rules[1].weight == Spec(bits=4, granularity="group", group_size=8, symmetric=False)
    assert recipe.rules[2].act == Spec(bits=8, granularity="token")
    # The plain-data form reads back to the same recipe.
    assert recipe_from_dict(recipe.to_dict()) == recipe
    out = _quietly(quantize_params, tiny_params(), recipe)
    assert out["layers_0"]["mlp"]["up_proj"]["kernel"].zero_point is not None
    assert out["layers_0"]["attn"]["o_proj"]["kernel"].act_spec is not None
    assert not isinstance(out["lm_head"]["kernel"], QArray)


@pytest.mark.parametrize(
    "text,match",
    [
        ("- 1\n- 2\n", "expected a mapping"),
        ("rules: []\nbogus: 1\n", r"unknown key\(s\) \['bogus'\]"),
        ("rules: {pattern: x}\n", "'rules' must be a list"),
        ("rules:\n  - weight: {bits: 8}\n", r"rules\[0\]: expected a mapping with a 'pattern'"),
        ("rules:\n  - {pattern: 3, skip: true}\n", "'pattern' must be a string"),
        ("rules:\n  - {pattern: x, skip: true, colour: red}\n", r"rules\[0\]: unknown key\(s\) \['colour'\]"),
        ("rules:\n  - {pattern: x, weight: {bits: 12}}\n", r"rules\[0\]\.weight: bits=12 is not supported"),
        ("rules:\n  - {pattern: x, weight: {bits: 4, granularity: group, group_size: 0}}\n", "positive integer group_size"),
        ("rules:\n  - {pattern: x, weight: {bits: 4, groupsize: 128}}\n", r"unknown key\(s\) \['groupsize'\]"),
        ("rules:\n  - {pattern: x, weight: 8}\n", r"rules\[0\]\.weight: expected a mapping"),
        ("rules:\n  - {pattern: '(', skip: true}\n", "not a valid regular expression"),
        ("rules:\n  - {pattern: x, skip: 'false'}\n", r"'skip' must be true or false"),
        ("rules:\n  - {pattern: x, weight: {bits: 8, symmetric: 'no'}}\n", "'symmetric' must be true or false"),
        ("method: [rtn]\nrules: []\n", "'method' must be a string"),
        ("method_args: 3\nrules: []\n", "'method_args' must be a mapping"),
        ("rules: [\n", "is not valid YAML"),
    ],
)
def test_malformed_recipe_is_one_clear_error(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=match) as info:
        load_recipe(path)
    if "valid YAML" not in match:
        assert str(path) in str(info.value)  # the error names the file


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "spec, scale_shape, pack_axis",
    [
        (Spec(bits=8), (50, 1), 0),  # channel = one scale per vocabulary row (the head's outputs)
        (Spec(bits=4, granularity="group", group_size=4), (50, 4), 1),  # groups along hidden, packed along hidden
        (Spec(bits=4, granularity="group", group_size=4, symmetric=False), (50, 4), 1),
    ],
)
def test_token_table_is_quantized_as_the_transposed_head_kernel(spec, scale_shape, pack_axis):
    params = tiny_params()
    table = params["embed"]["embedding"]
    out = _quietly(quantize_params, params, Recipe(rules=(Rule("embed/embedding", weight=spec),)))["embed"]["embedding"]
    assert isinstance(out, QArray) and out.shape == table.shape and out.scale.shape == scale_shape
    if out.bits == 4:
        assert out.pack_axis == pack_axis and out.qvalue.shape == (table.shape[0], table.shape[1] // 2)
    # The same spec on the transposed table as a kernel gives the same grid, transposed.
    as_kernel = quantize_params({"k": {"kernel": table.T}}, Recipe(rules=(Rule(".*", weight=spec),)))["k"]["kernel"]
    np.testing.assert_array_equal(np.asarray(out.dequantize()), np.asarray(as_kernel.dequantize()).T)


def test_token_table_is_weight_only_under_an_activation_rule():
    recipe = Recipe(rules=(Rule("embed/embedding", weight=Spec(bits=8), act=Spec(bits=8, granularity="token")),))
    with pytest.warns(UserWarning, match="activation spec does not apply"):
        out = quantize_params(tiny_params(), recipe)["embed"]["embedding"]
    assert out.bits == 8 and out.act_spec is None
