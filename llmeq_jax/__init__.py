"""llmeq_jax: JAX/XLA-native quantization of large language models.

The public API, one import away (each name is imported on first use, so
``import llmeq_jax`` stays cheap)::

    import jax.numpy as jnp
    import llmeq_jax as lq

    config, params, tokenizer, _ = lq.open_model("../shared/data/stories260K.gguf")   # registry name, HF dir, GGUF, checkpoint
    recipe = lq.read_recipe("smoothquant-w8a8")          # a shipped recipe (lq.recipe_names()) or a YAML path
    windows = lq.calibration_windows(tokenizer, "../shared/data/wikitext2_valid.txt", n_samples=8, seq_len=256)
    qparams, info = lq.quantize_model(config, params, recipe, windows)   # windows=None for uncalibrated recipes
    ppl = lq.text_perplexity(config, qparams, tokenizer, "../shared/data/wikitext2_test.txt", seq_len=256, windows=8)["ppl"]
    new_ids = lq.generate_tokens(config, qparams, jnp.asarray([tokenizer("Once upon a time")["input_ids"]]), 20)
    lq.save_checkpoint("out/w8a8", config, qparams, tokenizer, recipe=recipe)
    config, qparams, tokenizer, recipe_dict = lq.load_checkpoint("out/w8a8")   # content hashes checked

The layers below: ``core`` (QArray, Spec, recipes), ``ops.linear`` (every matmul),
``methods`` (one module per method), ``kv`` (quantized KV cache), ``distributed``
(meshes and sharded quantization), ``pipeline`` (the steps the CLI chains).
"""

import os
from importlib import import_module

# transformers is used for tokenizers (and, in the tests, as a PyTorch reference). Without
# PyTorch installed (`scripts/main_job.sh` installs no torch) it logs "PyTorch was not found.
# Models won't be available ..." as an advisory warning on import, which says nothing about
# llmeq. Advisories are off unless the user set the variable.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# public name -> (module, attribute)
_API = {
    "open_model": ("llmeq_jax.pipeline", "open_model"),
    "read_recipe": ("llmeq_jax.pipeline", "read_recipe"),
    "recipe_names": ("llmeq_jax.pipeline", "recipe_names"),
    "calibration_windows": ("llmeq_jax.calibrate", "calibration_windows"),
    "quantize_model": ("llmeq_jax.methods", "quantize_model"),
    "quantize_params": ("llmeq_jax.core.rules", "quantize_params"),
    "text_perplexity": ("llmeq_jax.pipeline", "text_perplexity"),
    "generate_tokens": ("llmeq_jax.generate", "generate"),  # not "generate": that is the submodule's name
    "save_checkpoint": ("llmeq_jax.checkpoint", "save_model_checkpoint"),
    "load_checkpoint": ("llmeq_jax.checkpoint", "load_model_checkpoint"),
    "QArray": ("llmeq_jax.core.qarray", "QArray"),
    "Spec": ("llmeq_jax.core.quantize", "Spec"),
    "quantize": ("llmeq_jax.core.quantize", "quantize"),
    "UsageError": ("llmeq_jax.errors", "UsageError"),
}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'llmeq_jax' has no attribute {name!r}")
    module, attr = _API[name]
    value = getattr(import_module(module), attr)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_API))
