"""GGUF (llama.cpp) export with the ``gguf`` package's writer.

Tensor types, chosen where our grid maps onto a llama.cpp block type value
for value (a block is 32 consecutive input features of one output row):

* symmetric int5..int8, per-channel / per-tensor / groups of a multiple of 32
  -> ``Q8_0``: ``x = d * q``, q int8. Our q in [-127, 127] is stored as is.
* symmetric int2..int4, same granularities -> ``Q4_0``: ``x = d * (u - 8)``,
  u an unsigned nibble; we store u = q + 8. llama.cpp's own quantizer picks
  d = max/-8 (so it uses -8..7) but its reader takes any d, so our
  d = absmax/7 grid with q in [-7, 7] is read back unchanged.
* asymmetric int2..int4 -> ``Q4_1``: ``x = d * u + m``; ours is
  ``x = (q - zp) * s`` with q in [-8, 7], so u = q + 8, d = s, m = -(zp + 8) * s.
* float leaves (norms, skipped kernels, a float token table) -> F32; a quantized token table (rows of
  the vocabulary, groups along hidden) takes the kernels' block types.

The one rounding a GGUF file forces: d (and m) are stored as float16, so each
scale moves by at most 2^-11 of itself (0.05 %); the integers are exact.
Not expressible (an ExportError naming the layer): an input dim or group size
that is not a multiple of 32, asymmetric int5..int8 (no block type with a zero
point stores them), quantized activations (W8A8: llama.cpp quantizes
activations its own way and the file has no place for our activation spec).

Our loader un-permutes Q/K rows of ``llama`` models (llama.cpp's RoPE pairs
adjacent features); this writer permutes them back. Tokenizer and general
metadata are copied from the source GGUF file, or the tokenizer is written
from a Hugging Face one (``gguf_tokenizer``); the architecture keys are
written from the ModelConfig.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from llmeq_jax.core.qarray import QArray
from llmeq_jax.core.rope import freq_factors
from llmeq_jax.core.rules import is_table
from llmeq_jax.export.common import ExportError, KernelGrid, atomic_output, flat_params, kernel_grid, table_grid
from llmeq_jax.export.gguf_tokenizer import tokenizer_metadata
from llmeq_jax.models import gguf_loader
from llmeq_jax.models.config import ModelConfig

BLOCK = 32
# Our model_type -> GGUF architecture (the ones our loader reads back). Mistral (without a sliding window) is
# llama.cpp's llama, as its converter writes it; our loader reads it back as llama, the same computation.
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}
# Source keys not copied: the writer and our config own these.
_OWN_KEYS = ("GGUF.", "general.architecture", "general.file_type", "general.quantization_version", "general.alignment")


# --------------------------------------------------------------------------- names


def _gguf_names(family: str) -> tuple[dict[str, str], dict[str, str]]:
    """Our param path (top level, inside a block) -> GGUF tensor name: the loader's maps inverted."""
    top, layer = gguf_loader.TENSOR_NAMES[family]
    return ({path: name for name, (path, _) in top.items()}, {path: name for name, (path, _) in layer.items()})


def tensor_name(path: str, family: str) -> str:
    top, layer = _gguf_names(family)
    if path in top:
        return top[path]
    head, _, rest = path.partition("/")
    if head.startswith("layers_") and rest in layer:
        return f"blk.{int(head[len('layers_'):])}.{layer[rest]}"
    raise ExportError(f"{path}: this parameter has no GGUF tensor name")


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for ``(out, ...)`` rows: the inverse of ``gguf_loader.unpermute_rope_rows``.

    Each head's rows [first half | second half] become interleaved pairs.
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------- block encoders


def gguf_type(grid: KernelGrid):
    """The llama.cpp type that holds ``grid`` value for value, or an ExportError saying why none does."""
    import gguf

    where = f"{grid.path} ({grid.describe()})"
    if grid.act_spec is not None:
        raise ExportError(f"{where}: GGUF stores weights only; quantized activations (W8A8) have no encoding "
                          "(llama.cpp quantizes activations its own way)")
    if grid.in_features % BLOCK:
        raise ExportError(f"{where}: input dim {grid.in_features} is not a multiple of the GGUF block size {BLOCK}")
    if grid.group < grid.in_features and grid.group % BLOCK:
        raise ExportError(f"{where}: group size {grid.group} is not a multiple of the GGUF block size {BLOCK}")
    if grid.symmetric:
        return gguf.GGMLQuantizationType.Q4_0 if grid.bits <= 4 else gguf.GGMLQuantizationType.Q8_0
    if grid.bits <= 4:
        return gguf.GGMLQuantizationType.Q4_1
    raise ExportError(f"{where}: asymmetric int{grid.bits} has no GGUF block type with a zero point "
                      "(Q4_1 holds up to 4 bits); use symmetric weights or at most 4 bits")


def _block_scales(grid: KernelGrid, a: np.ndarray) -> np.ndarray:
    """Per-group values (out, groups) -> per-block (out, in/32, 1)."""
    blocks = np.arange(grid.in_features // BLOCK) * BLOCK // grid.group
    return a[:, blocks][..., None]


def _f16(grid: KernelGrid, a: np.ndarray, what: str) -> np.ndarray:
    h = a.astype(np.float16)
    if not np.all(np.isfinite(h)):
        raise ExportError(f"{grid.path}: a {what} of {float(np.max(np.abs(a))):.4g} overflows the float16 GGUF stores")
    return h


def _nibbles(u: np.ndarray) -> np.ndarray:
    """(out, blocks, 32) values 0..15 -> (out, blocks, 16) bytes: element j low nibble, j+16 high (ggml's order)."""
    u = u.astype(np.uint8)
    return u[..., : BLOCK // 2] | (u[..., BLOCK // 2 :] << np.uint8(4))


def encode_q8_0(grid: KernelGrid) -> np.ndarray:
    """(out, blocks * 34) bytes: per block float16 d, then 32 int8."""
    out, k = grid.q.shape
    d = _f16(grid, _block_scales(grid, grid.scale), "scale")
    q = grid.q.reshape(out, k // BLOCK, BLOCK)
    return np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1).reshape(out, -1)


def encode_q4_0(grid: KernelGrid) -> np.ndarray:
    """(out, blocks * 18) bytes: per block float16 d, then 16 bytes of nibbles u = q + 8."""
    out, k = grid.q.shape
    d = _f16(grid, _block_scales(grid, grid.scale), "scale")
    u = grid.q.reshape(out, k // BLOCK, BLOCK).astype(np.int16) + 8
    return np.concatenate([d.view(np.uint8), _nibbles(u)], axis=-1).reshape(out, -1)


def encode_q4_1(grid: KernelGrid) -> np.ndarray:
    """(out, blocks * 20) bytes: per block float16 d, float16 m, then nibbles u = q + 8 (x = d*u + m)."""
    out, k = grid.q.shape
    scale = _block_scales(grid, grid.scale)
    zp = _block_scales(grid, grid.zero_point.astype(np.float32))
    d = _f16(grid, scale, "scale")
    # m from the stored d (not s): then x = d * (u - (zp + 8)) + rounding(m), i.e. every value keeps
    # Q4_0's relative error of d and m adds only its own float16 rounding.
    m = _f16(grid, -(zp + 8.0) * d.astype(np.float32), "block minimum")
    u = grid.q.reshape(out, k // BLOCK, BLOCK).astype(np.int16) + 8
    return np.concatenate([d.view(np.uint8), m.view(np.uint8), _nibbles(u)], axis=-1).reshape(out, -1)


def encode(grid: KernelGrid):
    """(bytes (out, row_bytes), llama.cpp type) of one quantized kernel."""
    import gguf

    qtype = gguf_type(grid)
    fn = {gguf.GGMLQuantizationType.Q8_0: encode_q8_0, gguf.GGMLQuantizationType.Q4_0: encode_q4_0,
          gguf.GGMLQuantizationType.Q4_1: encode_q4_1}[qtype]
    return fn(grid), qtype


# --------------------------------------------------------------------------- metadata


def check_config(config: ModelConfig) -> str:
    """The GGUF architecture for ``config``, or an ExportError naming what our GGUF reader could not run."""
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ExportError(f"model_type {config.model_type!r} has no GGUF export; supported: {', '.join(ARCHITECTURES)}")
    if config.rope_scaling is not None and arch != "llama":
        raise ExportError(f"{arch}: RoPE frequency scaling (rope_freqs.weight) is read by llama.cpp for the llama "
                          "architecture only")
    if config.sliding_window is not None:
        raise ExportError("sliding-window attention has no GGUF metadata for this architecture")
    if arch == "gpt2" and config.act != "gelu_tanh":
        raise ExportError(f"gpt2 with activation {config.act!r}: llama.cpp's gpt2 computes the tanh GELU only")
    return arch


def config_metadata(config: ModelConfig, arch: str) -> dict[str, tuple[Any, Any]]:
    """``{key: (value, GGUFValueType)}`` of the architecture keys our loader (and llama.cpp) reads."""
    from gguf import GGUFValueType as T

    keys = {
        "context_length": (config.max_position_embeddings, T.UINT32),
        "embedding_length": (config.hidden_size, T.UINT32),
        "block_count": (config.num_layers, T.UINT32),
        "feed_forward_length": (config.intermediate_size, T.UINT32),
        "attention.head_count": (config.num_heads, T.UINT32),
        "vocab_size": (config.vocab_size, T.UINT32),
    }
    if arch == "gpt2":  # LayerNorm; no RoPE, no grouped heads
        keys["attention.layer_norm_epsilon"] = (config.norm_eps, T.FLOAT32)
    else:
        keys.update({
            "attention.head_count_kv": (config.num_kv_heads, T.UINT32),
            "attention.layer_norm_rms_epsilon": (config.norm_eps, T.FLOAT32),
            "attention.key_length": (config.head_dim, T.UINT32),
            "attention.value_length": (config.head_dim, T.UINT32),
            "rope.dimension_count": (config.head_dim, T.UINT32),
            "rope.freq_base": (config.rope_theta, T.FLOAT32),
        })
    out = {f"{arch}.{k}": v for k, v in keys.items()}
    if config.bos_token_id is not None:
        out["tokenizer.ggml.bos_token_id"] = (config.bos_token_id, T.UINT32)
    if config.eos_ids:
        out["tokenizer.ggml.eos_token_id"] = (config.eos_ids[0], T.UINT32)
    return out


def source_metadata(reader) -> dict[str, tuple[Any, Any, Any]]:
    """``{key: (value, type, array element type)}`` of the source file's tokenizer and general keys."""
    from gguf import GGUFValueType

    out = {}
    for key, field in reader.fields.items():
        if key.startswith(_OWN_KEYS) or not key.startswith(("tokenizer.", "general.")):
            continue
        main = field.types[0]
        sub = field.types[-1] if main == GGUFValueType.ARRAY else None
        out[key] = (field.contents(), main, sub)
    return out


# --------------------------------------------------------------------------- tensors


def gguf_tensors(config: ModelConfig, params: Any) -> list[tuple[str, np.ndarray, Any]]:
    """``[(name, array, qtype or None)]``: every tensor in llama.cpp's layout, all checks done before writing."""
    permute = ARCHITECTURES.get(config.model_type) == "llama"  # llama.cpp's llama pairs RoPE features
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    out = []
    if config.rope_scaling is not None:  # Llama-3 scaling as llama.cpp reads it: one divisor per frequency
        factors = freq_factors(config.head_dim, config.rope_theta, config.rope_scaling)
        out.append((gguf_loader.ROPE_FREQS, factors, None))
    for path, leaf in flat_params(params, keep_tables=True).items():
        name = tensor_name(path, config.family)
        proj = path.split("/")[-2]
        rope_heads = heads.get(proj) if permute and path.split("/")[-3:-2] == ["attn"] else None
        if isinstance(leaf, QArray) and is_table(path):
            # A quantized token table (a kept GGUF's, or a recipe's) is already (vocab, hidden) rows: its
            # blocks where a block type holds its grid, else the floats our model reads from it.
            try:
                out.append((name, *encode(table_grid(path, leaf, float_zero_points=True))))
                continue
            except ExportError:
                leaf = leaf.dequantize()
        if isinstance(leaf, QArray):
            grid = kernel_grid(path, leaf, float_zero_points=True)
            data, qtype = encode(grid)
            if rope_heads:
                data = permute_rope_rows(data, rope_heads)  # whole rows (with their block scales) move
            out.append((name, data, qtype))
            continue
        a = np.asarray(leaf, np.float32)
        if path.endswith("/kernel"):
            a = a.T  # (in, out) -> GGUF's (out, in) rows
        if rope_heads:
            a = permute_rope_rows(a, rope_heads)
        out.append((name, np.ascontiguousarray(a), None))
    return out


def file_type(qtypes: list[Any]) -> int:
    """``general.file_type``: the most common block type (llama.cpp only displays it)."""
    import gguf

    names = {gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
             gguf.GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
             gguf.GGMLQuantizationType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1}
    quantized = [q for q in qtypes if q is not None]
    if not quantized:
        return int(gguf.LlamaFileType.ALL_F32)
    return int(names[max(set(quantized), key=quantized.count)])


def write_gguf(config: ModelConfig, params: Any, out: str | Path, *, source: str | Path | None = None,
               tokenizer: Any = None, name: str | None = None, overwrite: bool = False) -> Path:
    """Write ``params`` (float leaves and QArrays) as a GGUF file at ``out``.

    The file's tokenizer (which our loader and llama.cpp need): copied with the general metadata from
    ``source``, the GGUF file the model came from, if given; else written from ``tokenizer``, the model's
    Hugging Face tokenizer (byte-level BPE: ``gguf_tokenizer``).
    """
    import gguf

    arch = check_config(config)
    if source is None and tokenizer is None:
        raise ExportError("GGUF export needs the model's tokenizer: the source GGUF file (source= / --source) or "
                          "its Hugging Face tokenizer (tokenizer=)")
    tensors = gguf_tensors(config, params)  # every ExportError is raised here, before a byte is written
    if source is not None:
        meta = source_metadata(gguf_loader.open_reader(Path(source)))
    else:
        meta = tokenizer_metadata(tokenizer, config.vocab_size)
    meta.update({k: (v, t, None) for k, (v, t) in config_metadata(config, arch).items()})
    if name:
        meta["general.name"] = (name, gguf.GGUFValueType.STRING, None)
    out = Path(out)
    with atomic_output(out, overwrite) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        for key, (value, vtype, sub) in meta.items():
            writer.add_key_value(key, value, vtype, sub_type=sub)
        writer.add_file_type(file_type([q for _, _, q in tensors]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for tname, data, qtype in tensors:
            writer.add_tensor(tname, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out
