"""methods.quantize_model: the driver's bookkeeping (what its info reports)."""

from __future__ import annotations

import pytest

from llmeq_jax.core.quantize import Spec
from llmeq_jax.core.rules import Recipe, Rule
from llmeq_jax.methods import quantize_model
from tests.methods.tiny_models import tiny_model, tiny_windows


@pytest.mark.parametrize("method", ["rtn", "smoothquant"])
def test_calibration_seconds_are_counted_apart_from_the_method(method):
    """calib_s is the calibration passes' time (rtn with a static act scale: one pass; smoothquant: passes
    interleaved with its block steps), a real part of the total, not zero (the time plot's calibrate bar)."""
    config, params = tiny_model("llama")
    recipe = Recipe(rules=(Rule(".*lm_head.*", skip=True),
                           Rule(".*/kernel", weight=Spec(8, "channel"), act=Spec(8, "tensor"), act_static=True)),
                    method=method, method_args={"alpha": 0.5} if method == "smoothquant" else {}, name="t")
    _, info = quantize_model(config, params, recipe, tiny_windows(config, n=2, t=16))
    assert 0.0 < info["calib_s"] < info["seconds"]


def test_every_method_is_in_the_static_table_with_the_driver_protocol():
    from llmeq_jax import methods

    assert methods.METHODS == ("rtn", *methods.CALIBRATED)
    for name, mod in methods.CALIBRATED.items():
        for fn in ("parse_args", "wants", "sequential", "block_processor"):
            assert callable(getattr(mod, fn)), (name, fn)


def test_unknown_method_is_one_clear_error():
    from llmeq_jax.core.rules import RecipeError

    config, params = tiny_model("llama")
    recipe = Recipe(rules=(Rule(".*/kernel", weight=Spec(8, "channel")),), method="qwix", name="t")
    with pytest.raises(RecipeError, match="unknown method 'qwix'; available: .*'gptq'"):
        quantize_model(config, params, recipe, None)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_head_rule_of_its_own_is_round_to_nearest_under_block_only_methods(method):
    """Block-only methods see no input of an untied lm_head: a rule naming only the head quantizes it
    with plain RTN (as the token table), while a catch-all rule reaching it stays an error."""
    import numpy as np

    from llmeq_jax.core.quantize import quantize
    from llmeq_jax.core.rules import RecipeError

    config, params = tiny_model("llama")
    head_spec, block_spec = Spec(8, "channel"), Spec(4, "group", group_size=16, symmetric=False)
    windows = tiny_windows(config, n=2, t=16)
    recipe = Recipe(rules=(Rule("lm_head/kernel", weight=head_spec), Rule(".*/kernel", weight=block_spec)),
                    method=method, name="t")
    q, _ = quantize_model(config, params, recipe, windows)
    expected = quantize(params["lm_head"]["kernel"], head_spec)
    np.testing.assert_array_equal(np.asarray(q["lm_head"]["kernel"].qvalue), np.asarray(expected.qvalue))
    np.testing.assert_array_equal(np.asarray(q["lm_head"]["kernel"].scale), np.asarray(expected.scale))
    assert q["layers_0"]["mlp"]["down_proj"]["kernel"].bits == 4
    with pytest.raises(RecipeError, match=r"lm_head/kernel.*rule of the block kernels.*skip rule"):
        quantize_model(config, params, Recipe(rules=(Rule(".*/kernel", weight=block_spec),), method=method, name="t"),
                       windows)
