"""methods.quantize_model: the driver's bookkeeping (what its info reports)."""

from __future__ import annotations

import pytest

from llmeq_jax.core.quantize import Spec
from llmeq_jax.core.rules import Recipe, Rule
from llmeq_jax.methods import quantize_model
from tests.methods.tiny_models import tiny_model


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
