"""The steps of a quantization run, as the CLI and the scripts chain them.

open a model (:func:`open_model`) -> read a recipe (:func:`read_recipe`, by path or by
the name of a recipe shipped in ``llmeq_jax/configs/``) -> quantize it, calibrating
when the recipe needs statistics (:func:`run_recipe`) -> build the quantized KV cache
the recipe or ``--kv`` asks for (:func:`kv_mapping`, :func:`build_kv_quantizer`) ->
perplexity on a text (:func:`text_perplexity`), cache memory (:func:`kv_memory`) and
speed (:func:`measure_speed`).

Mistakes a user can fix raise :class:`llmeq_jax.errors.UsageError`.
"""

from __future__ import annotations

import re
import time
from importlib import resources
from pathlib import Path
from typing import NamedTuple

from llmeq_jax.data import CALIB_TEXT, find_data_file, text_windows
from llmeq_jax.errors import UsageError

MAIN_RECIPES = ("fp32", "rtn-w8", "rtn-w8a8", "smoothquant-w8a8", "rtn-w4-g128")


# --------------------------------------------------------------------------- models and recipes


# The float dtypes a model may load in (``open_model(dtype=...)``, the CLI's --dtype): float32, or bfloat16 for
# half the float weights' memory and the dtype GPUs run fast (activations follow the weights' dtype).
LOAD_DTYPES = ("float32", "bfloat16")


def open_model(source: str, progress: bool = True, verify: bool = True, keep_quantized: bool = False,
               dtype: str | None = None):
    """(config, params, tokenizer, recipe_dict or None) from any MODEL form; checkpoints are checked
    against their content hashes unless ``verify`` is False. ``keep_quantized``: a GGUF file's
    quantized linear weights load as QArrays with its integers (``models.gguf_blocks``). ``dtype``
    (one of :data:`LOAD_DTYPES`, default float32): the float weights of an HF directory, a GGUF file or a
    registry name; a checkpoint loads in the dtypes it was saved with."""
    from llmeq_jax import checkpoint

    if dtype is not None and dtype not in LOAD_DTYPES:
        raise UsageError(f"dtype {dtype!r}: expected one of {', '.join(LOAD_DTYPES)}")
    p = Path(source)
    if p.is_dir() and (p / checkpoint.MANIFEST).is_file():
        if keep_quantized:
            raise UsageError(f"--keep-quantized reads a GGUF file's blocks; {source!r} is a checkpoint (it loads "
                             "as it was saved)")
        if dtype is not None:
            raise UsageError(f"--dtype sets the dtype an HF directory, GGUF file or registry name loads in; "
                             f"{source!r} is a checkpoint (it loads in the dtypes it was saved with)")
        return checkpoint.load_model_checkpoint(p, verify_hashes=verify)
    from llmeq_jax.models import load_model

    config, params, tokenizer = load_model(source, dtype or "float32", keep_quantized=keep_quantized)
    return config, params, tokenizer, None


def recipes_dir():
    """The recipes shipped with the package (``llmeq_jax/configs/``), as an importlib.resources Traversable."""
    return resources.files("llmeq_jax") / "configs"


def recipe_names() -> list[str]:
    """Names of the shipped recipes (``rtn-w8``, ``gptq-w4-g128``, ...), sorted."""
    return sorted(f.name[: -len(".yaml")] for f in recipes_dir().iterdir() if f.name.endswith(".yaml"))


def recipe_path(name: str):
    """The shipped recipe file of ``name`` (a Traversable, a Path for an installed package); UsageError if none."""
    f = recipes_dir() / f"{name}.yaml"
    if "/" in name or not f.is_file():
        raise UsageError(f"no recipe file {name!r} and no shipped recipe of that name; "
                         f"expected a YAML path or one of {', '.join(recipe_names())}")
    return f


def read_recipe(path_or_name: str):
    """A Recipe from a YAML file, or from the shipped recipe of that name (``rtn-w8``) when no such file exists."""
    from llmeq_jax.core.rules import load_recipe

    p = Path(path_or_name)
    if not p.is_file() and (recipes_dir() / f"{path_or_name}.yaml").is_file():
        with resources.as_file(recipes_dir() / f"{path_or_name}.yaml") as f:
            return load_recipe(f)
    return load_recipe(p)


# --------------------------------------------------------------------------- quantize


class Quantized(NamedTuple):
    """What :func:`run_recipe` gives: the quantized params and where the time went."""

    params: object
    quantize_s: float
    calib_s: float
    calib_samples: int


def run_recipe(config, params, tokenizer, recipe, calib: str | None, calib_samples: int, progress: bool,
               calib_seq_len: int = 512) -> Quantized:
    """Apply the recipe (calibrating when it needs statistics) -> Quantized(params, quantize_s, calib_s, samples).

    Calib seconds: reading and tokenizing the calibration text plus the calibration passes
    over the model. Calibrated methods interleave those passes with their block steps; the
    passes are counted as calibration, the block steps as quantization, so the two add up
    to the wall time. (:func:`llmeq_jax.methods.quantize_model` is the step below: params and
    windows in, params and an info dict out.)
    """
    import jax

    from llmeq_jax import methods

    windows, train_windows, calib_s = None, None, 0.0
    if methods.needs_calibration(recipe):
        from llmeq_jax import calibrate

        t0 = time.perf_counter()
        text = find_data_file(calib, CALIB_TEXT, "calibration text")
        windows = calibrate.calibration_windows(tokenizer, text, calib_samples,
                                                min(calib_seq_len, config.max_position_embeddings))
        train_windows = finetune_windows(config, tokenizer, recipe, text)
        calib_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    qparams, info = methods.quantize_model(config, params, recipe, windows, progress, finetune_windows=train_windows)
    jax.block_until_ready(qparams)
    passes_s = info.get("calib_s", 0.0)
    return Quantized(qparams, time.perf_counter() - t0 - passes_s, calib_s + passes_s, info["calib_samples"])


def finetune_windows(config, tokenizer, recipe, text: str | Path):
    """The training windows of the recipe's ``finetune`` step: one fresh window of the calibration text per step
    and sequence (steps x batch_size; fewer, cycled, when the text is short), or None without that step.

    Fresh text rather than the calibration windows over and over: 100 steps cycling 16 windows over-fit
    them (SmolLM2 gptq-w4-g128, WikiText-2 test +6.35 % -> +9.20 %, docs/accuracy.md)."""
    from llmeq_jax import calibrate

    if recipe.finetune is None:
        return None
    ft = recipe.finetune
    return calibrate.fresh_windows(tokenizer, text, ft["steps"] * ft["batch_size"],
                                   min(ft["seq_len"], config.max_position_embeddings))


# --------------------------------------------------------------------------- evaluate


def text_perplexity(config, params, tokenizer, text_path: str | Path, seq_len: int = 512, windows: int = 64,
                    batch_size: int = 4, progress: bool = False, kv=None, recipe=None, scan_layers: bool = False) -> dict:
    """Perplexity report (``ppl``, ``nll``, ``tokens``, ``windows``) of the text at ``text_path``.

    With ``kv`` (a KVQuantizer) attention reads K/V through the quantized cache's prefill path.
    A ``recipe`` with online activation scales (``act_ema``) carries their EMA state from batch to batch.
    ``scan_layers``: run the decoder blocks as one scan (``models.stacked``: compiles once per block)."""
    wins = text_windows(tokenizer, text_path, seq_len, windows)
    return windows_perplexity(config, params, wins, batch_size, progress, kv=kv, recipe=recipe, scan_layers=scan_layers)


def windows_perplexity(config, params, wins, batch_size: int = 4, progress: bool = False, kv=None,
                       recipe=None, scan_layers: bool = False) -> dict:
    """Perplexity report of token windows ``wins`` [N, T] (see :func:`text_perplexity`)."""
    from llmeq_jax import evaluate, online

    alphas = online.decays(params, recipe)
    if alphas:
        if kv is not None or scan_layers:
            raise UsageError("online activation scales (act_ema) are evaluated with a float KV cache and unrolled "
                             "blocks; drop --kv / --scan-layers or use a recipe without act_ema")
        return online.perplexity(config, params, wins, alphas, batch_size=batch_size, progress=progress)
    return evaluate.perplexity(None, wins, batch_size=batch_size, params=run_layout(config, params, scan_layers),
                               progress=progress, nll_fn=sequence_nll(config, kv=kv))


def run_layout(config, params, scan_layers: bool = False):
    """The params as a full-sequence forward runs them: the prefill layout (``decode_layout.for_prefill``),
    then, with ``scan_layers``, the blocks stacked for one scan where they can share it
    (``models.stacked.stack_blocks_or_warn``)."""
    from llmeq_jax import decode_layout
    from llmeq_jax.models import stacked

    laid_out = decode_layout.for_prefill(params)
    return stacked.stack_blocks_or_warn(config, laid_out) if scan_layers else laid_out


def sequence_nll(config, kv=None):
    """``(params, tokens [B, T]) -> next-token NLL [B, T-1]`` of the model: the blocks once, then the
    head a chunk of positions at a time (``evaluate.chunked_token_nll``; no [B, T, vocab] logits)."""
    from llmeq_jax import evaluate
    from llmeq_jax.models import head, hidden_states

    def nll(params, tokens):
        hidden = hidden_states(config, params, tokens, kv=kv)
        return evaluate.chunked_token_nll(lambda h: head(config, params, h), hidden, tokens)

    return nll


def measure_speed(config, params, prefill_len: int = 512, prompt_len: int = 32, new_tokens: int = 128,
                  scan_layers: bool = False) -> dict:
    """Warm prefill tokens/s (one sequence of prefill_len) and greedy decode tokens/s (median of runs);
    ``scan_layers``: with the blocks stacked (``models.stacked``)."""
    import jax.numpy as jnp

    from llmeq_jax import evaluate
    from llmeq_jax.generate import decode_seconds
    from llmeq_jax.models import forward, stacked
    from llmeq_jax.subchannel import prompt_jit

    prefill_len = min(prefill_len, config.max_position_embeddings)
    toks = jnp.ones((1, prefill_len), jnp.int32)
    fwd = prompt_jit(lambda p, t: forward(config, p, t))
    prefill_params = run_layout(config, params, scan_layers)
    t_prefill = evaluate.median_time(lambda: fwd(prefill_params, toks), runs=3)
    decode_params = stacked.stack_blocks_or_warn(config, params) if scan_layers else params
    decode_s = decode_seconds(config, decode_params, jnp.ones((1, prompt_len), jnp.int32), new_tokens)
    return {"prefill_tok_s": prefill_len / t_prefill, "decode_tok_s": (new_tokens - 1) / decode_s}


def param_bytes(params) -> int:
    """Bytes of the params as held (QArray values and scales counted)."""
    from llmeq_jax.core.qarray import tree_nbytes

    return tree_nbytes(params)


def layer_values(params, layer: str):
    """The integer values (QArray) or float weights of the leaf at path ``layer``."""
    import numpy as np

    from llmeq_jax.core.qarray import QArray

    node = params
    for k in layer.split("/"):
        node = node[k]
    return np.asarray(node.values() if isinstance(node, QArray) else node)


def first_kernel_path(params) -> str:
    """The path of the first block linear's kernel (not the head's); '' when there is none."""
    from llmeq_jax.core.rules import leaf_paths

    paths = [p for p in leaf_paths(params) if p.endswith("/kernel") and "lm_head" not in p]
    return paths[0] if paths else ""


# --------------------------------------------------------------------------- KV-cache quantization


def kv_mapping(value: str | None, recipe: dict | None) -> dict | None:
    """The ``kv:`` mapping in force: ``value`` (``--kv``: a shorthand, or a recipe with a ``kv:`` mapping) over the
    checkpoint recipe's."""
    from llmeq_jax.kv import spec as kvspec

    if value is None:
        return (recipe or {}).get("kv")
    if value.strip().lower() in kvspec.SHORTHANDS or re.fullmatch(r"(?:int|kv)\d+", value.strip().lower()):
        spec = kvspec.spec_from(value)
        return None if spec is None else spec.to_dict()
    kv = read_recipe(value).kv
    if kv is None:
        raise UsageError(f"--kv {value!r}: the recipe has no 'kv:' mapping; expected int8|int4|int2 or a KV recipe")
    return kv


def build_kv_quantizer(config, params, tokenizer, kv: dict | None, calib: str | None):
    """A KVQuantizer for the mapping (None for none): stored key ranges when present, else calibrated on ``calib``."""
    from llmeq_jax import calibrate
    from llmeq_jax.kv import spec as kvspec

    spec = kvspec.spec_from(kv)
    if spec is None:
        return None
    if kv.get("key_ranges") is not None:
        quantizer = kvspec.quantizer_from_dict(kv)
    elif spec.needs_key_ranges:
        text = find_data_file(calib, CALIB_TEXT, "calibration text")
        quantizer = calibrate.make_kv_quantizer(spec, config, params,
                                               text_windows(tokenizer, text, spec.calib_seq_len, spec.calib_windows))
    else:
        quantizer = kvspec.KVQuantizer(None, spec)
    quantizer.check(config.num_layers, config.num_kv_heads, config.head_dim)
    return quantizer


def kv_memory(config, seq_len: int, kv, budget_gb: float, dtype: str = "float32") -> dict:
    """Cache bytes per token (one row, all layers) of ``kv`` and of the float cache; longest context in budget.
    ``dtype``: what a float cache (and a quantized cache's float part) holds (``generate.cache_dtype_for``).

    The longest context is also capped by the model's own (``max_position_embeddings``): a cache
    that would fit more tokens than the model can attend to does not make the model take them.
    """
    import jax

    from llmeq_jax.kv import memory as kvmemory
    from llmeq_jax.models import init_cache

    mem = kvmemory.memory(jax.eval_shape(lambda: init_cache(config, 1, seq_len, dtype, kv=kv)))
    flt = kvmemory.memory(jax.eval_shape(lambda: init_cache(config, 1, seq_len, dtype)))
    budget = budget_gb * 2**30
    return {
        "kv": dtype if kv is None else kv.spec.describe(),
        "float_kv": dtype,
        "kv_bytes_per_token": mem["bytes_per_token"],
        "kv_fixed_bytes": mem["fixed_bytes"],
        "kv_x_smaller_than_float": flt["bytes_per_token"] / mem["bytes_per_token"],
        "kv_budget_gb": budget_gb,
        "kv_longest_context": min(kvmemory.longest_context(mem["bytes_per_token"], mem["fixed_bytes"], budget),
                                  config.max_position_embeddings),
        "float_kv_longest_context": min(kvmemory.longest_context(flt["bytes_per_token"], flt["fixed_bytes"], budget),
                                        config.max_position_embeddings),
        "model_max_context": config.max_position_embeddings,
    }
