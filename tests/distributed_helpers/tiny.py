"""A tiny llama, its calibration windows and recipe: the same in every process that builds them."""

from __future__ import annotations

import jax
import numpy as np

from llmeq_jax.core.quantize import Spec
from llmeq_jax.core.rules import Recipe, Rule
from llmeq_jax.models.config import ModelConfig
from llmeq_jax.models.model import init_params

CONFIG = ModelConfig(
    model_type="llama", vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    intermediate_size=64, norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False,
)
WANTS = ("absmax", "min", "max", "abs_sum", "count", "hessian", "sample")


def params():
    return init_params(CONFIG, jax.random.key(0))


def windows(n: int = 8, seq_len: int = 16) -> np.ndarray:
    return np.random.default_rng(1).integers(0, CONFIG.vocab_size, size=(n, seq_len)).astype(np.int32)


def recipe() -> Recipe:
    """W8A8 with static activation scales (needs calibrated absmax) on attention, int4 g16 on the MLP."""
    return Recipe(
        (
            Rule(r".*/attn/.*/kernel", weight=Spec(8, "channel"), act=Spec(8, "tensor"), act_static=True),
            Rule(r".*/mlp/.*/kernel", weight=Spec(4, "group", group_size=16, symmetric=False)),
            Rule(r"lm_head/kernel", weight=Spec(8, "channel")),
        ),
        name="dist-test",
    )


def gptq_recipe() -> Recipe:
    """GPTQ int4 g16 on every block kernel (lm_head stays float)."""
    return Recipe((Rule(r"lm_head/kernel", skip=True), Rule(r".*/kernel", weight=Spec(4, "group", group_size=16))),
                  method="gptq", method_args={"block_size": 8}, name="dist-gptq")
