"""ModelConfig: the one description of an architecture that the model code reads.

Built from a Hugging Face ``config.json`` (:func:`config_from_hf_dict`) or from
GGUF metadata (see ``gguf_loader``). Both sources are validated here, so a
missing key or an unknown ``model_type`` fails with one message naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# model_type -> family of model code that runs it.
FAMILIES = {
    "gpt2": "gpt2",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


class ModelConfigError(ValueError):
    """A config (HF json or GGUF metadata) that does not describe a model we can run."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float = 10000.0
    # Llama-3 style frequency scaling: a tuple of (key, value) pairs so the config stays hashable -- the llama3
    # parameters (a Hugging Face config), or ("freq_factors", divisors) from a GGUF file's rope_freqs.weight.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    sliding_window: int | None = None
    # Per layer: True where attention is limited to `sliding_window` (None: every layer is full).
    sliding_layers: tuple[bool, ...] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in FAMILIES:
            raise ModelConfigError(
                f"unknown model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return True if self.sliding_layers is None else self.sliding_layers[layer]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)


def _require(d: dict, key: str, source: str) -> Any:
    if key not in d or d[key] is None:
        raise ModelConfigError(f"{source}: missing required key {key!r}")
    return d[key]


def _rope(d: dict) -> tuple[float, tuple | None]:
    """rope_theta and scaling from either transformers-5 `rope_parameters` or older keys."""
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelConfigError(f"rope type {rope_type!r} is not supported; supported: 'default', 'llama3'")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ModelConfigError(f"llama3 rope scaling is missing {missing}")
    return theta, tuple((k, float(scaling[k])) for k in keys)


def _eos(value: Any) -> int | tuple[int, ...] | None:
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return value


def config_from_hf_dict(d: dict, source: str = "config.json") -> ModelConfig:
    """A ModelConfig from the contents of a Hugging Face ``config.json``."""
    model_type = d.get("model_type")
    if model_type not in FAMILIES:
        raise ModelConfigError(
            f"{source}: unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "gpt2":
        return _gpt2_from_hf(d, source)
    return _llama_from_hf(d, source)


def _gpt2_from_hf(d: dict, source: str) -> ModelConfig:
    hidden = int(_require(d, "n_embd", source))
    heads = int(_require(d, "n_head", source))
    act = d.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu", "gelu_pytorch_tanh"):
        raise ModelConfigError(f"{source}: activation_function {act!r} is not supported for gpt2")
    return ModelConfig(
        model_type="gpt2",
        vocab_size=int(_require(d, "vocab_size", source)),
        hidden_size=hidden,
        num_layers=int(_require(d, "n_layer", source)),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=int(d.get("n_inner") or 4 * hidden),
        norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(_require(d, "n_positions", source)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        act="gelu_tanh" if act != "gelu" else "gelu",
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=_eos(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"),
    )


def _llama_from_hf(d: dict, source: str) -> ModelConfig:
    model_type = d["model_type"]
    hidden = int(_require(d, "hidden_size", source))
    heads = int(_require(d, "num_attention_heads", source))
    num_layers = int(_require(d, "num_hidden_layers", source))
    theta, scaling = _rope(d)
    if d.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{source}: hidden_act {d.get('hidden_act')!r} is not supported (expected 'silu')")
    if d.get("mlp_bias"):
        raise ModelConfigError(f"{source}: mlp_bias=True is not supported")
    attention_bias = bool(d.get("attention_bias", False)) and model_type != "mistral"
    sliding_window, sliding_layers = None, None
    if model_type == "mistral":
        sliding_window = d.get("sliding_window")
    elif model_type in ("qwen2", "qwen3") and d.get("use_sliding_window"):
        sliding_window = d.get("sliding_window")
        types = d.get("layer_types")
        if types is None:  # older configs: layers from max_window_layers on slide
            start = int(d.get("max_window_layers", num_layers))
            types = ["full_attention" if i < start else "sliding_attention" for i in range(num_layers)]
        sliding_layers = tuple(t == "sliding_attention" for t in types)
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(_require(d, "vocab_size", source)),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        intermediate_size=int(_require(d, "intermediate_size", source)),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=int(sliding_window) if sliding_window else None,
        sliding_layers=sliding_layers,
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type != "qwen2" and attention_bias,
        qk_norm=model_type == "qwen3",
        act="silu",
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=_eos(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"),
    )
