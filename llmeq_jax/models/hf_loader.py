"""Load a Hugging Face checkpoint directory: ``config.json`` + ``*.safetensors`` (+ tokenizer).

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``)
checkpoints are read one tensor at a time with ``safetensors.safe_open``,
converted to our layout (torch ``Linear`` weights ``(out, in)`` are transposed
to ``(in, out)`` kernels; GPT-2's ``Conv1D`` weights already are ``(in, out)``)
and cast to the target dtype before the next tensor is read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


from tqdm import tqdm

from llmeq_jax.models.config import ModelConfig, ModelConfigError, config_from_hf_dict
from llmeq_jax.models.params_tree import ModelLoadError, TreeBuilder

# HF name (after the "model."/"transformer." prefix) -> (our path, transpose?)
_LLAMA_LAYER = {
    "input_layernorm.weight": ("input_norm/scale", False),
    "post_attention_layernorm.weight": ("post_attn_norm/scale", False),
    "self_attn.q_norm.weight": ("attn/q_norm/scale", False),
    "self_attn.k_norm.weight": ("attn/k_norm/scale", False),
    **{f"self_attn.{p}.weight": (f"attn/{p}/kernel", True) for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{f"self_attn.{p}.bias": (f"attn/{p}/bias", False) for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{f"mlp.{p}.weight": (f"mlp/{p}/kernel", True) for p in ("gate_proj", "up_proj", "down_proj")},
}
_LLAMA_TOP = {
    "embed_tokens.weight": ("embed/embedding", False),
    "norm.weight": ("norm/scale", False),
    "lm_head.weight": ("lm_head/kernel", True),
}
_GPT2_LAYER = {
    "ln_1.weight": ("ln_1/scale", False),
    "ln_1.bias": ("ln_1/bias", False),
    "ln_2.weight": ("ln_2/scale", False),
    "ln_2.bias": ("ln_2/bias", False),
    "attn.c_attn.weight": ("attn/qkv_proj/kernel", False),
    "attn.c_attn.bias": ("attn/qkv_proj/bias", False),
    "attn.c_proj.weight": ("attn/o_proj/kernel", False),
    "attn.c_proj.bias": ("attn/o_proj/bias", False),
    "mlp.c_fc.weight": ("mlp/fc_in/kernel", False),
    "mlp.c_fc.bias": ("mlp/fc_in/bias", False),
    "mlp.c_proj.weight": ("mlp/fc_out/kernel", False),
    "mlp.c_proj.bias": ("mlp/fc_out/bias", False),
}
_GPT2_TOP = {
    "wte.weight": ("embed/embedding", False),
    "wpe.weight": ("pos_embed/embedding", False),
    "ln_f.weight": ("norm/scale", False),
    "ln_f.bias": ("norm/bias", False),
    "lm_head.weight": ("lm_head/kernel", True),
}
# Buffers some checkpoints carry that are not parameters.
_IGNORED = re.compile(r".*(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")
_LAYER = re.compile(r"(?:h|layers)\.(\d+)\.(.+)")


def map_name(config: ModelConfig, name: str) -> tuple[str, bool] | None:
    """Our ``(path, transpose)`` for an HF tensor name, or None for known non-parameters."""
    if _IGNORED.fullmatch(name):
        return None
    short = re.sub(r"^(model|transformer)\.", "", name)
    top, layer = (_GPT2_TOP, _GPT2_LAYER) if config.family == "gpt2" else (_LLAMA_TOP, _LLAMA_LAYER)
    if short in top:
        if short == "lm_head.weight" and config.tie_word_embeddings:
            return None  # tied: the head is the embedding
        return top[short]
    m = _LAYER.fullmatch(short)
    if m and m.group(2) in layer:
        path, transpose = layer[m.group(2)]
        return f"layers_{int(m.group(1))}/{path}", transpose
    raise ModelLoadError(f"tensor {name!r} is not a parameter of a {config.model_type} model")


def read_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory}: no config.json (expected a Hugging Face model directory)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}: not valid JSON ({e})") from None
    return config_from_hf_dict(data, source=str(path))


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint files: the shards listed in the index, or the single file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
        files = [directory / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {missing}")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if found:
        return found
    raise ModelLoadError(f"{directory}: no model.safetensors, model.safetensors.index.json or *.safetensors files")


def _open(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="flax")  # "flax": jax arrays, bfloat16 included (numpy has no bf16)
    except Exception as e:  # safetensors raises its own error type for a bad header or a short file
        raise ModelLoadError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def load_params(directory: Path, config: ModelConfig, dtype: Any) -> dict:
    builder = TreeBuilder(config, dtype, source=str(directory))
    for path in safetensors_files(directory):
        with _open(path) as f:
            for name in tqdm(list(f.keys()), desc=f"load {path.name}", unit="tensor", leave=False):
                target = map_name(config, name)
                if target is None:
                    continue
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(f"{path}: tensor {name!r} cannot be read ({type(e).__name__}: {e})") from None
                ours, transpose = target
                builder.put(ours, tensor.T if transpose else tensor, name)
                del tensor
    return builder.finish()


def load_tokenizer(directory: Path):
    """The directory's tokenizer through ``transformers``, or None when it ships none."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((directory / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def load_hf_directory(directory: str | Path, dtype: Any):
    directory = Path(directory)
    config = read_config(directory)
    return config, load_params(directory, config, dtype), load_tokenizer(directory)
