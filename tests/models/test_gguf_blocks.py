"""GGUF files loaded with their quantized blocks kept: decoders against gguf's own dequantizer, models
against the same file dequantized, the CLI round trip back to identical GGUF bytes."""

from __future__ import annotations

import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import cli, native
from llmeq_jax.core.qarray import QArray, tree_nbytes
from llmeq_jax.export import gguf as gguf_export
from llmeq_jax.decode_layout import RowMajorKernel
from llmeq_jax.generate import decode_params, generate
from llmeq_jax.models import ModelConfig, forward, gguf_blocks, gguf_loader, load_model
from llmeq_jax.models.model import init_params
from llmeq_jax.models.params_tree import ModelLoadError
from tests.shared_data import shared_data_path

T = gguf.GGMLQuantizationType
# Byte offsets of each type's float16 block scale(s): filled with finite values in random blocks.
F16_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
          "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82)}
ASYMMETRIC = ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q2_K")
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def random_blocks(rng, name: str, n_blocks: int, d_std: float = 0.05) -> np.ndarray:
    """``n_blocks`` blocks of type ``name``: random code and sub-scale bytes, random finite float16 scales;
    block 0 has a zero scale, block 1 (asymmetric types) a zero scale and a zero minimum."""
    _, nbytes, _ = gguf_blocks.DECODERS[name]
    b = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    for at in F16_AT[name]:
        b[:, at : at + 2] = rng.normal(0, d_std, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    first = F16_AT[name][0]
    b[0, first : first + 2] = 0
    if name in ASYMMETRIC:
        b[1, first : first + 4] = 0  # d and the minimum's scale
    return b


@pytest.mark.parametrize("name", list(gguf_blocks.DECODERS))
def test_decoders_match_gguf_dequantize(name):
    rng = np.random.default_rng(len(name))
    per_block, _, _ = gguf_blocks.DECODERS[name]
    rows, cols = 4, 2 * 256
    raw = random_blocks(rng, name, rows * cols // per_block).reshape(rows, -1)
    want = gguf.quants.dequantize(raw, T[name])
    grid = gguf_blocks.decode(raw, name, rows, cols)
    lo, hi = -(2 ** (grid.bits - 1)), 2 ** (grid.bits - 1) - 1
    assert grid.q.dtype == np.int8 and lo <= grid.q.min() and grid.q.max() <= hi
    assert (grid.zero_point is None) == (name not in ASYMMETRIC)
    # Symmetric grids are the file's products exactly; a float zero point rounds once in float32.
    np.testing.assert_allclose(grid.dequantize(), want, rtol=0, atol=2e-7 * np.abs(want).max() if name in ASYMMETRIC
                               else 0)
    # Our (in, out) kernel of it dequantizes to the transpose.
    kernel = grid.kernel(jnp.float32)
    assert kernel.shape == (cols, rows) and kernel.tile == (grid.group, 1)
    np.testing.assert_array_equal(np.asarray(kernel.dequantize()), grid.dequantize().T)


def test_decode_checks_block_counts():
    raw = random_blocks(np.random.default_rng(0), "Q4_0", 4).reshape(2, -1)
    with pytest.raises(ValueError, match="not a whole number of 32-value blocks"):
        gguf_blocks.decode(raw, "Q4_0", 2, 48)
    with pytest.raises(ValueError, match="holds 4 blocks"):
        gguf_blocks.decode(raw, "Q4_0", 2, 96)


def _write_blocks(monkeypatch, path, config, params, source, type_of):
    """``params`` written as GGUF with each (out, in) tensor re-encoded as ``type_of(name, data)`` (None: as
    the exporter writes it): gguf's quantizer for the 32-value types, random blocks for the K-quants."""
    rng = np.random.default_rng(0)
    plain = gguf_export.gguf_tensors

    def blocks(config, params):
        out = []
        for name, data, qtype in plain(config, params):
            kind = type_of(name, data) if data.ndim == 2 and qtype is None else None
            if kind in K_QUANTS:
                n = data.size // 256
                data = random_blocks(rng, kind, n, d_std=2e-3).reshape(data.shape[0], -1)
            elif kind is not None:
                data = gguf.quants.quantize(data.astype(np.float32), T[kind])
            out.append((name, data, qtype if kind is None else T[kind]))
        return out

    monkeypatch.setattr(gguf_export, "gguf_tensors", blocks)
    monkeypatch.setattr(gguf_export, "file_type", lambda qtypes: int(gguf.LlamaFileType.MOSTLY_Q4_K_M))  # display only
    return gguf_export.write_gguf(config, params, path, source=source)


def _rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


LEGACY = ("Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1")


def test_stories260k_kept_quantized_computes_the_file(monkeypatch, tmp_path):
    """A real model in every 32-value block type (one per linear weight, in turn): kept quantized, it gives
    the logits and the greedy text of the same file dequantized to float, in less memory."""
    stories = shared_data_path("stories260K.gguf")
    config, params, tok = load_model(stories)
    names = iter(range(10**6))

    def type_of(name, data):
        return LEGACY[next(names) % len(LEGACY)] if data.shape[1] % 32 == 0 else None

    path = _write_blocks(monkeypatch, tmp_path / "blocks.gguf", config, params, stories, type_of)
    _, floats, _ = load_model(path)
    _, kept, _ = load_model(path, keep_quantized=True)
    kernels = {k: v for k, v in jax.tree_util.tree_flatten_with_path(kept, is_leaf=lambda x: isinstance(x, QArray))[0]
               if isinstance(v, QArray)}
    types = [t.tensor_type.name for t in gguf_loader.open_reader(path).tensors]
    assert set(LEGACY) <= set(types)
    assert {q.bits for q in kernels.values()} == {4, 5, 8} and len(kernels) == sum(t in LEGACY for t in types)
    assert isinstance(kept["embed"]["embedding"], QArray)  # the token table too, rows whole (groups along hidden)
    assert tree_nbytes(kept) < 0.6 * tree_nbytes(floats)
    ids = jnp.asarray(tok("Once upon a time, there was a little girl named Lily.")["input_ids"])[None]
    assert _rel(forward(config, kept, ids), forward(config, floats, ids)) < 1e-5
    prompt = jnp.asarray([[1, 403, 407, 261, 378]])
    a = generate(config, kept, prompt, max_new_tokens=24)
    b = generate(config, floats, prompt, max_new_tokens=24)
    assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("table", ["Q4_K", "Q2_K"])
def test_k_quants_kept_quantized_compute_the_file(monkeypatch, tmp_path, table):
    """Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (super-blocks of 256: a model 256 wide), Q/K rows un-permuted like the
    floats, a K-quant token table that is also the (tied) head."""
    config = ModelConfig(model_type="llama", vocab_size=512, hidden_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, intermediate_size=512, max_position_embeddings=64,
                         norm_eps=1e-5, tie_word_embeddings=True)
    params = init_params(config, jax.random.key(0))
    kinds = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q3_K", "ffn_gate": "Q5_K",
             "ffn_up": "Q2_K", "ffn_down": "Q6_K", "token_embd": table}
    path = _write_blocks(monkeypatch, tmp_path / "k.gguf", config, params, shared_data_path("stories260K.gguf"),
                         lambda name, data: kinds.get(name.split(".")[-2]))
    reader = gguf_loader.open_reader(path)
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == set(K_QUANTS)
    _, floats, _ = load_model(path)
    _, kept, _ = load_model(path, keep_quantized=True)
    q = kept["layers_0"]["attn"]["q_proj"]["kernel"]
    assert isinstance(q, QArray) and q.bits == 4 and q.tile == (32, 1) and q.zero_point.dtype == jnp.float32
    assert kept["layers_0"]["attn"]["k_proj"]["kernel"].bits == 5
    assert kept["layers_0"]["attn"]["v_proj"]["kernel"].tile == (16, 1)  # Q6_K: int6 in groups of 16
    o, up = kept["layers_0"]["attn"]["o_proj"]["kernel"], kept["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert (o.bits, o.tile, o.zero_point) == (3, (16, 1), None)  # Q3_K: int3, eight values in three bytes
    assert (up.bits, up.tile, up.zero_point.dtype) == (2, (16, 1), jnp.float32)  # Q2_K: int2, float zero points
    assert kept["embed"]["embedding"].tile == ((1, 32) if table == "Q4_K" else (1, 16)) and "lm_head" not in kept
    ids = jnp.arange(1, 25, dtype=jnp.int32)[None]
    assert _rel(forward(config, kept, ids), forward(config, floats, ids)) < 1e-5
    # Decode: the row-major kernels (int6 in groups of 16 paired per step; int2 / int3 split in 2 / 3 bits where the
    # VNNI tile runs, else widened to int4 in groups of 16, four a step) and the quantized tied head.
    a, b = generate(config, kept, ids, max_new_tokens=8), generate(config, floats, ids, max_new_tokens=8)
    assert np.array_equal(np.asarray(a), np.asarray(b))
    # ... reading every K-quant's sub-block scales as int8 codes times its super-block scale (the generate
    # above did), the head's too when it is Q2_K (groups of 16; Q4_K's table stays a per-row-scaled lookup)
    laid_out = decode_params(kept, 1)
    row_major = [leaf for leaf in jax.tree_util.tree_leaves(laid_out, is_leaf=lambda a: isinstance(a, RowMajorKernel))
                 if isinstance(leaf, RowMajorKernel)]
    assert len(row_major) >= 12 and all(leaf.codes is not None for leaf in row_major)
    # ... and, where the VNNI tile runs, every one split in as many bits as its codes take (Q2_K 2, Q3_K 3 -- int4
    # slots holding them -- Q4_K 4, Q5_K 5, Q6_K 6); without it, int2 / int3 stay in int4 slots
    widths = {2, 3, 4, 5, 6} if native.vnni() else {4, 5, 6}
    assert all(leaf.split == native.vnni() for leaf in row_major) and {leaf.w.bits for leaf in row_major} == widths


def test_cli_keeps_a_gguf_quantized_and_exports_the_same_blocks(monkeypatch, tmp_path, capsys):
    """`llmeq convert --keep-quantized` then `llmeq export --format gguf`: the Q4_1 / Q8_0 tensors come back
    byte for byte; `eval --keep-quantized` reads the file with the integers it stores."""
    stories = shared_data_path("stories260K.gguf")
    config, params, _ = load_model(stories)
    path = _write_blocks(monkeypatch, tmp_path / "q.gguf", config, params, stories,
                         lambda name, data: ("Q8_0" if "ffn" in name or "embd" in name else "Q4_1")
                         if data.shape[1] % 32 == 0 else None)
    monkeypatch.undo()
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.gguf"
    assert cli.main(["convert", str(path), str(ckpt), "--keep-quantized", "--json"]) == 0
    assert cli.main(["export", str(ckpt), "--format", "gguf", "--out", str(out), "--source", str(path), "--json"]) == 0
    src = {t.name: t for t in gguf_loader.open_reader(path).tensors}
    kept = [t for t in gguf_loader.open_reader(out).tensors if t.tensor_type.name in ("Q4_1", "Q8_0")]
    assert len(kept) == sum(t.tensor_type.name in ("Q4_1", "Q8_0") for t in src.values()) > 0
    for t in kept:
        assert src[t.name].tensor_type == t.tensor_type
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(src[t.name].data), err_msg=t.name)
    capsys.readouterr()
    assert cli.main(["export", str(ckpt), "--format", "compressed-tensors", "--out", str(tmp_path / "ct")]) == 2
    assert "float zero points" in capsys.readouterr().err
    assert cli.main(["convert", str(path), str(tmp_path / "c2"), "--keep-quantized", "--recipe", "rtn-w8"]) == 2
    assert "pass one of them" in capsys.readouterr().err
    assert cli.main(["eval", str(ckpt), "--keep-quantized"]) == 2
    assert "is a checkpoint" in capsys.readouterr().err
    with pytest.raises(ModelLoadError, match="Hugging Face directory holds float weights"):
        load_model(tmp_path, keep_quantized=True)
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. She liked to run. " * 20)
    rows = []
    for flags in ([], ["--keep-quantized"]):
        assert cli.main(["eval", str(path), "--text", str(text), "--seq-len", "64", "--windows", "4", "--json",
                         *flags]) == 0
        rows.append(json.loads(capsys.readouterr().out)["rows"][0])
    assert [r["recipe"] for r in rows] == ["as-loaded", "gguf-as-stored"]
    assert rows[1]["param_bytes"] < 0.6 * rows[0]["param_bytes"]
    assert rows[1]["ppl"] == pytest.approx(rows[0]["ppl"], rel=1e-5)
