"""ops.linear through the Pallas path (interpret mode on CPU) against the XLA path."""

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import ops
from llmeq_jax.core.quantize import Spec, quantize
from llmeq_jax import kernel_dispatch as dispatch
from pallas_kernels import config

W8A8 = (Spec(bits=8, granularity="channel"), Spec(bits=8, granularity="token"))
W4G128 = (Spec(bits=4, granularity="group", group_size=128), None)
FP8_W8A8 = (Spec(bits=8, granularity="channel", grid="fp8"), Spec(bits=8, granularity="token", grid="fp8"))


def _q(spec_pair, shape=(200, 48), seed=0):
    spec, act = spec_pair
    return quantize(jax.random.normal(jax.random.key(seed), shape) * 0.1, spec, act_spec=act)


def test_cpu_without_interpret_falls_back_to_xla():
    q = _q(W8A8)
    x = jnp.ones((2, 200))
    assert not config.interpret_enabled()
    assert dispatch.linear(x, q, q.act_spec) is None
    with pytest.raises(dispatch.KernelUnavailable, match="needs a CUDA GPU"):
        ops.linear(x, q, backend="pallas")


def test_interpret_switch_is_scoped():
    with config.interpret(True):
        assert config.interpret_enabled()
    assert not config.interpret_enabled()


def test_disabled_turns_kernels_off_inside_its_block():
    q = _q(W8A8)
    x = jnp.ones((2, 200))
    with config.interpret(True):
        assert dispatch.linear(x, q, q.act_spec) is not None
        with config.disabled():
            assert not config.kernels_available()
            assert dispatch.linear(x, q, q.act_spec) is None
            with pytest.raises(dispatch.KernelUnavailable, match="kernels are off"):
                ops.linear(x, q, backend="pallas")
        assert config.kernels_available()


@pytest.mark.parametrize("pair", [W8A8, W4G128], ids=["w8a8", "w4g128"])
def test_ops_linear_pallas_equals_xla(pair):
    q = _q(pair)
    x = jax.random.normal(jax.random.key(1), (2, 3, 200))
    with config.interpret(True):
        assert dispatch.plan(x.shape, x.dtype, q, q.act_spec)[0] is not None
        y = ops.linear(x, q, jnp.arange(48.0), backend="pallas")
    r = ops.linear(x, q, jnp.arange(48.0), backend="xla")
    np.testing.assert_allclose(y, r, rtol=1e-5, atol=1e-5)


def test_float_zero_points_stay_in_xla():
    """GGUF Q4_1 / K-quant grids kept as stored have float zero points; the kernels subtract integer ones in
    bf16/fp16, so auto falls back to XLA (which computes them exactly) and a required kernel says why."""
    import dataclasses

    q = _q((Spec(bits=4, granularity="group", group_size=32, symmetric=False), None))
    fq = dataclasses.replace(q, zero_point=q.zero_point.astype(jnp.float32) + 0.25)
    x = jax.random.normal(jax.random.key(1), (2, 200))
    with config.interpret(True):
        assert dispatch.plan(x.shape, x.dtype, q, None)[0] == "weight_only"
        assert dispatch.plan(x.shape, x.dtype, fq, None) == (None, "float zero points (the kernels take integer ones)")
        assert dispatch.linear(x, fq, None) is None
        with pytest.raises(dispatch.KernelUnavailable, match="float zero points"):
            ops.linear(x, fq, backend="pallas")
    np.testing.assert_allclose(ops.linear(x, fq), x @ fq.dequantize(), rtol=1e-5, atol=1e-5)


def test_required_kernel_that_cannot_apply_says_why():
    with config.interpret(True):
        for bits in (2, 3):  # four per byte / eight per three bytes: the kernel reads int8 or int4 only
            q = _q((Spec(bits=bits, granularity="channel"), None))
            with pytest.raises(dispatch.KernelUnavailable, match=f"int{bits} weights"):
                ops.linear(jnp.ones((1, 200)), q, backend="pallas")
            assert dispatch.linear(jnp.ones((1, 200)), q, None) is None  # auto: fall back
        dyn_tensor = Spec(bits=8, granularity="tensor")
        assert "dynamic tensor" in dispatch.plan((1, 200), jnp.float32, _q(W8A8), dyn_tensor)[1]


def _mlp(params, x, backend):
    h = jax.nn.gelu(ops.linear(x, params["up"]["kernel"], backend=backend))
    return ops.linear(h, params["down"]["kernel"], backend=backend)


@pytest.mark.parametrize("pair", [W8A8, W4G128], ids=["w8a8", "w4g128"])
def test_two_layer_model_logits_match(pair):
    """A two-layer MLP of larger shapes (the stories260K model-level check is in test_model_parity.py)."""
    params = {"up": {"kernel": _q(pair, (256, 384), 2)}, "down": {"kernel": _q(pair, (384, 64), 3)}}
    x = jax.random.normal(jax.random.key(4), (2, 5, 256))
    with config.interpret(True):
        pallas_logits = jax.jit(lambda p, x: _mlp(p, x, "pallas"))(params, x)
    xla_logits = jax.jit(lambda p, x: _mlp(p, x, "xla"))(params, x)
    np.testing.assert_allclose(pallas_logits, xla_logits, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(xla_logits))))


def test_fp8_products_go_to_the_fp8_kernel_only_with_fp8_activations_on_sm89_plus(monkeypatch):
    w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 32)), jnp.float32)
    fp8, act = Spec(8, "channel", grid="fp8"), Spec(8, "token", grid="fp8")
    with config.interpret(True):
        assert dispatch.plan((2, 64), jnp.float32, quantize(w, fp8, act_spec=act), act) == ("fp8_w8a8", "")
        kind, why = dispatch.plan((2, 64), jnp.float32, quantize(w, fp8), None)
        assert kind is None and "without fp8 activations" in why
        with pytest.raises(dispatch.KernelUnavailable, match="without fp8 activations"):
            ops.linear(jnp.ones((2, 64)), quantize(w, fp8), backend="pallas")
    from pallas_kernels import w8a8

    class Device:  # what jax reports for a CUDA device: its compute capability as "major.minor"
        def __init__(self, cc):
            self.compute_capability = cc

    assert w8a8.fp8_supported(Device("9.0")) and w8a8.fp8_supported(Device("8.9"))
    assert not w8a8.fp8_supported(Device("8.0")) and not w8a8.fp8_supported(Device(None))
    # a JAX whose Pallas took no FP8 dot rule (pallas_kernels.fp8_dot) runs no FP8 kernel, even on Hopper
    monkeypatch.setattr(w8a8.fp8_dot, "TRITON_LOWERING", False)
    assert not w8a8.fp8_supported(Device("9.0"))


# --------------------------------------------------------------------------- K-major int8 for decode

W8G32 = (Spec(bits=8, granularity="group", group_size=32, symmetric=False), None)
FP8 = (Spec(8, "channel", grid="fp8"), Spec(8, "token", grid="fp8"))


def _kmajor_calls(monkeypatch):
    """Record the w_layout of every W8A8 / weight-only kernel call."""
    from pallas_kernels import w8a8, weight_only

    seen = []
    for mod, name in ((w8a8, "w8a8_matmul"), (weight_only, "weight_only_matmul")):
        real = getattr(mod, name)

        def spy(*a, _real=real, _name=name, **kw):
            seen.append((_name, kw.get("w_layout", "kn")))
            return _real(*a, **kw)

        monkeypatch.setattr(mod, name, spy)
    return seen


@pytest.mark.parametrize("pair", [W8A8, W8G32, FP8], ids=["w8a8", "int8-g32-asym", "fp8"])
def test_decode_layout_gives_int8_kernels_k_major_to_the_kernels(pair, monkeypatch):
    """Where the Pallas kernels run (interpret mode here, native kernels off), a decode loop's int8
    kernels are transposed once and read K-major by the kernels: the same outputs, exactly."""
    from llmeq_jax import decode_layout, native

    params = {"up": {"kernel": _q(pair, (256, 96), 1)}, "down": {"kernel": _q(W4G128, (256, 64), 2)}}
    x = jax.random.normal(jax.random.key(5), (3, 256)).astype(jnp.bfloat16)
    with native.disabled(), config.interpret(True):
        laid = decode_layout.for_decode(params, rows=3)
        assert isinstance(laid["up"]["kernel"], decode_layout.RowMajorKernel)
        assert isinstance(laid["down"]["kernel"], decode_layout.Int4WordKernel)  # packed int4: words instead
        assert decode_layout.for_decode(params, rows=decode_layout.GPU_KMAJOR_MAX_ROWS + 1) is params
        seen = _kmajor_calls(monkeypatch)
        got = ops.linear(x, laid["up"]["kernel"])
        assert [layout for _, layout in seen] == ["nk"]
        want = ops.linear(x, params["up"]["kernel"], backend="pallas")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


W8 = (Spec(bits=8, granularity="channel", symmetric=False), None)


def test_k_major_int8_weight_only_takes_float16_operands_unless_measured_slower(monkeypatch):
    """A decode step's K-major int8 weight-only product with half-precision x and per-channel scales runs with
    float16 operands (pallas_kernels.int8_f16); float32 x keeps x's dtype; a table that measured the float16
    kernel slower than the one it replaces (kernel int8_f16) turns it off for that product."""
    from llmeq_jax import decode_layout, dispatch_table, kernel_dispatch, native
    from pallas_kernels import weight_only

    q = _q(W8, (256, 96), 7)
    seen = []
    real = weight_only.weight_only_matmul

    def spy(*a, **kw):
        seen.append(kw.get("dequant"))
        return real(*a, **kw)

    monkeypatch.setattr(weight_only, "weight_only_matmul", spy)
    x = jax.random.normal(jax.random.key(8), (2, 256)).astype(jnp.bfloat16)
    with native.disabled(), config.interpret(True):
        kmajor = decode_layout.for_decode({"up": {"kernel": q}}, rows=2)["up"]["kernel"]
        got = ops.linear(x, kmajor)
        want = ops.linear(x, q, backend="pallas")  # N-major: x's dtype as operands
        ops.linear(x.astype(jnp.float32), kmajor)
        key = kernel_dispatch.table_key("int8_f16", 2, x.dtype, q, None)
        slower = dispatch_table.from_json(dispatch_table.to_json(key.device, [(key, {"pallas_s": 2.0, "xla_s": 1.0,
                                                                                     "bf16_s": 3.0})], jax="test"))
        with dispatch_table.use(slower):
            ops.linear(x, kmajor)
    assert seen == ["f16", None, None, None]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2,
                               atol=2e-2 * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))


def test_k_major_stack_is_read_a_layer_at_a_time_in_place():
    from llmeq_jax import decode_layout
    from llmeq_jax.layer_slice import LayerSlice

    qs = [_q(W8A8, (128, 64), seed) for seed in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *[decode_layout.transpose_kernel(q) for q in qs])
    x = jax.random.normal(jax.random.key(6), (2, 128))
    with config.interpret(True):
        at = jax.jit(lambda x, s, i: ops.linear(x, LayerSlice(decode_layout.RowMajorKernel(s), i)))
        for i, q in enumerate(qs):
            np.testing.assert_array_equal(np.asarray(at(x, stack, jnp.int32(i))),
                                          np.asarray(ops.linear(x, q, backend="pallas")))


def test_kernels_refuse_k_major_int4_and_unknown_layouts():
    from pallas_kernels import w8a8, weight_only

    q = _q(W4G128, (256, 64))
    with pytest.raises(ValueError, match="K-major int4 bytes"):
        weight_only.weight_only_matmul(jnp.ones((1, 256)), q.qvalue.T, q.scale, bits=4, group=128, w_layout="nk",
                                       interpret=True)
    q8 = _q(W8A8, (64, 32))
    with pytest.raises(ValueError, match="w_layout must be"):
        w8a8.w8a8_matmul(jnp.ones((1, 64)), q8.qvalue, q8.scale, w_layout="kmajor", interpret=True)


# --------------------------------------------------------------------------- int4 words for decode


def _word_calls(monkeypatch):
    from pallas_kernels import int4_words

    seen = []
    real = int4_words.int4_words_matmul
    def spy(*a, **kw):
        seen.append(kw.get("layer"))
        return real(*a, **kw)

    monkeypatch.setattr(int4_words, "int4_words_matmul", spy)
    return seen


W4Z64 = (Spec(bits=4, granularity="group", group_size=64, symmetric=False), None)


def test_decode_layout_gives_int4_weight_only_kernels_words_and_fuses_siblings(monkeypatch):
    """Where the Pallas kernels run, a decode loop's int4 kernels become words read by the word kernel;
    q/k/v become one kernel whose outputs are the three products side by side."""
    from llmeq_jax import decode_layout, native

    params = {"q_proj": {"kernel": _q(W4G128, (320, 96), 1)}, "k_proj": {"kernel": _q(W4G128, (320, 32), 2)},
              "v_proj": {"kernel": _q(W4G128, (320, 32), 3)},
              "down": {"kernel": _q(W4Z64, (256, 48), 4), "bias": jnp.arange(48.0)}}
    x = jax.random.normal(jax.random.key(7), (3, 320)).astype(jnp.bfloat16)
    with native.disabled(), config.interpret(True):
        laid = decode_layout.for_decode(params, rows=3)
        assert set(laid) == {"qkv_proj", "down"}
        fused = laid["qkv_proj"]["kernel"]
        assert isinstance(fused, decode_layout.Int4WordKernel) and fused.shape == (320, 160) and fused.group == 128
        seen = _word_calls(monkeypatch)
        got = ops.linear(x, fused)
        down = ops.linear(x[:, :256], laid["down"]["kernel"], laid["down"]["bias"])
        assert seen == [None, None]
        names = ("q_proj", "k_proj", "v_proj")
        want = jnp.concatenate([ops.linear(x, params[n]["kernel"], backend="xla") for n in names], axis=-1)
        want_down = ops.linear(x[:, :256], params["down"]["kernel"], params["down"]["bias"], backend="xla")
        # XLA's path for the word kernel: the codes packed again, the same product as the original's
        np.testing.assert_array_equal(np.asarray(ops.linear(x, fused, backend="xla")), np.asarray(want))
    for a, b in ((got, want), (down, want_down)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2,
                                   atol=1e-2 * float(jnp.max(jnp.abs(b.astype(jnp.float32)))))


def test_a_table_that_measured_xla_faster_keeps_int4_kernels_packed():
    from llmeq_jax import decode_layout, dispatch_table, native

    q = _q(W4G128, (256, 64), 1)
    key = dispatch.table_key("int4_words", 4, q.dtype, q, 128)
    table = dispatch_table.from_json(dispatch_table.to_json(
        key.device, [(key, {"pallas_s": 2e-5, "xla_s": 1e-5, "bf16_s": 3e-5})]))
    with native.disabled(), config.interpret(True):
        with dispatch_table.use(table):
            assert decode_layout.for_decode({"up": {"kernel": q}}, rows=3)["up"]["kernel"] is q  # bucket 4: measured
            assert isinstance(decode_layout.for_decode({"up": {"kernel": q}}, rows=1)["up"]["kernel"],
                              decode_layout.Int4WordKernel)  # bucket 1: not measured


def test_word_stack_is_read_a_layer_at_a_time_in_place(monkeypatch):
    from llmeq_jax import decode_layout
    from llmeq_jax.layer_slice import LayerSlice

    qs = [_q(W4Z64, (192, 64), seed) for seed in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *[decode_layout.int4_word_kernel(q) for q in qs])
    x = jax.random.normal(jax.random.key(6), (2, 192))
    with config.interpret(True):
        seen = _word_calls(monkeypatch)
        at = jax.jit(lambda x, s, i: ops.linear(x, LayerSlice(s, i)))
        for i, q in enumerate(qs):
            want = ops.linear(x, q, backend="xla")
            np.testing.assert_allclose(np.asarray(at(x, stack, jnp.int32(i))), np.asarray(want), rtol=1e-5, atol=1e-5)
            assert np.asarray(jax.jit(lambda x, s, i: ops.linear(x, LayerSlice(s, i), backend="xla"))(
                x, stack, jnp.int32(i))).shape == (2, 64)
        assert len(seen) == 1 and seen[0] is not None  # traced once, with the layer index


def test_word_kernels_refuse_what_they_cannot_hold():
    from llmeq_jax import decode_layout

    with pytest.raises(ValueError, match="2-D uniform int4 kernel packed along its input dim"):
        decode_layout.int4_word_kernel(_q(W8A8, (64, 32)))
    with config.interpret(True):
        words = decode_layout.int4_word_kernel(_q(W4G128, (256, 32)))
        assert dispatch.linear_words(jnp.ones((1, 256)), words.w, require=False) is not None
        with pytest.raises(dispatch.KernelUnavailable, match="needs a CUDA GPU"), config.interpret(False):
            ops.linear(jnp.ones((1, 256)), words, backend="pallas")


def test_a_prompts_rows_over_words_go_where_the_table_sends_them(monkeypatch):
    """Words at a prompt's rows (past a decode step's 16): the prompt kernel where the table measured it faster than
    XLA's path (half activations), else None -- XLA's path of the packed codes -- even where the decode kernel
    would take the same words at 16 rows; ``require`` takes the prompt kernel (float32: the word kernel)."""
    from llmeq_jax import decode_layout, dispatch_table
    from pallas_kernels import int4_words_prefill

    calls = []
    real = int4_words_prefill.int4_words_prefill
    monkeypatch.setattr(int4_words_prefill, "int4_words_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    q = _q(W4Z64, (192, 64))
    words = decode_layout.int4_word_kernel(q)
    x = jax.random.normal(jax.random.key(7), (40, 192)).astype(jnp.bfloat16)
    device = config.target_device().device_kind
    key = dispatch_table.Key(device, "int4_words_prefill", 4, 64, 192, 64, 64, "bfloat16")
    table = lambda p, x_: dispatch_table.Table(device, {key: {"pallas_s": p, "xla_s": x_, "bf16_s": 1.0}})  # noqa: E731
    want = ops.linear(x, q, backend="xla")
    with config.interpret(True):
        assert dispatch.linear_words(x[:16], words.w) is not None and not calls  # decode rows: the word kernel
        assert dispatch.linear_words(x, words.w) is None  # not measured: XLA's path
        with dispatch_table.use(table(2.0, 1.0)):
            assert dispatch.linear_words(x, words.w) is None and not calls
        with dispatch_table.use(table(1.0, 2.0)):
            got = dispatch.linear_words(x, words.w)
            assert len(calls) == 1 and dispatch.linear_words(x.astype(jnp.float32), words.w) is None
            via_ops = ops.linear(x, words)
        forced = dispatch.linear_words(x, words.w, require=True)
        assert len(calls) == 3
        f32 = dispatch.linear_words(x.astype(jnp.float32), words.w, require=True)  # the word kernel
        assert len(calls) == 3
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    for y in (got, via_ops, forced, f32):
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32), atol=1e-2 * scale)


# --------------------------------------------------------------------------- float kernels read in place


def test_float_stack_goes_to_the_kernel_where_a_table_measured_it_faster():
    from llmeq_jax import dispatch_table
    from llmeq_jax.layer_slice import LayerSlice

    stack = jax.random.normal(jax.random.key(3), (3, 128, 48)).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(4), (2, 128)).astype(jnp.bfloat16)
    key = dispatch_table.Key(jax.devices()[0].device_kind, "float", 16, None, 128, 48, 2, "bfloat16")
    faster = dispatch_table.from_json(dispatch_table.to_json(
        key.device, [(key, {"pallas_s": 1e-6, "xla_s": 2e-6, "bf16_s": 2e-6})]))
    assert dispatch.linear_float(x, stack, jnp.int32(1)) is None  # no kernels here (CPU, not interpret)
    with config.interpret(True):
        assert dispatch.linear_float(x, stack, jnp.int32(1)) is None  # not measured: XLA's slice-and-dot
        with dispatch_table.use(faster):
            y = dispatch.linear_float(x, stack, jnp.int32(1))
            assert y is not None and dispatch.linear_float(x[:1], stack, jnp.int32(1)) is None  # other bucket
            via_ops = ops.linear(x, LayerSlice(stack, jnp.int32(1)))
        forced = ops.linear(x, LayerSlice(stack, jnp.int32(1)), backend="pallas")  # no table needed
        # what the kernel cannot take (mixed dtypes, prefill rows) is XLA's, as float products always were
        assert dispatch.linear_float(x.astype(jnp.float32), stack, jnp.int32(1), force=True) is None
        assert dispatch.linear_float(jnp.ones((17, 128), jnp.bfloat16), stack, jnp.int32(1), force=True) is None
        mixed = ops.linear(x.astype(jnp.float32), LayerSlice(stack, jnp.int32(1)), backend="pallas")
    np.testing.assert_array_equal(np.asarray(mixed), np.asarray(x.astype(jnp.float32) @ stack[1].astype(jnp.float32)))
    want = ops.linear(x, stack[1], backend="xla")
    for got in (y, via_ops, forced):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2,
                                   atol=1e-2 * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))


# A GPU to trace for (config.compiling_for): what a CPU can check of the choices made there without running them.
FAKE_H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")


def test_float_stack_goes_to_the_kernel_on_a_gpu_unless_a_table_measured_xla_faster():
    """Traced for a GPU (no table measured there): the kernel reads the layer from the stack -- XLA would copy
    the layer's slice out for its GEMM every step; a table that measured XLA faster keeps XLA's path."""
    from llmeq_jax import dispatch_table
    from llmeq_jax.layer_slice import LayerSlice

    stack = jax.ShapeDtypeStruct((3, 128, 48), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((1, 128), jnp.bfloat16)
    key = dispatch_table.Key(FAKE_H100.device_kind, "float", 16, None, 128, 48, 1, "bfloat16")
    slower = dispatch_table.from_json(dispatch_table.to_json(
        key.device, [(key, {"pallas_s": 3e-6, "xla_s": 2e-6, "bf16_s": 2e-6})]))
    traced = lambda: str(jax.make_jaxpr(lambda x, w: ops.linear(x, LayerSlice(w, jnp.int32(1))))(x, stack))  # noqa: E731
    with config.compiling_for(FAKE_H100):
        assert config.on_gpu() and config.target_device() is FAKE_H100
        text = traced()
        assert "pallas_call" in text and "dynamic_slice" not in text
        with dispatch_table.use(slower):
            text = traced()
            assert "pallas_call" not in text and "dynamic_slice" in text
    assert not config.on_gpu() and "pallas_call" not in traced()  # outside the block: this CPU again
    with pytest.raises(ValueError, match="compiling_for expects a jax Device"):
        with config.compiling_for("gpu"):
            pass


def test_a_small_product_no_table_measured_decodes_on_its_dequantized_weight_on_a_gpu():
    """Traced for a GPU with no table: a product under MIN_KERNEL_WEIGHTS weights keeps XLA's path, and a decode step
    runs it on the weight dequantized once (decode_layout.for_decode: the float model's path, which XLA's reductions
    over a small product's codes were slower than); a larger one goes to the kernel and the decode layout; a W8A8
    product keeps its codes; in interpret mode on a CPU every product goes to its kernel."""
    from llmeq_jax import decode_layout

    w4 = Spec(bits=4, granularity="group", group_size=128)
    small = jax.eval_shape(lambda: quantize(jnp.zeros((576, 960), jnp.bfloat16), w4))
    large = jax.eval_shape(lambda: quantize(jnp.zeros((4096, 4096)), w4))
    w8 = jax.eval_shape(lambda: quantize(jnp.zeros((576, 960)), Spec(bits=8, granularity="channel")))
    w8a8 = jax.eval_shape(lambda: quantize(jnp.zeros((576, 960)), Spec(bits=8, granularity="channel"),
                                           act_spec=Spec(bits=8, granularity="token")))
    assert 576 * 960 < dispatch.MIN_KERNEL_WEIGHTS <= 4096 * 4096
    with config.compiling_for(FAKE_H100):
        assert not dispatch.kernel_takes("weight_only", 1, jnp.bfloat16, small, 128)
        assert dispatch.kernel_takes("weight_only", 1, jnp.bfloat16, large, 128)
        assert dispatch.dequantized_decode_wins(1, small) and not dispatch.dequantized_decode_wins(1, large)
        laid = jax.eval_shape(lambda p: decode_layout.for_decode(p, rows=1),
                              {"a": {"kernel": small}, "b": {"kernel": large}, "c": {"kernel": w8},
                               "d": {"kernel": w8a8}})
        assert laid["a"]["kernel"].shape == (576, 960) and laid["a"]["kernel"].dtype == jnp.bfloat16  # its dtype
        assert laid["c"]["kernel"].shape == (576, 960) and laid["c"]["kernel"].dtype == jnp.float32
        assert type(laid["b"]["kernel"]).__name__ == "Int4WordKernel"
        assert type(laid["d"]["kernel"]).__name__ == "QArray"  # the activations' quantization is the recipe's
        x = jax.ShapeDtypeStruct((1, 576), jnp.bfloat16)
        assert "pallas_call" not in str(jax.make_jaxpr(lambda x, w: ops.linear(x, w))(x, small))
    with config.interpret(True):
        assert dispatch.kernel_takes("weight_only", 1, jnp.bfloat16, small, 128)
        assert not dispatch.dequantized_decode_wins(1, small)  # no GPU: the codes


def test_a_table_decides_where_a_dequantized_weight_decodes_faster():
    """Where a table measured a decode product, its weight is dequantized for the decode only if the bf16 dot beat
    both the kernel and XLA's path over the codes by DEQUANTIZED_MARGIN (the copy costs its float bytes); the same
    values either way (the float product is XLA's dequantize-then-dot)."""
    from llmeq_jax import decode_layout, dispatch_table

    q = quantize(jax.random.normal(jax.random.key(3), (4096, 4096)).astype(jnp.bfloat16),
                 Spec(bits=4, granularity="group", group_size=128))
    key = dispatch.table_key("int4_words", 1, jnp.bfloat16, q, 128)
    key = dataclasses.replace(key, device=FAKE_H100.device_kind)
    table = lambda bf16: dispatch_table.Table(FAKE_H100.device_kind,  # noqa: E731
                                              {key: {"pallas_s": 1.0, "xla_s": 3.0, "bf16_s": bf16}})
    with config.compiling_for(FAKE_H100):
        with dispatch_table.use(table(0.95)):  # faster, but within the margin: the words
            assert not dispatch.dequantized_decode_wins(1, q)
        with dispatch_table.use(table(0.8)):
            assert dispatch.dequantized_decode_wins(1, q) and not dispatch.dequantized_decode_wins(32, q)
            laid = decode_layout.for_decode({"o_proj": {"kernel": q}}, rows=1)["o_proj"]["kernel"]
    assert isinstance(laid, jax.Array) and laid.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(laid, np.float32), np.asarray(q.dequantize(jnp.bfloat16), np.float32))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_prompts_weight_only_product_no_table_measured_goes_to_xla_on_a_gpu(monkeypatch, bits):
    """Traced for a GPU no table was measured on (nor one of its architecture): a prompt's weight-only product over
    (K, N) codes keeps XLA's path (the kernel ran at 0.27-0.34x bf16 at every prompt size on both GPUs measured),
    a decode step's goes to the kernel; interpret mode on a CPU takes the kernel for both."""
    from llmeq_jax import dispatch_table

    monkeypatch.setenv(dispatch_table.ENV, "none")
    spec = Spec(bits=4, granularity="group", group_size=128) if bits == 4 else Spec(bits=8, granularity="channel")
    w = jax.eval_shape(lambda: quantize(jnp.zeros((4096, 4096)), spec))
    group = 128 if bits == 4 else None
    last = dispatch.WEIGHT_ONLY_PROMPT_ROWS - 1
    with config.compiling_for(FAKE_H100):
        assert dispatch.kernel_takes("weight_only", last, jnp.bfloat16, w, group)
        assert not dispatch.kernel_takes("weight_only", last + 1, jnp.bfloat16, w, group)
        assert not dispatch.kernel_takes("weight_only", 2048, jnp.bfloat16, w, group)
        assert dispatch.kernel_takes("w8a8", 2048, jnp.bfloat16, w, group)  # another kernel: the size rule alone
        prompt = jax.ShapeDtypeStruct((1, 512, 4096), jnp.bfloat16)
        assert "pallas_call" not in str(jax.make_jaxpr(lambda x, w: ops.linear(x, w))(prompt, w))
        step = jax.ShapeDtypeStruct((1, 1, 4096), jnp.bfloat16)
        assert "pallas_call" in str(jax.make_jaxpr(lambda x, w: ops.linear(x, w))(step, w))
    with config.interpret(True):
        assert dispatch.kernel_takes("weight_only", 2048, jnp.bfloat16, w, group)


@pytest.mark.parametrize("bits, group, zero_point", [(4, 128, True), (4, None, False), (8, 64, True)])
def test_a_gpus_small_k_major_product_is_one_reduction_over_the_codes(bits, group, zero_point):
    """Traced for a GPU, a few-row product with a K-major QArray (what for_decode makes of a small int4 product
    there, and the tied head's table) is XLA's multiply-reduce over the codes -- no scan over row chunks, no
    float copy of the weights -- and equals the dequantized product (K = 576: a short last group)."""
    from llmeq_jax import decode_layout

    spec = Spec(bits=bits, granularity="group" if group else "channel", group_size=group, symmetric=not zero_point)
    w = decode_layout.transpose_kernel(quantize(jax.random.normal(jax.random.key(0), (576, 960)), spec))
    x = jax.random.normal(jax.random.key(1), (3, 576))
    want = x @ w.dequantize(jnp.float32).T
    with config.compiling_for(FAKE_H100):
        got = ops.linear_nk_xla(x, w)
        text = str(jax.make_jaxpr(lambda x, w: ops.linear_nk_xla(x, w))(x, w))
    assert "scan" not in text and "while" not in text and "dot_general" not in text
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(want))))
    assert "scan" in str(jax.make_jaxpr(lambda x, w: ops.linear_nk_xla(x, w))(x, w))  # this CPU: the chunked scan


def test_a_grouped_query_models_small_k_and_v_join_q_in_one_kernel_on_a_gpu():
    """Traced for a GPU with no table: k and v projections each under MIN_KERNEL_WEIGHTS (a grouped-query
    model's) would stay XLA's, apart from q; joined with q they are one product the word kernel takes. A group
    too small even joined is dequantized for the decode, and one whose parts are all taken is still fused after
    conversion."""
    from llmeq_jax import decode_layout

    w4 = Spec(bits=4, granularity="group", group_size=128)
    q4 = lambda k, n: jax.eval_shape(lambda: quantize(jnp.zeros((k, n)), w4))  # noqa: E731
    gqa = {"q_proj": {"kernel": q4(4096, 4096)}, "k_proj": {"kernel": q4(4096, 1024)},
           "v_proj": {"kernel": q4(4096, 1024)}}
    tiny = {"q_proj": {"kernel": q4(576, 576)}, "k_proj": {"kernel": q4(576, 192)}, "v_proj": {"kernel": q4(576, 192)}}
    mha = {"q_proj": {"kernel": q4(4096, 4096)}, "k_proj": {"kernel": q4(4096, 4096)},
           "v_proj": {"kernel": q4(4096, 4096)}}
    assert 4096 * 1024 < dispatch.MIN_KERNEL_WEIGHTS <= 4096 * 4096
    with config.compiling_for(FAKE_H100):
        laid = jax.eval_shape(lambda p: decode_layout.for_decode(p, rows=1), {"gqa": gqa, "tiny": tiny, "mha": mha})
    assert set(laid["gqa"]) == {"qkv_proj"} and type(laid["gqa"]["qkv_proj"]["kernel"]).__name__ == "Int4WordKernel"
    assert laid["gqa"]["qkv_proj"]["kernel"].w.shape == (4096, 6144)
    # too small even joined: each dequantized for the decode (the float model's path, three products as its)
    assert set(laid["tiny"]) == {"q_proj", "k_proj", "v_proj"}
    assert [laid["tiny"][n]["kernel"].shape for n in ("q_proj", "k_proj", "v_proj")] == [(576, 576), (576, 192),
                                                                                        (576, 192)]
    assert set(laid["mha"]) == {"qkv_proj"} and laid["mha"]["qkv_proj"]["kernel"].w.shape == (4096, 12288)


def test_a_stacked_norm_goes_to_the_norm_kernel_on_a_gpu_at_decode_rows(monkeypatch):
    """Traced for a GPU: an RMSNorm whose scale is a layer of a stack (a scanned block's) is one kernel reading
    the stack in place -- no slice of it -- at decode rows, where a table measured it faster or, unmeasured, once
    the kernel is turned on (not yet run on a GPU: pallas_kernels.hardware_checked); XLA's norm past 16 rows,
    where a table measured XLA faster, unmeasured by default, and on a CPU (interpret mode included, unless
    forced)."""
    from pallas_kernels import hardware_checked

    from llmeq_jax import dispatch_table
    from llmeq_jax.layer_slice import LayerSlice
    from llmeq_jax.models.layers import RMSNorm
    from pallas_kernels import rms_norm as norm_kernel

    stack = jax.ShapeDtypeStruct((3, 256), jnp.float32)
    norm = RMSNorm(1e-5)

    def traced(rows):
        x = jax.ShapeDtypeStruct((rows, 1, 256), jnp.bfloat16)
        return str(jax.make_jaxpr(lambda x, s: norm.apply({"params": {"scale": LayerSlice(s, jnp.int32(1))}}, x))(
            x, stack))

    key = dispatch_table.Key(FAKE_H100.device_kind, "rms_norm", 32, None, 256, 256, 1, "bfloat16")
    slower = dispatch_table.from_json(dispatch_table.to_json(
        key.device, [(key, {"pallas_s": 3e-6, "xla_s": 2e-6, "bf16_s": 2e-6})]))
    faster = dispatch_table.from_json(dispatch_table.to_json(
        key.device, [(key, {"pallas_s": 1e-6, "xla_s": 2e-6, "bf16_s": 2e-6})]))
    with config.compiling_for(FAKE_H100):
        assert "pallas_call" not in traced(1)  # unmeasured, not yet run on a GPU: XLA's norm
        with dispatch_table.use(faster):
            assert "pallas_call" in traced(1)
    monkeypatch.setenv(hardware_checked.ENV, "rms_norm")
    with config.compiling_for(FAKE_H100):
        text = traced(1)
        assert "pallas_call" in text and "dynamic_slice" not in text
        assert "pallas_call" not in traced(17) and "dynamic_slice" in traced(17)
        with dispatch_table.use(slower):
            assert "pallas_call" not in traced(1)
    assert "pallas_call" not in traced(1)
    with config.interpret(True):
        assert "pallas_call" not in traced(1)
        x = jax.random.normal(jax.random.key(0), (2, 1, 256)).astype(jnp.bfloat16)
        s = jax.random.uniform(jax.random.key(1), (3, 256))
        forced = dispatch.rms_norm(x, s, 1e-5, layer=jnp.int32(1), force=True)
        want = norm.apply({"params": {"scale": LayerSlice(s, jnp.int32(1))}}, x)  # XLA's norm of the slice
        np.testing.assert_allclose(np.asarray(forced, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
        np.testing.assert_array_equal(np.asarray(want), np.asarray(norm_kernel.rms_norm_reference(x, s[1], 1e-5)))


def test_the_dispatch_table_read_is_part_of_the_kernel_state(tmp_path, monkeypatch):
    """A decode step traced under one table is not reused under another: each use() block, and the file
    $LLMEQ_DISPATCH_TABLE names (and its modification time), give the jitted steps another static key."""
    import os

    from llmeq_jax import dispatch_table
    from llmeq_jax.generate import kernel_state

    monkeypatch.delenv(dispatch_table.ENV, raising=False)
    key = dispatch_table.Key(FAKE_H100.device_kind, "float", 16, None, 128, 48, 1, "bfloat16")
    table = dispatch_table.from_json(dispatch_table.to_json(key.device, [(key, {"pallas_s": 1.0, "xla_s": 2.0,
                                                                                 "bf16_s": 2.0})]))
    outside = kernel_state()
    with dispatch_table.use(table):
        first = kernel_state()
        hash(first)
    with dispatch_table.use(table):
        second = kernel_state()
    assert len({outside, first, second}) == 3 and kernel_state() == outside
    path = tmp_path / "table.json"
    path.write_text(json.dumps(dispatch_table.to_json(key.device, [(key, {"pallas_s": 1.0, "xla_s": 2.0,
                                                                          "bf16_s": 2.0})])))
    monkeypatch.setenv(dispatch_table.ENV, str(path))
    named = kernel_state()
    os.utime(path, (1, 1))  # the file rewritten: another table
    assert named != outside and kernel_state() != named


@pytest.mark.parametrize("spec,kernel", [(W8A8, "w8a8_hopper"), (FP8_W8A8, "fp8_w8a8_hopper")])
def test_a_prompts_w8a8_product_goes_to_the_hopper_kernel_only_where_a_table_measured_it_faster(monkeypatch, spec,
                                                                                               kernel):
    """K-major int8 or FP8 W8A8 weights at a prompt's rows: the Triton kernel unless the table measured the Mosaic
    GPU kernel (``w8a8_hopper`` / ``fp8_w8a8_hopper``, each its own key) faster than it; decode rows never; both give
    the reference's bits."""
    from llmeq_jax import decode_layout, dispatch_table
    from pallas_kernels import w8a8, w8a8_hopper

    calls = []
    for mod, name in ((w8a8, "w8a8_matmul"), (w8a8_hopper, "w8a8_hopper")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    q = _q(spec, (256, 256), 3)
    with config.interpret(True):  # a prompt's layout (FP8's plan needs an sm_89+ device, or interpret mode)
        kmajor = decode_layout.w8a8_kmajor({"up": {"kernel": q}})["up"]["kernel"]
    assert isinstance(kmajor, decode_layout.RowMajorKernel)
    x = jax.random.normal(jax.random.key(8), (40, 256)).astype(jnp.bfloat16)
    device = config.target_device().device_kind
    other = {"w8a8_hopper": "fp8_w8a8_hopper", "fp8_w8a8_hopper": "w8a8_hopper"}[kernel]
    with config.interpret(True), dispatch_table.use(dispatch_table.Table(device, {  # the other grid's verdict
            dispatch_table.Key(device, other, 8, None, 256, 256, 64, "bfloat16"): {"pallas_s": 1.0, "xla_s": 2.0,
                                                                                   "bf16_s": 1.0}})):
        ops.linear(x, kmajor)
        assert calls == ["w8a8_matmul"]
    calls.clear()
    key = dispatch_table.Key(device, kernel, 8, None, 256, 256, 64, "bfloat16")
    table = lambda p, x_: dispatch_table.Table(device, {key: {"pallas_s": p, "xla_s": x_, "bf16_s": 1.0}})  # noqa: E731
    with config.interpret(True):
        triton = ops.linear(x, kmajor)
        assert calls == ["w8a8_matmul"]  # not measured
        with dispatch_table.use(table(2.0, 1.0)):
            ops.linear(x, kmajor)
            assert calls[-1] == "w8a8_matmul"
        with dispatch_table.use(table(1.0, 2.0)):
            hopper = ops.linear(x, kmajor)
            assert calls[-1] == "w8a8_hopper"
            ops.linear(x[:16], kmajor)  # decode rows: the Triton kernel
            assert calls[-1] == "w8a8_matmul"
    np.testing.assert_array_equal(np.asarray(hopper, np.float32), np.asarray(triton, np.float32))


@pytest.mark.parametrize("spec,bits,group", [(W8, 8, None), (W4G128, 4, 128)])
def test_a_prompts_weight_only_product_goes_to_the_hopper_kernel_only_where_a_table_measured_it_faster(
        monkeypatch, spec, bits, group):
    """int8 or int4-pair weight-only (K, N) codes at a prompt's rows: the path they took before unless the table
    measured the Mosaic GPU kernel (``weight_only_hopper``) faster than XLA's; decode rows never; its product is the
    dequantized one's within a rounding."""
    from llmeq_jax import dispatch_table, native
    from pallas_kernels import weight_only, weight_only_hopper

    calls = []
    for mod, name in ((weight_only, "weight_only_matmul"), (weight_only_hopper, "weight_only_hopper")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    q = _q(spec, (256, 256), 3)
    x = jax.random.normal(jax.random.key(8), (40, 256)).astype(jnp.bfloat16)
    device = config.target_device().device_kind
    key = dispatch_table.Key(device, "weight_only_hopper", bits, group, 256, 256, 64, "bfloat16")
    table = lambda p, x_: dispatch_table.Table(device, {key: {"pallas_s": p, "xla_s": x_, "bf16_s": 1.0}})  # noqa: E731
    with native.disabled(), config.interpret(True):
        ops.linear(x, q)
        assert "weight_only_hopper" not in calls  # not measured
        with dispatch_table.use(table(2.0, 1.0)):
            ops.linear(x, q)
            assert "weight_only_hopper" not in calls
        with dispatch_table.use(table(1.0, 2.0)):
            hopper = ops.linear(x, q)
            assert calls[-1] == "weight_only_hopper"
            ops.linear(x[:16], q)  # decode rows: never this kernel
            assert calls.count("weight_only_hopper") == 1
    want = np.asarray(x, np.float32) @ np.asarray(q.dequantize(jnp.float32))
    np.testing.assert_allclose(np.asarray(hopper, np.float32), want, rtol=0.02, atol=0.05)


def test_a_prompt_layout_keeps_packed_int4_codes_where_the_hopper_kernel_beat_the_words():
    """A table that measured the prompt kernel over words faster than XLA's path lays int4 kernels out as words for
    prompts, unless it measured the Mosaic GPU kernel over the packed codes faster than both for the same product."""
    from llmeq_jax import decode_layout, dispatch_table

    q = quantize((jax.random.normal(jax.random.key(5), (256, 256)) * 0.1).astype(jnp.bfloat16), W4G128[0])
    device = config.target_device().device_kind
    key = lambda kernel: dispatch_table.Key(device, kernel, 4, 128, 256, 256, 2048, "bfloat16")  # noqa: E731
    words = {key("int4_words_prefill"): {"pallas_s": 1.0, "xla_s": 2.0, "bf16_s": 1.0}}

    def laid_as_words(hopper_s):
        hopper = {} if hopper_s is None else {key("weight_only_hopper"): {"pallas_s": hopper_s, "xla_s": 2.0,
                                                                          "bf16_s": 1.0}}
        with config.interpret(True), dispatch_table.use(dispatch_table.Table(device, {**words, **hopper})):
            laid = decode_layout.words_for_prompts({"up": {"kernel": q}})["up"]["kernel"]
        return isinstance(laid, decode_layout.Int4WordKernel)

    assert laid_as_words(None) and laid_as_words(1.5)  # no hopper entry; the hopper kernel slower than the words
    assert not laid_as_words(0.5)  # faster than both: the packed codes stay, for it


def test_a_decode_layout_stores_int4_rows_for_the_hopper_kernel_only_where_a_table_measured_it_faster(monkeypatch):
    """A decode step's int4 weight-only products go to the word kernel unless the table measured the Mosaic GPU decode
    kernel (``decode_hopper``) faster than the path it replaces: then the decode layout stores the fused q/k/v
    kernel as (out, in) int4 rows (``Int4RowKernel``), ``ops.linear`` hands them to that kernel -- a stacked layer read
    in place -- and XLA's path of the packed codes gives the same product."""
    from llmeq_jax import decode_layout, dispatch_table, native
    from llmeq_jax.layer_slice import LayerSlice
    from pallas_kernels import decode_hopper

    calls = []
    real = decode_hopper.decode_hopper
    monkeypatch.setattr(decode_hopper, "decode_hopper",
                        lambda *a, **k: calls.append(k.get("layer") is not None) or real(*a, **k))
    spec = Spec(bits=4, granularity="group", group_size=128, symmetric=False)

    def qkv(seed):
        return {name: {"kernel": quantize((jax.random.normal(jax.random.key(seed + i), (512, 128)) * 0.1).astype(
            jnp.bfloat16), spec)} for i, name in enumerate(("q_proj", "k_proj", "v_proj"))}

    params = qkv(0)
    device = config.target_device().device_kind
    key = dispatch_table.Key(device, "decode_hopper", 4, 128, 512, 384, dispatch_table.row_bucket(2), "bfloat16")
    table = lambda p: dispatch_table.Table(device, {key: {"pallas_s": p, "xla_s": 1.0, "bf16_s": 1.0}})  # noqa: E731
    x = jax.random.normal(jax.random.key(9), (2, 512)).astype(jnp.bfloat16)
    with native.disabled(), config.interpret(True):
        for measured in (None, table(2.0)):  # unmeasured; slower than the path it replaces
            with dispatch_table.use(measured) if measured else dispatch_table.use(dispatch_table.Table(device, {})):
                laid = decode_layout.for_decode(params, rows=2)
            assert isinstance(laid["qkv_proj"]["kernel"], decode_layout.Int4WordKernel)
        with dispatch_table.use(table(0.5)):
            laid = decode_layout.for_decode(params, rows=2)
            other = decode_layout.for_decode(qkv(3), rows=2)
        rows = laid["qkv_proj"]["kernel"]
        stack = jax.tree.map(lambda a, b: jnp.stack([a, b]), other["qkv_proj"]["kernel"], rows)  # layer 1: rows
        assert isinstance(rows, decode_layout.Int4RowKernel) and rows.w.qvalue.dtype == jnp.int4
        assert rows.w.qvalue.shape == (384, 512) and rows.shape == (512, 384)
        got = ops.linear(x, rows)
        in_place = ops.linear(x, LayerSlice(stack, jnp.int32(1)))
        assert calls == [False, True]
        xla = ops.linear(x, rows.packed(), backend="xla")
    joined = decode_layout.stack_quantized([params[n]["kernel"] for n in ("q_proj", "k_proj", "v_proj")], axis=1)
    np.testing.assert_array_equal(np.asarray(rows.packed().qvalue), np.asarray(joined.qvalue))
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    for y in (got, in_place):
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(xla, np.float32), rtol=4 * eps, atol=0.02)


def test_a_decode_steps_k_major_int8_product_goes_to_the_hopper_kernel_only_where_a_table_measured_it_faster(
        monkeypatch):
    """rtn-w8's decode layout (K-major int8, ``RowMajorKernel``) stays on the Triton kernels unless the table measured
    the Mosaic GPU decode kernel (``decode_hopper``, 8 bits) faster than the path it replaces; then a decode step's
    product goes to it (its layer read in place from a stack) -- XLA's product within a rounding -- and a prompt's
    rows never do."""
    from llmeq_jax import decode_layout, dispatch_table, native
    from llmeq_jax.layer_slice import LayerSlice
    from pallas_kernels import decode_hopper

    calls = []
    real = decode_hopper.decode_hopper
    monkeypatch.setattr(decode_hopper, "decode_hopper",
                        lambda *a, **k: calls.append(k.get("layer") is not None) or real(*a, **k))
    q = _q(W8, (256, 128), 7)
    x = jax.random.normal(jax.random.key(8), (2, 256)).astype(jnp.bfloat16)
    device = config.target_device().device_kind
    key = dispatch_table.Key(device, "decode_hopper", 8, None, 256, 128, dispatch_table.row_bucket(2), "bfloat16")
    table = lambda p: dispatch_table.Table(device, {key: {"pallas_s": p, "xla_s": 1.0, "bf16_s": 1.0}})  # noqa: E731
    with native.disabled(), config.interpret(True):
        kmajor = decode_layout.for_decode({"up": {"kernel": q}}, rows=2)["up"]["kernel"]
        assert isinstance(kmajor, decode_layout.RowMajorKernel)
        ops.linear(x, kmajor)
        with dispatch_table.use(table(2.0)):
            ops.linear(x, kmajor)
        assert calls == []  # unmeasured; measured slower
        with dispatch_table.use(table(0.5)):
            got = ops.linear(x, kmajor)
            stack = jax.tree.map(lambda a: jnp.stack([a, a]), kmajor)
            in_place = ops.linear(x, LayerSlice(stack, jnp.int32(1)))
            ops.linear(jnp.zeros((40, 256), jnp.bfloat16), kmajor)  # a prompt's rows: not this kernel
        assert calls == [False, True]
    want = ops.linear(x, q, backend="xla")
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    for y in (got, in_place):
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32), rtol=4 * eps, atol=0.02)


@pytest.mark.parametrize("spec,kernel", [(W8A8, "w8a8_decode_hopper"), (FP8_W8A8, "fp8_w8a8_decode_hopper")])
def test_a_decode_steps_w8a8_product_goes_to_the_hopper_kernel_only_where_a_table_measured_it_faster(
        monkeypatch, spec, kernel):
    """A W8A8 decode layout (K-major int8 / E4M3 codes) stays on the Triton W8A8 kernel unless the table measured the
    Mosaic GPU decode kernel (``w8a8_decode_hopper`` / ``fp8_w8a8_decode_hopper``, each its own key) faster than the
    path it replaces; then a decode step's product goes to it (a stack's layer read in place) with the Triton
    kernel's values, and a prompt's rows never do. Measured so, a table that found XLA faster than the Triton kernel
    no longer keeps the codes ``(in, out)``."""
    from llmeq_jax import decode_layout, dispatch_table, native
    from llmeq_jax.layer_slice import LayerSlice
    from pallas_kernels import decode_hopper

    calls = []
    real = decode_hopper.w8a8_decode_hopper
    monkeypatch.setattr(decode_hopper, "w8a8_decode_hopper",
                        lambda *a, **k: calls.append((k["fp8"], k.get("layer") is not None)) or real(*a, **k))
    # a bf16 model's kernel: the layout looks its products up under the model's dtype
    q = quantize((jax.random.normal(jax.random.key(7), (256, 128)) * 0.1).astype(jnp.bfloat16), spec[0],
                 act_spec=spec[1])
    assert q.dtype == jnp.bfloat16
    x = jax.random.normal(jax.random.key(8), (2, 256)).astype(jnp.bfloat16)
    device = config.target_device().device_kind
    bucket = dispatch_table.row_bucket(2)
    key = dispatch_table.Key(device, kernel, 8, None, 256, 128, bucket, "bfloat16")
    nk = dispatch_table.Key(device, "fp8_w8a8_nk" if kernel.startswith("fp8") else "w8a8_nk", 8, None, 256, 128,
                            bucket, "bfloat16")
    slower = {"pallas_s": 2.0, "xla_s": 1.0, "bf16_s": 1.0}
    table = lambda p: dispatch_table.Table(device, {key: {"pallas_s": p, "xla_s": 1.0, "bf16_s": 1.0}})  # noqa: E731
    with native.disabled(), config.interpret(True):
        kmajor = decode_layout.for_decode({"up": {"kernel": q}}, rows=2)["up"]["kernel"]
        assert isinstance(kmajor, decode_layout.RowMajorKernel)
        triton = ops.linear(x, kmajor)
        with dispatch_table.use(table(2.0)):
            ops.linear(x, kmajor)
        assert calls == []  # unmeasured; measured slower
        with dispatch_table.use(dispatch_table.Table(device, {nk: slower})):  # XLA beat the Triton kernel
            assert not isinstance(decode_layout.for_decode({"up": {"kernel": q}}, rows=2)["up"]["kernel"],
                                  decode_layout.RowMajorKernel)
        with dispatch_table.use(dispatch_table.Table(device, {nk: slower, key: table(0.5).entries[key]})):
            assert isinstance(decode_layout.for_decode({"up": {"kernel": q}}, rows=2)["up"]["kernel"],
                              decode_layout.RowMajorKernel)
            got = ops.linear(x, kmajor)
            stack = jax.tree.map(lambda a: jnp.stack([a, a]), kmajor)
            in_place = ops.linear(x, LayerSlice(stack, jnp.int32(1)))
            ops.linear(jnp.zeros((40, 256), jnp.bfloat16), kmajor)  # a prompt's rows: not this kernel
    fp8 = kernel.startswith("fp8")
    assert calls == [(fp8, False), (fp8, True)]
    for y in (got, in_place):
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(triton, np.float32))
