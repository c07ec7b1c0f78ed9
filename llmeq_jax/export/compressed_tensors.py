"""compressed-tensors export: a Hugging Face directory that transformers and vLLM load as quantized.

The directory holds ``config.json`` (the HF model config with a
``quantization_config`` of ``quant_method: compressed-tensors``),
``model.safetensors`` and the tokenizer files. Per quantized Linear:

* weight-only (``pack-quantized``): ``weight_packed`` int32 (out, ceil(in*b/32)),
  values offset to unsigned (q + 2^(b-1)) and packed densely, element i at
  bit i*b (8 int4 per word, low bits first); ``weight_scale`` (out, groups);
  ``weight_shape`` [out, in]; asymmetric adds ``weight_zero_point`` packed the
  same way along the output dim, (ceil(out*b/32), groups).
* W8A8 (``int-quantized``): ``weight`` int8 (out, in), ``weight_scale`` (out, 1),
  and the activation scheme in the config: per token, dynamic; or per tensor,
  static with ``input_scale``.
* FP8 (``float-quantized``, vLLM's FP8 checkpoints): ``weight`` float8_e4m3fn (out, in),
  ``weight_scale`` (out, 1) float32, weights and activations of ``type: float``; activations
  dynamic per token or static per tensor (``input_scale``), or none (FP8 weight-only).

The grid is ours unchanged: scales are written as float32, the integers as
they are, and ``x = (q - zp) * scale`` is the format's definition too. One
difference lies in the runtimes, not the file: compressed-tensors' own
(reference) activation quantizer divides the per-token absmax by 127.5 where
ours (and vLLM's int8 kernels) divide by 127, so W8A8 logits differ by that
rounding when the directory is run through transformers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from llmeq_jax.core.qarray import QArray
from llmeq_jax.core.rope import FREQ_FACTORS
from llmeq_jax.export.common import ExportError, KernelGrid, atomic_output, flat_params, kernel_grid
from llmeq_jax.models.config import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_LAYER = {"input_norm/scale": "input_layernorm.weight", "post_attn_norm/scale": "post_attention_layernorm.weight",
          "attn/q_norm/scale": "self_attn.q_norm.weight", "attn/k_norm/scale": "self_attn.k_norm.weight"}
_TOP = {"embed/embedding": "model.embed_tokens.weight", "norm/scale": "model.norm.weight",
        "lm_head/kernel": "lm_head.weight"}


# --------------------------------------------------------------------------- names and config


def module_name(path: str) -> str:
    """HF module (Linear) or tensor name of one of our param paths, without the ``.weight``/``.bias`` suffix."""
    if path in _TOP:
        return _TOP[path].rsplit(".", 1)[0]
    head, _, rest = path.partition("/")
    if head.startswith("layers_"):
        prefix = f"model.layers.{int(head[len('layers_'):])}"
        if rest in _LAYER:
            return f"{prefix}.{_LAYER[rest].rsplit('.', 1)[0]}"
        parts = rest.split("/")
        if len(parts) == 3 and parts[0] in ("attn", "mlp") and parts[2] in ("kernel", "bias"):
            return f"{prefix}.{'self_attn' if parts[0] == 'attn' else 'mlp'}.{parts[1]}"
    raise ExportError(f"{path}: this parameter has no Hugging Face name")


def tensor_name(path: str) -> str:
    suffix = "bias" if path.endswith("/bias") else "weight"
    return f"{module_name(path)}.{suffix}"


def hf_config(config: ModelConfig) -> dict:
    """The ``config.json`` transformers builds this model from (read back by ``config_from_hf_dict``)."""
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ExportError(f"model_type {config.model_type!r} has no compressed-tensors export "
                          f"(its layers are not torch Linear modules); supported: {', '.join(ARCHITECTURES)}")
    if config.sliding_layers is not None:
        raise ExportError("per-layer sliding windows are not written by this exporter")
    if config.o_bias != (config.qkv_bias and config.model_type == "llama"):
        raise ExportError(f"{config.model_type}: qkv_bias={config.qkv_bias} with o_bias={config.o_bias} "
                          "has no Hugging Face config flag")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None and FREQ_FACTORS in dict(config.rope_scaling):
        raise ExportError("per-frequency RoPE factors (a GGUF file's rope_freqs.weight) have no Hugging Face "
                          "rope_scaling; export a model loaded from its Hugging Face directory instead")
    if config.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta, **dict(config.rope_scaling)}
        rope["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    out = {
        "architectures": [arch],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_parameters": rope,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_ids) if len(config.eos_ids) > 1 else config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "torch_dtype": "float32",
    }
    if config.model_type == "llama":
        out["attention_bias"] = config.qkv_bias
        out["mlp_bias"] = False
    if config.sliding_window is not None:
        out["sliding_window"] = config.sliding_window
        if config.model_type != "mistral":
            out["use_sliding_window"] = True
    return out


# --------------------------------------------------------------------------- schemes


def _args(bits: int, strategy: str, symmetric: bool, group_size: int | None = None, dynamic: bool = False,
          kind: str = "int") -> dict:
    return {"num_bits": bits, "type": kind, "symmetric": symmetric, "group_size": group_size,
            "strategy": strategy, "dynamic": dynamic, "observer": None if dynamic else "minmax"}


def _act_args(grid: KernelGrid, kind: str) -> dict:
    """The input_activations args of a W8A8 kernel: static per tensor, or dynamic per token / tensor."""
    if grid.act_scale is not None:
        return _args(8, "tensor", True, kind=kind)
    return _args(8, "token" if grid.act_spec.granularity == "token" else "tensor", True, dynamic=True, kind=kind)


def _fp8_scheme(grid: KernelGrid, where: str) -> dict:
    """FP8 (E4M3) weights, one scale per output channel, with FP8 activations or none: ``float-quantized``."""
    if grid.scale.shape[1] != 1:
        raise ExportError(f"{where}: FP8 weights with grouped scales have no float-quantized layout here "
                          "(expected one scale per output channel)")
    acts = None if grid.act_spec is None else _act_args(grid, "float")
    return {"weights": _args(8, "channel", True, kind="float"), "input_activations": acts,
            "format": "float-quantized"}


def scheme(grid: KernelGrid) -> dict:
    """The compressed-tensors scheme (weights, input_activations, format) of one kernel."""
    where = f"{grid.path} ({grid.describe()})"
    if grid.grid == "fp8":
        return _fp8_scheme(grid, where)
    groups = grid.scale.shape[1]
    if groups == 1:
        weights = _args(grid.bits, "channel", grid.symmetric)
    elif grid.in_features % grid.group:
        # Our last group may be shorter; compressed-tensors reshapes rows into whole groups and refuses.
        raise ExportError(f"{where}: group size {grid.group} does not divide the input dim {grid.in_features}; "
                          "compressed-tensors needs whole groups")
    else:
        weights = _args(grid.bits, "group", grid.symmetric, group_size=grid.group)
    if grid.act_spec is None:
        return {"weights": weights, "input_activations": None, "format": "pack-quantized"}
    if groups > 1:
        raise ExportError(f"{where}: W8A8 with grouped weight scales has no compressed-tensors int8 kernel "
                          "layout (int-quantized takes per-channel weight scales)")
    if grid.bits != 8:
        raise ExportError(f"{where}: W8A8 stores int8 weights (int-quantized); int{grid.bits} weights would "
                          "need a re-quantization")
    return {"weights": weights, "input_activations": _act_args(grid, "int"), "format": "int-quantized"}


def pack_int32(q: np.ndarray, bits: int) -> np.ndarray:
    """Dense packing along the last dim: value i (offset to unsigned) at bits [i*b, (i+1)*b), int32 words."""
    rows, cols = q.shape
    u = (q.astype(np.int32) + (1 << (bits - 1))).astype(np.uint32)
    bitstream = ((u[:, :, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8).reshape(rows, -1)
    words = math.ceil(cols * bits / 32)
    bitstream = np.pad(bitstream, ((0, 0), (0, words * 32 - bitstream.shape[1])))
    return np.packbits(bitstream, axis=1, bitorder="little").view("<i4").reshape(rows, words)


def kernel_tensors(name: str, grid: KernelGrid, fmt: str) -> dict[str, np.ndarray]:
    """The safetensors entries of one quantized Linear ``name``."""
    out = {f"{name}.weight_scale": grid.scale.astype(np.float32)}
    if fmt == "pack-quantized":
        out[f"{name}.weight_packed"] = pack_int32(grid.q, grid.bits)
        out[f"{name}.weight_shape"] = np.asarray(grid.q.shape, np.int64)
        if grid.zero_point is not None:
            out[f"{name}.weight_zero_point"] = np.ascontiguousarray(pack_int32(grid.zero_point.T, grid.bits).T)
    else:
        out[f"{name}.weight"] = grid.fp8() if fmt == "float-quantized" else grid.q
        if grid.zero_point is not None:
            out[f"{name}.weight_zero_point"] = grid.zero_point
        if grid.act_scale is not None:
            out[f"{name}.input_scale"] = grid.act_scale.reshape(1).astype(np.float32)
    return out


# --------------------------------------------------------------------------- whole model


def quantization_config(schemes: dict[str, dict], float_linears: list[str]) -> dict:
    """``quantization_config``: one config group per distinct scheme, float Linear modules ignored."""
    distinct: list[dict] = []
    members: list[list[str]] = []
    for name, s in schemes.items():
        if s not in distinct:
            distinct.append(s)
            members.append([])
        members[distinct.index(s)].append(name)
    groups = {}
    for i, (s, names) in enumerate(zip(distinct, members)):
        # One scheme for every quantized Linear: target the class; several: name each module.
        targets = ["Linear"] if len(distinct) == 1 else names
        groups[f"group_{i}"] = {"targets": targets, "weights": s["weights"],
                                "input_activations": s["input_activations"], "output_activations": None,
                                "format": s["format"]}
    formats = {s["format"] for s in distinct}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": float_linears,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
    }


def model_tensors(config: ModelConfig, params: Any) -> tuple[dict[str, np.ndarray], dict]:
    """(safetensors dict, quantization_config): every check done, nothing written yet."""
    tensors: dict[str, np.ndarray] = {}
    schemes: dict[str, dict] = {}
    float_linears: list[str] = []
    for path, leaf in flat_params(params).items():
        name = tensor_name(path)
        if isinstance(leaf, QArray):
            if not path.endswith("/kernel"):
                raise ExportError(f"{path}: only Linear kernels can be quantized in compressed-tensors")
            grid = kernel_grid(path, leaf, grids=("uniform", "fp8"))
            s = scheme(grid)
            schemes[module_name(path)] = s
            tensors.update(kernel_tensors(module_name(path), grid, s["format"]))
            continue
        a = np.asarray(leaf, np.float32)
        if path.endswith("/kernel"):
            a = a.T  # (in, out) -> torch Linear (out, in)
            float_linears.append(module_name(path))
        tensors[name] = np.ascontiguousarray(a)
    if config.tie_word_embeddings:
        # transformers builds an lm_head Linear tied to the float embedding: a "Linear" target must skip it.
        float_linears.append("lm_head")
    if not schemes:
        raise ExportError("the model holds no quantized kernel; compressed-tensors needs at least one")
    return tensors, quantization_config(schemes, float_linears)


def write_compressed_tensors(config: ModelConfig, params: Any, out: str | Path, *, tokenizer: Any = None,
                             overwrite: bool = False) -> Path:
    """Write ``params`` as a compressed-tensors Hugging Face directory at ``out``."""
    from safetensors.numpy import save_file

    cfg = hf_config(config)
    tensors, qconfig = model_tensors(config, params)
    cfg["quantization_config"] = qconfig
    out = Path(out)
    with atomic_output(out, overwrite) as tmp:
        tmp.mkdir()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return out
