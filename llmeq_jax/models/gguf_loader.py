"""Load a GGUF file (llama.cpp format) through the ``gguf`` package.

* Config from the ``{arch}.*`` metadata; architectures ``llama``, ``qwen2``, ``qwen3`` and ``gpt2`` (llama.cpp's
  names: ``attn_qkv`` is GPT-2's fused q | k | v, ``position_embd`` its learned positions).
* Tensors: F32/F16/BF16 as stored, quantized types (Q8_0, Q4_0, Q4_1, Q4_K,
  Q6_K, ...) dequantized by ``gguf.quants.dequantize`` one tensor at a time; or, with
  ``keep_quantized``, linear weights and the token table in the types :mod:`gguf_blocks` reads (Q8_0, Q4_0,
  Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) kept as QArrays holding the file's integers (norms, biases and learned
  positions are always float).
* llama.cpp's converter permutes the rows of Q and K of ``llama`` models so
  that its RoPE can rotate adjacent pairs; we undo that so our rotate-half
  RoPE (the HF layout) applies.
* ``rope_freqs.weight`` (llama.cpp's per-frequency RoPE divisors: how Llama-3.1 files carry their frequency
  scaling) becomes the config's ``rope_scaling`` (``core.rope.FREQ_FACTORS``), not a parameter.
* Tokenizer: built by ``transformers``' own GGUF tokenizer converter from the
  ``tokenizer.ggml.*`` metadata. The metadata is read here rather than by
  ``AutoTokenizer.from_pretrained(gguf_file=...)`` because some files (e.g.
  stories260K) mark "no such token" with the id 2**32-1, which that loader
  uses as an index; such ids are dropped first.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from llmeq_jax.core.rope import freq_factors_scaling
from llmeq_jax.core.rules import EMBEDDING_TABLE
from llmeq_jax.models import gguf_blocks
from llmeq_jax.models.config import ModelConfig, ModelConfigError
from llmeq_jax.models.params_tree import ModelLoadError, TreeBuilder

# GGUF architecture -> our model_type.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}
_NO_TOKEN = 2**32 - 1

# GGUF tensor name (top level / inside block N) -> (our param path, transpose from GGUF's (out, in) rows).
_LLAMA_TOP = {
    "token_embd.weight": ("embed/embedding", False),
    "output_norm.weight": ("norm/scale", False),
    "output.weight": ("lm_head/kernel", True),
}
_LLAMA_LAYER = {
    "attn_norm.weight": ("input_norm/scale", False),
    "ffn_norm.weight": ("post_attn_norm/scale", False),
    "attn_q.weight": ("attn/q_proj/kernel", True),
    "attn_k.weight": ("attn/k_proj/kernel", True),
    "attn_v.weight": ("attn/v_proj/kernel", True),
    "attn_output.weight": ("attn/o_proj/kernel", True),
    "attn_q.bias": ("attn/q_proj/bias", False),
    "attn_k.bias": ("attn/k_proj/bias", False),
    "attn_v.bias": ("attn/v_proj/bias", False),
    "attn_q_norm.weight": ("attn/q_norm/scale", False),
    "attn_k_norm.weight": ("attn/k_norm/scale", False),
    "ffn_gate.weight": ("mlp/gate_proj/kernel", True),
    "ffn_up.weight": ("mlp/up_proj/kernel", True),
    "ffn_down.weight": ("mlp/down_proj/kernel", True),
}
_GPT2_TOP = {
    "token_embd.weight": ("embed/embedding", False),
    "position_embd.weight": ("pos_embed/embedding", False),
    "output_norm.weight": ("norm/scale", False),
    "output_norm.bias": ("norm/bias", False),
    "output.weight": ("lm_head/kernel", True),
}
_GPT2_LAYER = {
    "attn_norm.weight": ("ln_1/scale", False),
    "attn_norm.bias": ("ln_1/bias", False),
    "attn_qkv.weight": ("attn/qkv_proj/kernel", True),
    "attn_qkv.bias": ("attn/qkv_proj/bias", False),
    "attn_output.weight": ("attn/o_proj/kernel", True),
    "attn_output.bias": ("attn/o_proj/bias", False),
    "ffn_norm.weight": ("ln_2/scale", False),
    "ffn_norm.bias": ("ln_2/bias", False),
    "ffn_up.weight": ("mlp/fc_in/kernel", True),
    "ffn_up.bias": ("mlp/fc_in/bias", False),
    "ffn_down.weight": ("mlp/fc_out/kernel", True),
    "ffn_down.bias": ("mlp/fc_out/bias", False),
}
# Our model family -> (top-level names, per-block names).
TENSOR_NAMES = {"llama": (_LLAMA_TOP, _LLAMA_LAYER), "gpt2": (_GPT2_TOP, _GPT2_LAYER)}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def open_reader(path: Path):
    import gguf

    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # bad magic, truncated header or tensor data
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def metadata(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(reader, source: str) -> ModelConfig:
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelConfigError(
            f"{source}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )

    def need(key: str):
        value = metadata(reader, f"{arch}.{key}")
        if value is None:
            raise ModelConfigError(f"{source}: missing GGUF metadata key {arch}.{key!r}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = metadata(reader, f"{arch}.vocab_size") or (int(embd.shape[1]) if embd is not None else None)
    if vocab is None:
        raise ModelConfigError(f"{source}: cannot tell the vocabulary size (no {arch}.vocab_size, no token_embd)")
    eos = metadata(reader, "tokenizer.ggml.eos_token_id")
    bos = metadata(reader, "tokenizer.ggml.bos_token_id")
    common = dict(
        model_type=ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(need("block_count")),
        num_heads=heads,
        intermediate_size=int(need("feed_forward_length")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=None if bos in (None, _NO_TOKEN) else int(bos),
        eos_token_id=None if eos in (None, _NO_TOKEN) else int(eos),
    )
    if arch == "gpt2":  # LayerNorm, learned positions (one per context slot), llama.cpp's tanh GELU
        return ModelConfig(**common, num_kv_heads=heads, head_dim=hidden // heads,
                           norm_eps=float(need("attention.layer_norm_epsilon")),
                           max_position_embeddings=int(need("context_length")), act="gelu_tanh")
    head_dim = int(metadata(reader, f"{arch}.attention.key_length", hidden // heads))
    return ModelConfig(
        **common,
        num_kv_heads=int(metadata(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(metadata(reader, f"{arch}.context_length", 2048)),
        rope_theta=float(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling_from_gguf(reader, head_dim, source),
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
    )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order for a ``(out, in)`` weight (or ``(out,)`` bias).

    Its converter turns each head's rows [first half | second half] into
    interleaved pairs (h0, h_{d/2}, h1, h_{d/2+1}, ...); this puts them back.
    """
    out = w.shape[0]
    head_dim = out // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency RoPE divisors (Llama-3.1 files carry their scaling so)


def rope_scaling_from_gguf(reader, head_dim: int, source: str) -> tuple | None:
    """The config's rope_scaling from the file's ``rope_freqs.weight`` (frequency i divided by factor i), or None."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    factors = tensor_as_float(tensor, source).reshape(-1)
    if factors.size != head_dim // 2 or not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise ModelConfigError(f"{source}: {ROPE_FREQS} must hold {head_dim // 2} positive factors (one per RoPE "
                               f"frequency of head_dim {head_dim}); got {factors.size} values")
    return freq_factors_scaling(factors)


def tensor_as_float(tensor, source: str) -> np.ndarray:
    """A GGUF tensor as a float numpy array in row-major (out, in) order."""
    import gguf

    qtype = tensor.tensor_type
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(tensor.data)
    try:
        return gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        supported = ["F32", "F16"] + [t.name for t in gguf.quants._type_traits]
        raise ModelLoadError(
            f"{source}: tensor {tensor.name!r} has GGUF type {qtype.name}, which cannot be dequantized; "
            f"supported: {', '.join(supported)}"
        ) from None


def kept_grid(tensor, heads: int | None) -> gguf_blocks.BlockGrid | None:
    """A 2-D GGUF tensor whose block type :mod:`gguf_blocks` reads, as the file's integers in ``(rows, cols)``
    order (Q/K rows un-permuted when ``heads`` is given); None for other types."""
    name = tensor.tensor_type.name
    if not gguf_blocks.keeps(name) or len(tensor.shape) != 2:
        return None
    cols, rows = (int(n) for n in tensor.shape)  # GGUF lists dims innermost first
    grid = gguf_blocks.decode(tensor.data, name, rows, cols)
    if heads is not None:
        grid = grid.rows(unpermute_rope_rows(np.arange(rows), heads))
    return grid


def load_params(reader, config: ModelConfig, dtype: Any, source: str, keep_quantized: bool = False) -> dict:
    """The param tree; ``keep_quantized``: linear weights and the token table in the block types
    :mod:`gguf_blocks` reads stay quantized (QArrays with the file's integers), everything else is
    dequantized to ``dtype``."""
    builder = TreeBuilder(config, dtype, source)
    permute_qk = config.model_type == "llama"
    top, layer = TENSOR_NAMES[config.family]
    for tensor in tqdm(reader.tensors, desc="load", unit="tensor", leave=False):
        name = tensor.name
        m = _BLOCK.fullmatch(name)
        if m and m.group(2) in layer:
            path, transpose = layer[m.group(2)]
            path = f"layers_{int(m.group(1))}/{path}"
        elif name in top:
            path, transpose = top[name]
        elif name == ROPE_FREQS:
            continue  # read into the config (rope_scaling_from_gguf)
        else:
            raise ModelLoadError(f"{source}: tensor {name!r} is not a parameter of a {config.model_type} model")
        heads = None
        if permute_qk and m and m.group(2).startswith(("attn_q.", "attn_k.")):
            heads = config.num_heads if m.group(2).startswith("attn_q.") else config.num_kv_heads
        # Linear weights become (in, out) kernels; the token table stays (vocab, hidden), rows whole.
        kept = kept_grid(tensor, heads) if keep_quantized and (transpose or path == EMBEDDING_TABLE) else None
        if kept is not None:
            builder.put(path, kept.kernel(dtype) if transpose else kept.table(dtype), name)
            continue
        value = tensor_as_float(tensor, source)
        if heads is not None:
            value = unpermute_rope_rows(value, heads)
        builder.put(path, value.T if transpose else value, name)
        del value
    return builder.finish()


def tokenizer_from_gguf(reader, source: str):
    """A ``transformers`` fast tokenizer built from the file's ``tokenizer.ggml.*`` metadata."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    def read(group: str) -> dict:
        out = {}
        for key, name in GGUF_TOKENIZER_MAPPING[group].items():
            value = metadata(reader, f"tokenizer.{key}")
            if value is not None and not (isinstance(value, int) and value == _NO_TOKEN):
                out[name] = value
        return out

    tokenizer_dict, tokenizer_config = read("tokenizer"), read("tokenizer_config")
    if "tokens" not in tokenizer_dict:
        raise ModelLoadError(f"{source}: the GGUF file carries no tokenizer (no tokenizer.ggml.tokens)")
    tokens = tokenizer_dict["tokens"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    special = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unk_token_id", "pad_token": "pad_token_id"}
    for name, key in special.items():
        if key in tokenizer_dict:
            tokenizer_config[name] = tokens[tokenizer_dict[key]]
    arch = metadata(reader, "general.architecture")
    backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    if not isinstance(tokenizer_config.get("chat_template"), str):
        tokenizer_config.pop("chat_template", None)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def load_gguf(path: str | Path, dtype: Any, keep_quantized: bool = False):
    path = Path(path)
    reader = open_reader(path)
    config = config_from_gguf(reader, str(path))
    params = load_params(reader, config, dtype, str(path), keep_quantized)
    return config, params, tokenizer_from_gguf(reader, str(path))
