"""ONNX export: stories260K graphs run in onnxruntime (CPU) against our own logits, ops and bytes checked."""

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from llmeq_jax import ops
from llmeq_jax.core.qarray import tree_nbytes
from llmeq_jax.core.quantize import Spec, quantize
from llmeq_jax.core.rules import quantize_params, recipe_from_dict
from llmeq_jax.export import ExportError
from llmeq_jax.export.onnx import (Graph, build_model, empty_past, io_names, linear, next_past, pack_nibbles,
                                   session_options, write_onnx)
from llmeq_jax.models import forward as _forward
from llmeq_jax.models import load_model
from tests.shared_data import shared_data_path

MODEL = shared_data_path("stories260K.gguf")
PROMPT = "Once upon a time there was a little girl named Lily. She liked to play outside."
forward = jax.jit(_forward, static_argnums=0)
TABLE_INT8 = {"pattern": "embed/embedding", "weight": {"bits": 8, "granularity": "channel"}}


@pytest.fixture(scope="module")
def model():
    config, params, tokenizer = load_model(MODEL)
    ids = np.asarray([tokenizer(PROMPT)["input_ids"]], np.int64)
    return config, params, ids


def _quantized(params, *rules):
    return quantize_params(params, recipe_from_dict({"name": "t", "rules": list(rules)}))


def _session(model_proto):
    return ort.InferenceSession(model_proto.SerializeToString(), session_options(),
                                providers=["CPUExecutionProvider"])


def _run(session, ids, past):
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {"input_ids": ids, **past})))


def _ours(config, params, ids):
    return np.asarray(forward(config, params, jnp.asarray(ids, jnp.int32)))


def _rel_diff(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _ops(model_proto):
    return [n.op_type for n in model_proto.graph.node]


def _check_prefill_then_steps(session, config, ids, ref, steps: int):
    """The graph on ``ids`` minus its last ``steps`` tokens with empty past, then one token at a time on the present
    caches: each call's logits are ``ref`` (our full-sequence logits) at its positions, the caches grow a slot a
    step."""
    b, t = ids.shape
    out = _run(session, ids[:, : t - steps], empty_past(config, b))
    assert _rel_diff(out["logits"], ref[:, : t - steps]) <= 1e-5
    for pos in range(t - steps, t):
        out = _run(session, ids[:, pos: pos + 1], next_past(config, out))
        assert out["present.0.key"].shape == (b, config.num_kv_heads, pos + 1, config.head_dim)
        assert _rel_diff(out["logits"][:, 0], ref[:, pos]) <= 1e-5


def _init_dtypes(model_proto):
    return {t.name: t.data_type for t in model_proto.graph.initializer}


# --------------------------------------------------------------------------- pieces


def test_pack_nibbles_low_first():
    u = np.array([[1, 2, 15, 0]], np.uint8)
    np.testing.assert_array_equal(pack_nibbles(u), [[0x21, 0x0F]])


@pytest.mark.parametrize("spec, act, act_scale", [
    (Spec(bits=8, granularity="channel"), Spec(bits=8, granularity="token"), None),
    (Spec(bits=8, granularity="channel", symmetric=False), Spec(bits=8, granularity="token"), None),
    (Spec(bits=8, granularity="channel"), Spec(bits=8, granularity="tensor"), None),
    (Spec(bits=8, granularity="channel"), Spec(bits=8, granularity="tensor"), 0.02),
    (Spec(bits=4, granularity="group", group_size=32, symmetric=False), None, None),
    (Spec(bits=3, granularity="group", group_size=16), None, None),
    (Spec(bits=8, granularity="group", group_size=32, symmetric=False), None, None),
    (Spec(bits=6, granularity="channel"), None, None),
])
def test_one_linear_is_our_linear(spec, act, act_scale):
    """One quantized kernel in onnxruntime equals ops.linear on the same QArray: our integer codes, our
    scales (a short last group included) and, for W8A8, our activation grid."""
    rng = np.random.default_rng(0)
    k, n = 100, 24  # 100 inputs: the last group of 32 (or 16) is short
    w = rng.normal(size=(k, n)).astype(np.float32)
    x = rng.normal(size=(2, 5, k)).astype(np.float32)
    q = quantize(jnp.asarray(w), spec, act_spec=act,
                 act_scale=None if act_scale is None else jnp.float32(act_scale))
    ours = np.asarray(ops.linear(jnp.asarray(x), q, backend="xla") if act is None
                      else ops.w8a8_xla(jnp.asarray(x), q, act))
    g = Graph()
    y = linear(g, "x", q, None, "lin")
    graph = helper.make_graph(g.nodes + [helper.make_node("Identity", [y], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, n])],
                              initializer=g.initializers)
    m = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                helper.make_opsetid("com.microsoft", 1)])
    got = _session(m).run(None, {"x": x})[0]
    # Same codes and scales; only float32 summation order differs (W8A8: the int32 sums are exact).
    assert _rel_diff(got, ours) <= 2e-6
    expected_op = "MatMulInteger" if act else ("MatMulNBits" if spec.bits <= 4 else "DequantizeLinear")
    assert expected_op in _ops(m)
    # And the weights are stored as integers: no float initializer holds k * n values.
    assert all(t.data_type != TensorProto.FLOAT or np.prod(t.dims) < k * n for t in g.initializers)


# --------------------------------------------------------------------------- stories260K


WEIGHT_ONLY = {
    "int8-channel": {"bits": 8, "granularity": "channel"},
    "int8-g32-asym": {"bits": 8, "granularity": "group", "group_size": 32, "symmetric": False},
    "int4-g32": {"bits": 4, "granularity": "group", "group_size": 32},
    "int4-g32-asym": {"bits": 4, "granularity": "group", "group_size": 32, "symmetric": False},
    "int4-g64-asym": {"bits": 4, "granularity": "group", "group_size": 64, "symmetric": False},
}


@pytest.mark.parametrize("name", [None, *WEIGHT_ONLY])
def test_logits_match_ours(model, name):
    """Each recipe's graph gives our logits (max |Δlogit| <= 1e-5 of their scale), weights stay integers,
    and the graph's bytes are those of our tree (plus MatMulNBits' padding of a short last block)."""
    config, params, ids = model
    if name is None:  # fp32
        qparams = params
    else:
        qparams = _quantized(params, TABLE_INT8, {"pattern": ".*/kernel", "weight": WEIGHT_ONLY[name]})
    m = build_model(config, qparams)
    ref = _ours(config, qparams, ids)
    got = _run(_session(m), ids, empty_past(config, 1))["logits"]
    assert got.shape == ref.shape
    assert _rel_diff(got, ref) <= 1e-5
    graph_bytes = sum(len(t.raw_data) for t in m.graph.initializer)
    assert 0.95 * tree_nbytes(qparams) <= graph_bytes <= 1.08 * tree_nbytes(qparams) + 4096
    if name is None:
        return
    # The check can fail: the quantization itself moves the logits far more than the tolerance.
    assert _rel_diff(_ours(config, params, ids), ref) > 1e-3
    dtypes = _init_dtypes(m)
    assert dtypes["embed/qtable"] == TensorProto.INT8
    kernels = [n for n in m.graph.node if n.name.startswith("layers_0/attn/q_proj/")]
    if WEIGHT_ONLY[name]["bits"] == 4:
        (node,) = [n for n in kernels if n.op_type == "MatMulNBits"]
        assert node.domain == "com.microsoft" and dtypes[node.input[1]] == TensorProto.UINT8
        assert len(node.input) == (4 if "asym" in name else 3)  # zero points only for asymmetric grids
    else:
        (node,) = [n for n in kernels if n.op_type == "DequantizeLinear"]
        assert dtypes[node.input[0]] == TensorProto.INT8
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs.get("block_size") == (32 if "g32" in name else None)


def test_decode_steps_match_full_sequence(model):
    """Prefill T-3 tokens with empty past, then three one-token steps on the present caches: each step's
    logits are our full-sequence logits at that position, and the caches grow by one slot per step."""
    config, params, ids = model
    qparams = _quantized(params, TABLE_INT8, {"pattern": ".*/kernel", "weight": WEIGHT_ONLY["int4-g32-asym"]})
    session = _session(build_model(config, qparams))
    _check_prefill_then_steps(session, config, ids, _ours(config, qparams, ids), steps=3)
    # A batch of two equal-length rows gives each row's logits.
    two = np.concatenate([ids, ids[:, ::-1]])
    got = _run(session, two, empty_past(config, 2))["logits"]
    assert _rel_diff(got, _ours(config, qparams, two)) <= 1e-5


def test_w8a8_model(model):
    """W8A8 (dynamic per-token int8 activations): per layer the graph is our grid (test_one_linear_is_our_linear);
    over 5 layers of a 64-wide model a 1e-7 change flips activation codes on rounding boundaries (our own jit vs
    eager forward differ by 2.1e-2 here), so the whole model is held to that chaos level and to its top-1 tokens."""
    config, params, ids = model
    qparams = _quantized(params, TABLE_INT8, {"pattern": ".*/kernel", "weight": {"bits": 8, "granularity": "channel"},
                                              "act": {"bits": 8, "granularity": "token"}})
    m = build_model(config, qparams)
    ref = _ours(config, qparams, ids)
    got = _run(_session(m), ids, empty_past(config, 1))["logits"]
    assert _rel_diff(got, ref) <= 5e-2
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.9
    assert _ops(m).count("MatMulInteger") == 7 * config.num_layers + 1  # stories260K's LM head is untied


@pytest.mark.parametrize("table_rule", [None, TABLE_INT8])
def test_tied_head_reads_the_table(model, table_rule):
    """A tied LM head (SmolLM2's layout; stories260K made tied by dropping its lm_head) is the token table,
    float or int8 per row, read once from the same initializer by the lookup and by the head's Gemm."""
    import dataclasses

    config, params, ids = model
    config = dataclasses.replace(config, tie_word_embeddings=True)
    params = {k: v for k, v in params.items() if k != "lm_head"}
    rules = [r for r in (table_rule, {"pattern": ".*/kernel", "weight": WEIGHT_ONLY["int4-g32"]}) if r]
    qparams = _quantized(params, *rules)
    m = build_model(config, qparams)
    assert _rel_diff(_run(_session(m), ids, empty_past(config, 1))["logits"], _ours(config, qparams, ids)) <= 1e-5
    table = "embed/qtable" if table_rule else "embed/table"
    readers = [n.op_type for n in m.graph.node if table in n.input]
    assert sorted(readers) == (["DequantizeLinear", "Gather"] if table_rule else ["Gather", "Gemm"])


@pytest.mark.parametrize("rules, message", [
    ([{"pattern": "layers_0/attn/q_proj/kernel", "weight": {"bits": 4, "granularity": "group", "group_size": 48}}],
     "layers_0/attn/q_proj/kernel (int4 g48 sym): int4 weights go to MatMulNBits, whose block size must be a power "
     "of two >= 16; got group size 48"),
    ([{"pattern": "layers_0/mlp/down_proj/kernel", "weight": {"bits": 3, "granularity": "channel"}}],
     "layers_0/mlp/down_proj/kernel (int3 per-channel sym): int3 weights go to MatMulNBits, whose block size must be "
     "a power of two >= 16; got one block of the whole input dim 172"),
    ([{"pattern": "layers_0/attn/o_proj/kernel", "weight": {"bits": 8, "granularity": "group", "group_size": 32},
       "act": {"bits": 8, "granularity": "token"}}],
     "layers_0/attn/o_proj/kernel (int8 g32 sym, int8 token activations): W8A8 with grouped weight scales has no "
     "ONNX form"),
    ([{"pattern": "embed/embedding", "weight": {"bits": 4, "granularity": "channel"}}],
     "embed/embedding (int4 per-channel(0)): ONNX Gather reads whole bytes"),
])
def test_inexpressible_recipe_is_one_error_and_nothing_written(model, tmp_path, rules, message):
    config, params, _ = model
    with pytest.raises(ExportError) as e:
        write_onnx(config, _quantized(params, *rules), tmp_path / "m.onnx")
    assert str(e.value).startswith(message)
    assert list(tmp_path.iterdir()) == []


def test_quantized_kv_cache_is_refused(model, tmp_path):
    config, params, _ = model
    with pytest.raises(ExportError, match=r"^layers_\*/attn \(KV cache\): the recipe quantizes the KV cache"):
        write_onnx(config, params, tmp_path / "m.onnx", kv={"bits": 8})
    assert list(tmp_path.iterdir()) == []


def test_write_is_atomic_and_loads(model, tmp_path):
    config, params, ids = model
    out = tmp_path / "m.onnx"
    out.write_bytes(b"keep")
    with pytest.raises(ExportError, match="already exists"):
        write_onnx(config, params, out)
    assert out.read_bytes() == b"keep"
    write_onnx(config, params, out, overwrite=True, metadata={"recipe": "fp32"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    loaded = onnx.load(str(out))
    assert {p.key: p.value for p in loaded.metadata_props} == {"recipe": "fp32"}
    assert [i.name for i in loaded.graph.input] == ["input_ids"] + [n for pair in io_names(config)[0] for n in pair]
    session = ort.InferenceSession(str(out), session_options(), providers=["CPUExecutionProvider"])
    assert _rel_diff(_run(session, ids, empty_past(config, 1))["logits"], _ours(config, params, ids)) <= 1e-5


# --------------------------------------------------------------------------- qwen2 / qwen3 / mistral / gpt2


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "mistral", "gpt2"])
def family(request, tmp_path_factory):
    """A tiny random Qwen2 (q/k/v biases, tied head), Qwen3 (q/k RMSNorms, head dim 24 != hidden / heads, untied
    head), Mistral (a sliding window of 4 slots, shorter than the prompt) or GPT-2 (learned positions, LayerNorm,
    fused QKV with biases, tanh GELU, tied head) written by transformers and loaded by us."""
    from tests.models.hf_fixtures import make_hf_model, save

    name = request.param
    directory = tmp_path_factory.mktemp(name)
    save(make_hf_model(name), name, directory)
    config, params, _ = load_model(str(directory))
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 11)).astype(np.int64)
    return name, config, params, ids


FAMILY_INITS = {  # initializers that only a graph with the family's own features holds
    "qwen2": {f"layers_0/attn/{p}_proj/bias" for p in "qkv"},
    "qwen3": {"layers_0/attn/q_norm/scale", "layers_0/attn/k_norm/scale"},
    "gpt2": {"layers_0/ln_1/bias", "layers_0/attn/qkv_proj/bias", "layers_0/mlp/fc_in/bias", "norm/bias"},
    "mistral": set(),  # its window is in the mask (an And of two comparisons), checked below
}


@pytest.mark.parametrize("weights", [None, "int4-g32-asym", "int8-channel"])
def test_family_graphs_give_our_logits_prefill_and_decode(family, weights):
    """The qwen2 / qwen3 / mistral / gpt2 branches of the exporter against our forward: a prompt, then two one-token
    steps on the present caches, float and quantized weights; GPT-2's quantized variants also read an int8 token table
    (tied head) beside the float position table."""
    name, config, params, ids = family
    rules = [{"pattern": ".*/kernel", "weight": WEIGHT_ONLY.get(weights)}] + ([TABLE_INT8] if name == "gpt2" else [])
    qparams = params if weights is None else _quantized(params, *rules)
    m = build_model(config, qparams)
    inits = {t.name for t in m.graph.initializer}
    assert FAMILY_INITS[name] <= inits
    assert ("And" in _ops(m)) == (config.sliding_window is not None)
    if name == "gpt2":
        assert {"embed/qtable" if weights else "embed/table", "pos_embed/table"} <= inits
    ref = _ours(config, qparams, ids)
    _check_prefill_then_steps(_session(m), config, ids, ref, steps=2)
    if weights is not None:  # the check can fail: quantization moves the logits far more than the tolerance
        assert _rel_diff(_ours(config, params, ids), ref) > 1e-3
