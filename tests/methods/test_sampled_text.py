"""Text sampled from the float model (methods/sampled_text.py): sequences, seeds, the recipe's calibration: key."""

import dataclasses

import numpy as np
import pytest

from llmeq_jax import methods
from llmeq_jax.core.rules import RecipeError, recipe_from_dict
from llmeq_jax.methods import sampled_text as st
from tests.shared_data import stories_with_windows

GPTQ_RULES = [{"pattern": ".*lm_head.*", "skip": True}, {"pattern": ".*/kernel", "weight": {"bits": 3, "granularity": "group", "group_size": 32,
                                                  "symmetric": False}}]


@pytest.fixture(scope="module")
def stories():
    return stories_with_windows(32)


def test_sampled_windows_start_at_bos_and_follow_the_seed(stories):
    config, params, _ = stories
    assert st.prompt_token(config) == config.bos_token_id
    a = st.sampled_windows(config, params, 5, 16, seed=3, batch_size=2)
    assert a.shape == (5, 16) and a.dtype == np.int32
    assert (a[:, 0] == config.bos_token_id).all() and (a >= 0).all() and (a < config.vocab_size).all()
    np.testing.assert_array_equal(a, st.sampled_windows(config, params, 5, 16, seed=3, batch_size=2))
    assert not np.array_equal(a, st.sampled_windows(config, params, 5, 16, seed=4, batch_size=2))
    assert len(np.unique(a[:, 1:], axis=0)) == 5  # temperature 1: the sequences differ


def test_prompt_token_falls_back_to_eos_and_refuses_neither(stories):
    config = stories[0]
    assert st.prompt_token(dataclasses.replace(config, bos_token_id=None, eos_token_id=(7, 9))) == 7
    with pytest.raises(ValueError, match="BOS or EOS"):
        st.prompt_token(dataclasses.replace(config, bos_token_id=None, eos_token_id=None))


def test_with_sampled_appends_sequences_of_the_window_length(stories):
    config, params, wins = stories
    assert st.with_sampled(config, params, wins, None) is wins
    assert st.with_sampled(config, params, wins, {"sampled": 0, "seed": 0}) is wins
    more = st.with_sampled(config, params, wins, {"sampled": 3, "seed": 0})
    assert more.shape == (len(wins) + 3, wins.shape[1])
    np.testing.assert_array_equal(more[:len(wins)], wins)
    assert (more[len(wins):, 0] == config.bos_token_id).all()


def test_recipe_calibration_feeds_gptq_the_sampled_sequences(stories):
    config, params, wins = stories
    plain = recipe_from_dict({"method": "gptq", "rules": GPTQ_RULES})
    mixed = recipe_from_dict({"method": "gptq", "rules": GPTQ_RULES, "calibration": {"sampled": 4}})
    assert mixed.calibration == {"sampled": 4, "seed": 0}
    assert recipe_from_dict(mixed.to_dict()).calibration == mixed.calibration and "calibration" not in plain.to_dict()
    a, info_a = methods.quantize_model(config, params, plain, wins)
    b, info_b = methods.quantize_model(config, params, mixed, wins)
    assert info_b["calib_samples"] == info_a["calib_samples"] + 4
    kernel = lambda q: np.asarray(q["layers_0"]["mlp"]["down_proj"]["kernel"].qvalue)
    assert not np.array_equal(kernel(a), kernel(b))  # other Hessians, other rounding


@pytest.mark.parametrize("calibration, message", [
    ({"sampled": -1}, "calibration.sampled must be"),
    ({"samples": 4}, "unknown calibration"),
    (8, "calibration must be a mapping"),
])
def test_bad_calibration_is_one_clear_error(calibration, message):
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict({"method": "gptq", "rules": GPTQ_RULES, "calibration": calibration})
