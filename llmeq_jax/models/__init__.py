"""Models: Flax GPT-2 and Llama-family code, loaders for HF directories and GGUF files.

    config, params, tokenizer = load_model("../shared/data/stories260K.gguf")
    logits = forward(config, params, tokens)            # [B, T, vocab] float32
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp

from llmeq_jax.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, ModelConfigError, config_from_hf_dict
from llmeq_jax.models.model import (
    apply_block,
    default_positions,
    embed,
    forward,
    forward_step,
    head,
    hidden_states,
    init_cache,
    init_params,
)
from llmeq_jax.models.params_tree import ModelLoadError
from llmeq_jax.models.registry import REGISTRY


def load_model(path_or_name: str | Path, dtype: Any = jnp.float32, keep_quantized: bool = False):
    """``(config, params, tokenizer)`` from an HF directory, a ``.gguf`` file or a registry name.

    ``tokenizer`` is a ``transformers`` tokenizer, or None for an HF directory without one.
    ``keep_quantized`` (GGUF only): linear weights stored in llama.cpp block types we read
    (``gguf_blocks``) load as QArrays with the file's integers instead of float.
    """
    from llmeq_jax.models import gguf_loader, hf_loader, registry

    if isinstance(path_or_name, str) and path_or_name in REGISTRY:
        path_or_name = registry.resolve(path_or_name)
    path = Path(path_or_name)
    if path.is_dir():
        if keep_quantized:
            raise ModelLoadError(f"{path}: keep_quantized reads GGUF files' quantized blocks; a Hugging Face "
                                 "directory holds float weights (quantize it with a recipe)")
        return hf_loader.load_hf_directory(path, dtype)
    if path.suffix == ".gguf" or path.is_file():
        return gguf_loader.load_gguf(path, dtype, keep_quantized)
    raise ModelLoadError(
        f"{path_or_name!s}: not a model directory, a .gguf file or a registered name ({', '.join(REGISTRY)})"
    )


__all__ = [
    "ModelConfig",
    "ModelConfigError",
    "ModelLoadError",
    "SUPPORTED_MODEL_TYPES",
    "apply_block",
    "config_from_hf_dict",
    "default_positions",
    "embed",
    "forward",
    "forward_step",
    "head",
    "hidden_states",
    "init_cache",
    "init_params",
    "load_model",
]
