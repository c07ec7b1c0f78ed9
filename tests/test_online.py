"""Online (EMA) activation scales: state updates, the model forward on stories260K, 1 vs 2 devices, recipes."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import calibrate, evaluate, online, ops
from llmeq_jax.core.quantize import Spec, quantize
from llmeq_jax.core.rules import RecipeError, quantize_params, recipe_from_dict
from llmeq_jax.pipeline import read_recipe
from llmeq_jax.models.layers import Linear
from tests.distributed_helpers import subprocess_env
from tests.shared_data import shared_data_path

REPO = Path(__file__).resolve().parents[1]


def test_tracked_linear_quantizes_with_the_ema_scale():
    rng = np.random.default_rng(0)
    w = quantize(jnp.asarray(rng.standard_normal((16, 8)), jnp.float32), Spec(8), act_spec=Spec(8, "tensor"))
    x1 = jnp.asarray(rng.standard_normal((4, 16)) * 3, jnp.float32)
    x2 = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    alphas = {"kernel": 0.8}
    run = lambda x, s: online.run_tracked(lambda: Linear(8).apply({"params": {"kernel": w}}, x), s, alphas)  # noqa
    y1, s1 = run(x1, online.init_state(alphas))
    y2, s2 = run(x2, s1)
    a1, a2 = float(jnp.max(jnp.abs(x1))), float(jnp.max(jnp.abs(x2)))
    assert np.isclose(float(s1["kernel"]), a1) and np.isclose(float(s2["kernel"]), 0.8 * a1 + 0.2 * a2)
    # the output is W8A8 with that static scale, not a dynamic one
    fixed = dataclasses.replace(w, act_scale=jnp.float32((0.8 * a1 + 0.2 * a2) / 127))
    expect = ops.w8a8_xla(x2, fixed, Spec(8, "tensor"))
    np.testing.assert_allclose(np.asarray(y2), np.asarray(expect), rtol=1e-5, atol=1e-5)
    dynamic = ops.w8a8_xla(x2, w, Spec(8, "tensor"))
    assert not np.allclose(np.asarray(y2), np.asarray(dynamic))  # a2 < s2: a coarser grid than x2's own


@pytest.fixture(scope="module")
def stories():
    from llmeq_jax.models import load_model

    config, params, tok = load_model(str(shared_data_path("stories260K.gguf")))
    recipe = read_recipe("rtn-w8a8-online")
    qp = quantize_params(params, recipe)
    ids = evaluate.tokenize_text(tok, shared_data_path("wikitext2_valid.txt").read_text()[:40000])
    return config, params, qp, recipe, evaluate.make_windows(ids, 64, 8)


def test_state_after_two_batches_matches_the_first_layer_inputs(stories):
    config, _, qp, recipe, wins = stories
    alphas = online.decays(qp, recipe)
    assert len(alphas) == 7 * config.num_layers and set(alphas.values()) == {0.9}
    path = "layers_0/attn/q_proj/kernel"  # its input depends only on the (int8) embedding: exact to compute
    amax = [float(jnp.max(calibrate.calibrate(config, qp, wins[i:i + 4], wants=("absmax",))[0][path]["absmax"]))
            for i in (0, 4)]
    _, s = online.forward(config, qp, jnp.asarray(wins[:4]), online.init_state(alphas), alphas)
    assert np.isclose(float(s[path]), amax[0], rtol=1e-6)
    _, s = online.forward(config, qp, jnp.asarray(wins[4:]), s, alphas)
    assert np.isclose(float(s[path]), 0.9 * amax[0] + 0.1 * amax[1], rtol=1e-6)


def test_online_perplexity_is_close_to_float_and_generation_carries_state(stories):
    from llmeq_jax.models import forward

    config, params, qp, recipe, wins = stories
    alphas = online.decays(qp, recipe)
    res = online.perplexity(config, qp, wins, alphas, batch_size=4)
    ref = evaluate.perplexity(lambda p, t: forward(config, p, t), wins, params=params)["ppl"]
    assert np.isfinite(res["ppl"]) and abs(res["ppl"] / ref - 1) < 0.05
    assert all(v > 0 for v in res["state"].values())
    toks, state = online.generate(config, qp, jnp.asarray([[1, 403, 407, 261, 378]]), 8, alphas)
    assert toks.shape == (1, 8) and all(float(v) > 0 for v in state.values())
    # the float model's greedy continuation (data README): ", there was a little girl"
    from llmeq_jax.generate import generate

    assert np.array_equal(np.asarray(toks), np.asarray(generate(config, params, jnp.asarray([[1, 403, 407, 261, 378]]), 8)))


def test_one_and_two_devices_track_the_same_state():
    env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "distributed_helpers" / "online_two_devices.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK" in proc.stdout


@pytest.mark.parametrize("rule,match", [
    ({"act": {"bits": 8, "granularity": "token"}, "act_ema": 0.9}, "needs act granularity 'tensor'"),
    ({"act": {"bits": 8, "granularity": "tensor"}, "act_static": True, "act_ema": 0.9}, "no act_static"),
    ({"act": {"bits": 8, "granularity": "tensor"}, "act_ema": 1.0}, r"not a decay in \[0, 1\)"),
])
def test_bad_online_rules_are_named(rule, match):
    with pytest.raises(RecipeError, match=match):
        recipe_from_dict({"rules": [{"pattern": ".*/kernel", "weight": {"bits": 8, "granularity": "channel"}, **rule}]})


def test_recipe_round_trip_keeps_the_decay():
    r = read_recipe("rtn-w8a8-online")
    assert r.rules[-1].act_ema == 0.9 and recipe_from_dict(r.to_dict()).rules[-1].act_ema == 0.9
