"""compressed-tensors export on stories260K, read back by transformers + the compressed-tensors package."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationScheme
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from llmeq_jax import ops
from llmeq_jax.core.qarray import QArray
from llmeq_jax.core.rules import quantize_params, recipe_from_dict
from llmeq_jax.export import ExportError
from llmeq_jax.export.common import flat_params, kernel_grid
from llmeq_jax.export.compressed_tensors import module_name, pack_int32, write_compressed_tensors
from llmeq_jax.models import load_model
from llmeq_jax.models import forward as _forward
from tests.shared_data import shared_data_path

MODEL = shared_data_path("stories260K.gguf")
PROMPT = "Once upon a time there was a little girl named Lily. She liked to play outside."
# stories260K's down_proj has 172 inputs: groups of 32/64 do not divide it, so grouped recipes skip it.
SKIP_DOWN = {"pattern": ".*down_proj.*", "skip": True}
forward = jax.jit(_forward, static_argnums=0)


@pytest.fixture(scope="module")
def model():
    config, params, tokenizer = load_model(MODEL)
    return config, params, tokenizer, tokenizer(PROMPT)["input_ids"]


def _quantize(params, *rules):
    return quantize_params(params, recipe_from_dict({"name": "t", "rules": list(rules)}))


def _hf_logits(directory, ids):
    m = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    with torch.no_grad():
        return m, m(torch.tensor([ids])).logits.numpy()


def _rel_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_pack_int32_matches_compressed_tensors(bits):
    q = np.random.default_rng(bits).integers(-(2 ** (bits - 1)), 2 ** (bits - 1), size=(6, 75)).astype(np.int8)
    np.testing.assert_array_equal(pack_int32(q, bits), pack_to_int32(torch.from_numpy(q), bits).numpy())


@pytest.mark.parametrize("weight, fmt", [
    ({"bits": 8, "granularity": "channel"}, "pack-quantized"),
    ({"bits": 4, "granularity": "group", "group_size": 32}, "pack-quantized"),
])
def test_transformers_logits_match(model, tmp_path, weight, fmt):
    config, params, tokenizer, ids = model
    qparams = _quantize(params, SKIP_DOWN, {"pattern": ".*/kernel", "weight": weight})
    ref = forward(config, qparams, jnp.asarray([ids], jnp.int32))
    out = write_compressed_tensors(config, qparams, tmp_path / "ct", tokenizer=tokenizer)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == fmt and qc["quant_method"] == "compressed-tensors"
    assert qc["ignore"] == [f"model.layers.{i}.mlp.down_proj" for i in range(5)]
    _, got = _hf_logits(out, ids)
    # Same integers, float32 scales: only float32 summation order differs.
    assert _rel_diff(got, ref) <= 1e-5
    assert _rel_diff(forward(config, params, jnp.asarray([ids], jnp.int32)), ref) > 1e-3  # the check can fail


def test_asymmetric_pack_quantized_decompresses_to_our_weights(model, tmp_path):
    """transformers 5.23 cannot build asymmetric pack-quantized modules (llm-compressor issue 1618: packed zero
    points vs its unpacked placeholders); the format's own decompressor reads every layer back exactly."""
    config, params, _, _ = model
    qparams = _quantize(params, SKIP_DOWN, {"pattern": ".*/kernel",
                                             "weight": {"bits": 4, "granularity": "group", "group_size": 32,
                                                        "symmetric": False}})
    out = write_compressed_tensors(config, qparams, tmp_path / "ct")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    state = load_file(str(out / "model.safetensors"))
    n = 0
    for path, leaf in flat_params(qparams).items():
        if not isinstance(leaf, QArray):
            continue
        name = module_name(path)
        local = {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
        assert "weight_zero_point" in local
        back = compressor.decompress(local, scheme)["weight"].numpy()
        np.testing.assert_array_equal(back, kernel_grid(path, leaf).dequantize())
        n += 1
    assert n == 5 * 6 + 1  # q, k, v, o, gate, up per block + lm_head


def test_w8a8_dynamic_per_token(model, tmp_path):
    """W8A8 writes int-quantized weights and a dynamic per-token activation scheme.

    End-to-end logits are no test here: on this tiny model a 1e-6 relative change of the inputs already moves
    W8A8 logits by ~2 % (activation rounding flips), so layers are compared on the same inputs instead.
    """
    config, params, tokenizer, ids = model
    qparams = _quantize(params, {"pattern": ".*/kernel", "weight": {"bits": 8, "granularity": "channel"},
                                 "act": {"bits": 8, "granularity": "token"}})
    out = write_compressed_tensors(config, qparams, tmp_path / "ct", tokenizer=tokenizer)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "int-quantized"
    acts = qc["config_groups"]["group_0"]["input_activations"]
    assert (acts["strategy"], acts["dynamic"], acts["num_bits"], acts["symmetric"]) == ("token", True, 8, True)
    assert load_file(str(out / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    m, logits = _hf_logits(out, ids)
    assert np.all(np.isfinite(logits))
    w = qparams["layers_2"]["mlp"]["gate_proj"]["kernel"]
    hf = m.model.layers[2].mlp.gate_proj
    np.testing.assert_array_equal(hf.weight.detach().numpy(), kernel_grid("gate", w).dequantize())
    x = np.random.default_rng(0).normal(size=(1, 7, config.hidden_size)).astype(np.float32)
    with torch.no_grad():
        got = hf(torch.from_numpy(x)).numpy()
    ours = np.asarray(ops.linear(jnp.asarray(x), w))
    # compressed-tensors' activation scale is absmax/127.5 (ours and vLLM's int8 kernels: absmax/127): the one
    # difference, far below a wrong weight or scale layout (which would be O(1) of the output).
    assert _rel_diff(got, ours) < 2e-2
    s = np.abs(x).max(-1, keepdims=True) / 127.5
    expected = (np.clip(np.round(x / s), -128, 127) * s) @ kernel_grid("gate", w).dequantize().T
    assert _rel_diff(got, expected) <= 1e-5


def test_w8a8_static_per_tensor_loads_with_our_input_scale(model, tmp_path):
    """Static W8A8 (rtn-w8a8-static: calibrated per-tensor activation scales) -> int-quantized with input_scale;
    transformers + compressed-tensors load it with our weights and our activation scale, and a layer on the same
    inputs gives our static W8A8 product."""
    from llmeq_jax import calibrate
    from llmeq_jax.methods import quantize_model
    from llmeq_jax.pipeline import read_recipe

    config, params, tokenizer, ids = model
    wins = calibrate.calibration_windows(tokenizer, shared_data_path("wikitext2_valid.txt"), 2, 64)
    qparams, _ = quantize_model(config, params, read_recipe("rtn-w8a8-static"), wins)
    out = write_compressed_tensors(config, qparams, tmp_path / "ct", tokenizer=tokenizer)
    acts = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "input_activations"]
    assert (acts["type"], acts["strategy"], acts["dynamic"], acts["num_bits"]) == ("int", "tensor", False, 8)
    w = qparams["layers_2"]["mlp"]["gate_proj"]["kernel"]
    assert w.act_scale is not None
    state = load_file(str(out / "model.safetensors"))
    np.testing.assert_array_equal(state["model.layers.2.mlp.gate_proj.input_scale"].numpy(),
                                  np.asarray(w.act_scale, np.float32).reshape(1))
    m, logits = _hf_logits(out, ids)
    assert np.all(np.isfinite(logits))
    hf = m.model.layers[2].mlp.gate_proj
    np.testing.assert_array_equal(hf.weight.detach().numpy(), kernel_grid("gate", w).dequantize())
    np.testing.assert_allclose(hf.input_scale.detach().numpy().reshape(()), np.asarray(w.act_scale, np.float32))
    scale, wd = float(w.act_scale), kernel_grid("gate", w).dequantize().T
    x = np.random.default_rng(0).normal(size=(1, 7, config.hidden_size)).astype(np.float32)
    x *= 127 * scale / np.abs(x).max()  # inside the calibrated range: the same product
    with torch.no_grad():
        got = hf(torch.from_numpy(x)).numpy()
    ours = np.asarray(ops.linear(jnp.asarray(x), w))
    assert _rel_diff(got, ours) <= 1e-5
    assert _rel_diff(ours, x @ wd) > 1e-3  # the activations really are rounded: the check above can fail
    # Past it, both clip, at one code apart: compressed-tensors (and vLLM's static int8) to [-128, 127], our
    # symmetric grid to [-127, 127] (docs/export.md).
    x *= 1.5
    with torch.no_grad():
        got = hf(torch.from_numpy(x)).numpy()
    ours = np.asarray(ops.linear(jnp.asarray(x), w))
    for lo, out in ((-128, got), (-127, ours)):
        want = (np.clip(np.round(x / scale), lo, 127) * scale) @ wd
        np.testing.assert_allclose(out, want, atol=1e-5 * np.abs(out).max())
    assert _rel_diff(got, ours) > 1e-4


@pytest.mark.parametrize("rules, message", [
    ([{"pattern": ".*/kernel", "weight": {"bits": 4, "granularity": "group", "group_size": 32}}],
     "layers_0/mlp/down_proj/kernel (int4 g32 sym): group size 32 does not divide the input dim 172"),
    ([SKIP_DOWN, {"pattern": ".*/kernel", "weight": {"bits": 8, "granularity": "group", "group_size": 32},
                  "act": {"bits": 8, "granularity": "token"}}],
     "W8A8 with grouped weight scales"),
])
def test_unsupported_recipe_is_one_error_and_nothing_written(model, tmp_path, rules, message):
    config, params, _, _ = model
    # Only block 0 is quantized (faster); the error must name its layer.
    rules = [{**r, "pattern": "layers_0/" + r["pattern"]} for r in rules]
    with pytest.raises(ExportError, match="^layers_0/") as e:
        write_compressed_tensors(config, _quantize(params, *rules), tmp_path / "ct")
    assert message in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_tied_embeddings_keep_lm_head_float(tmp_path):
    """A tied model (SmolLM2-style) has no lm_head kernel: the Linear transformers ties to the embedding is ignored."""
    from llmeq_jax.models import ModelConfig, init_params

    config = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16, intermediate_size=128, norm_eps=1e-5, max_position_embeddings=64,
                         tie_word_embeddings=True)
    params = init_params(config, jax.random.key(0))
    qparams = _quantize(params, {"pattern": ".*/kernel", "weight": {"bits": 4, "granularity": "group",
                                                                    "group_size": 32}})
    out = write_compressed_tensors(config, qparams, tmp_path / "ct")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]
    ids = list(range(1, 20))
    _, got = _hf_logits(out, ids)
    assert _rel_diff(got, forward(config, qparams, jnp.asarray([ids], jnp.int32))) <= 1e-5


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_fp8_writes_float_quantized_that_transformers_loads_exactly(model, tmp_path, static):
    """FP8 (E4M3) W8A8 -> float-quantized: E4M3 weights as stored, per-channel scales, float activations
    (dynamic per token, or static per tensor with input_scale); transformers' modules hold our weights."""
    from llmeq_jax import calibrate
    from llmeq_jax.methods import quantize_model
    from llmeq_jax.pipeline import read_recipe

    config, params, tokenizer, ids = model
    recipe = read_recipe("fp8-w8a8-static" if static else "fp8-w8a8")
    wins = calibrate.calibration_windows(tokenizer, shared_data_path("wikitext2_valid.txt"), 2, 64)
    qparams, _ = quantize_model(config, params, recipe, wins)
    out = write_compressed_tensors(config, qparams, tmp_path / "ct", tokenizer=tokenizer)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == "float-quantized"
    assert (group["weights"]["type"], group["weights"]["strategy"]) == ("float", "channel")
    acts = group["input_activations"]
    assert (acts["type"], acts["strategy"], acts["dynamic"]) == (("float", "tensor", False) if static
                                                                 else ("float", "token", True))
    state = load_file(str(out / "model.safetensors"))
    assert state["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert ("model.layers.0.self_attn.q_proj.input_scale" in state) == static
    m, logits = _hf_logits(out, ids)
    assert np.all(np.isfinite(logits))
    w = qparams["layers_2"]["mlp"]["gate_proj"]["kernel"]
    hf = m.model.layers[2].mlp.gate_proj
    np.testing.assert_array_equal(hf.weight.detach().float().numpy(), kernel_grid("gate", w, ("fp8",)).dequantize())
    x = np.random.default_rng(0).normal(size=(1, 7, config.hidden_size)).astype(np.float32)
    ours = np.asarray(ops.linear(jnp.asarray(x), w))
    exact = x @ np.asarray(w.dequantize())
    assert _rel_diff(ours, exact) > 1e-4  # the activations really are cast to E4M3: the check below can fail
    with torch.no_grad():
        got = hf(torch.from_numpy(x)).float().numpy()
    assert _rel_diff(got, ours) < 2e-2, _rel_diff(got, ours)
