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
