"""A GPU's decode, traced for a GPU (``pallas_kernels.config.compiling_for``) and run on this CPU with the Pallas
kernels in interpret mode: the float cache's attention kernel, the norm kernels, the stacked float kernels and the
K-major reductions XLA takes for small int4 products there -- the CPU's XLA decode's logits, step by step."""

from __future__ import annotations

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import generate as gen
from llmeq_jax import native, pipeline
from llmeq_jax.models import ModelConfig, forward_step, init_cache, init_params, stacked
from pallas_kernels import config as kernel_config

# what a GPU traces with the kernels not yet run on one turned on (pallas_kernels.hardware_checked), as the GPU
# session's end-to-end runs turn them on
pytestmark = pytest.mark.usefixtures("unchecked_kernels")
FAKE_H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
CONFIG = ModelConfig("llama", 256, 256, 2, 8, 2, 32, 512, 1e-5, 128, False)  # grouped-query: 8 heads over 2
GPT2 = ModelConfig("gpt2", 256, 256, 2, 4, 4, 64, 512, 1e-5, 128, True, act="gelu_tanh")  # LayerNorm, no RoPE
PROMPT = 5


def _logits(params, tokens, config=CONFIG):
    """The prompt's last logits, then each teacher-forced decode step's (decode layout as generate makes it)."""
    step = lambda p, t, m, c: forward_step(config, p, t, m, c)  # noqa: E731  a fresh function: traced here
    b = tokens.shape[0]
    cache = init_cache(config, b, tokens.shape[1] + 2, jnp.bfloat16)
    logits, cache = jax.jit(step)(params, tokens[:, :PROMPT], jnp.ones((b, PROMPT), jnp.int32), cache)
    outs, laid, decode = [logits[:, -1]], gen.decode_params(params, b), jax.jit(step)
    for i in range(PROMPT, tokens.shape[1]):
        logits, cache = decode(laid, tokens[:, i : i + 1], jnp.ones((b, 1), jnp.int32), cache)
        outs.append(logits[:, 0])
    step_jaxpr = str(jax.make_jaxpr(step)(laid, tokens[:, :1], jnp.ones((b, 1), jnp.int32), cache))
    kernels = jax.tree.leaves(laid[stacked.BLOCKS], is_leaf=lambda a: hasattr(a, "w") or type(a).__name__ == "QArray")
    kinds = {type(a).__name__ for a in kernels} - {"ArrayImpl"}  # the blocks' quantized kernels' layouts
    return jnp.stack(outs, 1).astype(jnp.float32), step_jaxpr, kinds


@pytest.mark.parametrize("recipe", ["bf16", "rtn-w4-g128", "rtn-w4-g128 codes"])
def test_a_gpus_decode_in_interpret_mode_follows_the_cpus(recipe, monkeypatch):
    """Every product here is under MIN_KERNEL_WEIGHTS: a quantized model's decode runs on its weights dequantized once
    (``kernel_dispatch.dequantized_decode_wins``), the bf16 model's path; "codes": where a table said otherwise, XLA's
    reductions over the codes, stored K-major."""
    from llmeq_jax import kernel_dispatch

    config = CONFIG
    if recipe.endswith("codes"):
        monkeypatch.setattr(kernel_dispatch, "dequantized_decode_wins", lambda rows, w: False)
        config = dataclasses.replace(CONFIG, intermediate_size=320)  # shapes of its own: generate's layout is cached
    params = jax.tree.map(lambda a: (a * 4).astype(jnp.bfloat16), init_params(config, jax.random.key(0)))
    if recipe != "bf16":
        params = pipeline.run_recipe(config, params, None, pipeline.read_recipe("rtn-w4-g128"), None, 16,
                                     progress=False).params
    codes = recipe.endswith("codes")
    params = stacked.stack_blocks(config, params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, PROMPT + 4)))
    with native.disabled(), kernel_config.disabled():
        want, xla_step, _ = _logits(params, tokens, config)
    with native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True):
        got, step, kinds = _logits(params, tokens, config)
    assert "pallas_call" not in xla_step
    # the float kernels fold both norms into their products (pallas_kernels.norm_fold); XLA's reductions over int4
    # codes cannot, and the norm kernel takes those norms
    assert step.count("name=append_decode_attention") == 1
    assert step.count("name=rms_norm") == (2 if codes else 0)
    if codes:  # K-major for XLA's one reduction over the codes
        assert kinds == {"RowMajorKernel"} and "int4_words" not in step and "float_matmul" not in step
    else:
        assert step.count("name=float_matmul") >= 4 and not kinds  # no quantized layout left in the decode's blocks
    # bf16 activations through other kernels' accumulation orders: ~1 % of the logits' scale (seen: 0.16-0.34 of
    # 21); a wrong slot, mask, norm or layer moves them by far more. Dequantized weights also round each value to
    # bf16 once, where XLA's decode over the codes keeps its products in float32: seen 0.95 of 24 here, and 1.03
    # between XLA's own decodes over the codes and over the dequantized weights (two layers of x4 weights)
    scale = float(jnp.max(jnp.abs(want)))
    tolerance = 0.06 if recipe == "rtn-w4-g128" else 0.03
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tolerance * scale)
    assert float(jnp.max(jnp.abs(got[:, 1:] - got[:, :-1]))) > 0.2 * scale  # the steps differ: something to follow


@pytest.mark.parametrize("recipe", ["bf16", "rtn-w4-g128"])
def test_a_gpus_decode_folds_its_norms_into_the_products_after_them(recipe, monkeypatch):
    """Both norms of a layer folded into the q/k/v and gate/up products (``pallas_kernels.norm_fold``), and every
    product's split sums and residual add finished by its kernel (``pallas_kernels.split_fixup``): no norm
    launch in the step, the products the same kernels as with the norms apart (``settings`` ``norm=apart``), the
    logits within bf16 rounding of the CPU's XLA decode -- and for bf16 weights closer to the float32 model's than
    with the norms apart: the fold rounds ``x * scale``, here an exact product (the norms' scales are 4), where the
    norm rounds its output. (The quantized model's activations follow its bf16 token table either way, so XLA's
    bf16 rounding is its reference; tests/pallas_kernels/test_norm_fold.py compares the kernels with float32.) The
    int4 products are taken by the word kernel here (MIN_KERNEL_WEIGHTS lowered: small products are XLA's)."""
    from llmeq_jax import kernel_dispatch
    from pallas_kernels import settings

    monkeypatch.setattr(kernel_dispatch, "MIN_KERNEL_WEIGHTS", 0)
    # shapes of its own: generate's jitted layout, traced for these shapes before with the usual floor, would be reused
    config = dataclasses.replace(CONFIG, intermediate_size=384)
    params = jax.tree.map(lambda a: (a * 4).astype(jnp.bfloat16), init_params(config, jax.random.key(5)))
    if recipe != "bf16":
        params = pipeline.run_recipe(config, params, None, pipeline.read_recipe(recipe), None, 16,
                                     progress=False).params
    wide = stacked.stack_blocks(config, jax.tree.map(lambda a: a.astype(jnp.float32), params)) if recipe == "bf16" \
        else None
    params = stacked.stack_blocks(config, params)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, config.vocab_size, (2, PROMPT + 2)))
    kernel, products = {"bf16": ("float_matmul", "name=float_matmul"),
                        "rtn-w4-g128": ("int4_words", "name=int4_words_matmul")}[recipe]
    with native.disabled(), kernel_config.disabled():
        want, _, _ = _logits(params, tokens, config)
        truth = want if wide is None else _logits(wide, tokens, config)[0]
    with native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True):
        # two K splits everywhere (K of 256-384 would be one): what a 7B model's products have
        with settings.override(kernel, k_splits=2):
            folded, step, _ = _logits(params, tokens, config)
        with settings.override(kernel, k_splits=2, norm="apart"):
            apart, apart_step, _ = _logits(params, tokens, config)
        if recipe != "bf16":  # split sums and residuals after the kernels; the gate/up words paired
            with settings.override(kernel, k_splits=2, reduce="xla"):
                summed, summed_step, _ = _logits(params, tokens, config)
            assert gen.decode_params(params, 2)[stacked.BLOCKS]["mlp"]["gate_up_proj"]["kernel"].paired
    assert step.count("name=rms_norm") == 0 and apart_step.count("name=rms_norm") == 2
    assert step.count(products) == apart_step.count(products) >= 2  # q/k/v and gate/up at least
    # pallas_kernels.split_fixup: every product of a layer (bf16: q, k, v, o, gate, up, down; the words: q/k/v,
    # o, gate/up, down) finishes its own sum, the scan's counters updated in place (besides the attention kernel's
    # cache, the one aliased launch with reduce=xla)
    products_a_layer = {"bf16": 7, "rtn-w4-g128": 4}[recipe]
    aliased = lambda jaxpr: jaxpr.count("input_output_aliases=((")  # noqa: E731
    assert aliased(step) == 1 + products_a_layer
    if recipe != "bf16":
        assert aliased(summed_step) == 1
        np.testing.assert_allclose(np.asarray(folded), np.asarray(summed), atol=0.05 * float(jnp.max(jnp.abs(want))))
    # bf16 through two layers of x4 weights: XLA's own logits were up to 8 % of their scale from the float32
    # model's (a wrong scale, layer or norm factor moves them by far more)
    np.testing.assert_allclose(np.asarray(folded), np.asarray(want), atol=0.1 * float(jnp.max(jnp.abs(want))))
    assert not np.array_equal(np.asarray(folded), np.asarray(apart))  # another rounding: the fold did run
    if wide is not None:
        rms = lambda a: float(jnp.sqrt(jnp.mean(jnp.square(a - truth))))  # noqa: E731
        assert rms(folded) <= 1.1 * rms(apart), (rms(folded), rms(apart))  # seen: 0.14 vs 0.19


def _quantized_model(recipe: str, intermediate: int, seed: int):
    """(config, stacked params, tokens) of a two-layer model of x4 weights quantized by ``recipe``, with an
    intermediate size of its own: generate's jitted layout, traced for other shapes, is not reused."""
    config = dataclasses.replace(CONFIG, intermediate_size=intermediate)
    params = jax.tree.map(lambda a: (a * 4).astype(jnp.bfloat16), init_params(config, jax.random.key(seed)))
    params = pipeline.run_recipe(config, params, None, pipeline.read_recipe(recipe), None, 16, progress=False).params
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, (2, PROMPT + 2)))
    return config, stacked.stack_blocks(config, params), tokens


def _spied(monkeypatch, module, name: str, record):
    """The list that ``record(kwargs)`` of every call of ``module.name`` is appended to (the call goes on)."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(record(kw)) or real(*a, **kw))
    return calls


def _decodes(params, tokens, config, launches: list, kernel: str, **setting):
    """XLA's decode on this CPU, then the decode traced for an H100 (the kernels in interpret mode) as it is and under
    ``kernel``'s ``setting``: (XLA's logits, (logits, step jaxpr, layouts), the ``launches`` recorded by then,
    (logits, step jaxpr) under the setting)."""
    from pallas_kernels import settings

    with native.disabled(), kernel_config.disabled():
        want = _logits(params, tokens, config)[0]
    with native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True):
        first = _logits(params, tokens, config)
        first_launches = set(launches)
        with settings.override(kernel, **setting):
            other = _logits(params, tokens, config)[:2]
    return want, first, first_launches, other


def test_a_gpus_int8_decode_folds_its_norms_into_the_float16_operand_kernel(monkeypatch):
    """rtn-w8's decode (K-major int8 codes, ``pallas_kernels.int8_f16``) traced for an H100: both norms of a layer
    folded into its q/k/v and gate/up products -- no norm launch, the same products as with the norms apart
    (``int8_f16:norm=apart``: the norm kernel twice) -- the gate/up rows paired and gated by the kernel
    (``decode_layout.pair_swiglu``), and the logits within bf16 rounding of the CPU's XLA decode.
    (MIN_KERNEL_WEIGHTS lowered: small products are XLA's.)"""
    from llmeq_jax import kernel_dispatch
    from pallas_kernels import int8_f16

    monkeypatch.setattr(kernel_dispatch, "MIN_KERNEL_WEIGHTS", 0)
    launches = _spied(monkeypatch, int8_f16, "int8_f16_matmul", lambda kw: (kw.get("norm") is not None, kw.get("act")))
    config, params, tokens = _quantized_model("rtn-w8", 448, 6)
    want, (folded, step, kinds), folded_launches, (apart, apart_step) = _decodes(
        params, tokens, config, launches, "int8_f16", norm="apart")
    with native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True):
        assert gen.decode_params(params, 2)[stacked.BLOCKS]["mlp"]["gate_up_proj"]["kernel"].paired
    products = "name=weight_only_int8_f16_matmul"
    assert kinds == {"RowMajorKernel"}
    # q/k/v folded, gate/up folded and gated, o and down neither (their residuals added by the kernel)
    assert folded_launches == {(True, None), (True, "swiglu"), (False, None)}
    assert (False, "swiglu") in set(launches) - folded_launches  # norms apart: gated all the same
    assert step.count("name=rms_norm") == 0 and apart_step.count("name=rms_norm") == 2
    assert step.count(products) == apart_step.count(products) >= 2  # q/k/v and gate/up at least
    # bf16 through two layers of x4 weights, as the fold test: seen 0.52 (folded) and 0.22 (apart) of 22 -- the norms
    # apart round where XLA's decode does; against float32 the fold is as close (tests/pallas_kernels/test_norm_fold.py)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(folded), np.asarray(want), atol=0.1 * scale)
    np.testing.assert_allclose(np.asarray(apart), np.asarray(want), atol=0.1 * scale)
    assert not np.array_equal(np.asarray(folded), np.asarray(apart))  # another rounding: the fold did run


@pytest.mark.parametrize("recipe", ["rtn-w8a8", "fp8-w8a8"])
def test_a_gpus_w8a8_decode_makes_its_activation_codes_in_one_kernel(monkeypatch, recipe):
    """rtn-w8a8's (int8) and fp8-w8a8's (E4M3) decode traced for an H100: each product's activations quantized per
    token by ``pallas_kernels.token_codes`` (the norms before q/k/v and gate/up folded into it: no norm launch), the
    residual adds in the W8A8 kernels, the gate/up rows paired and gated by the W8A8 kernel -- and the logits within
    the codes' rounding of the CPU's XLA decode; with ``w8a8:codes=xla``, XLA quantizes as before (the kernel still
    gates). (MIN_KERNEL_WEIGHTS lowered: small products are XLA's.)"""
    from llmeq_jax import kernel_dispatch
    from pallas_kernels import w8a8

    monkeypatch.setattr(kernel_dispatch, "MIN_KERNEL_WEIGHTS", 0)
    launches = _spied(monkeypatch, w8a8, "w8a8_matmul",
                      lambda kw: (kw.get("codes") is not None, kw.get("residual") is not None, kw.get("fp8", False),
                                  kw.get("act")))
    fp8 = recipe.startswith("fp8")
    config, params, tokens = _quantized_model(recipe, 416, 7)
    want, (got, step, kinds), coded_launches, (xla_codes, xla_step) = _decodes(
        params, tokens, config, launches, "w8a8", codes="xla")
    assert kinds == {"RowMajorKernel"}
    # o and down add the residual themselves where the codes kernel quantizes the stream after them; with XLA's
    # codes the adds stay XLA's (fused with its quantization of the stream)
    assert coded_launches == {(True, False, fp8, None), (True, True, fp8, None), (True, False, fp8, "swiglu")}
    assert set(launches) - coded_launches == {(False, False, fp8, None), (False, False, fp8, "swiglu")}
    assert step.count("name=token_codes") == 4 and xla_step.count("name=token_codes") == 0  # q/k/v, o, gate/up, down
    assert step.count("name=w8a8_matmul") == xla_step.count("name=w8a8_matmul") == 4
    assert step.count("name=rms_norm") == 0
    # the quantized model's logits follow its activation codes: a code one step off (the norm's sum in another
    # order) moves them by what a code's step is worth, well inside what a wrong norm, scale or layer would. An E4M3
    # step is 6-12 % of the value where an int8 one is under 1 % of the row's absmax: seen (largest, mean) 0.69,
    # 0.13 (int8) and 2.02, 0.35 (E4M3; XLA's codes in the same trace 1.54, 0.22) of logits up to 20
    scale, atol = float(jnp.max(jnp.abs(want))), 0.15 if fp8 else 0.1
    for logits in (got, xla_codes):
        np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=atol * scale)
        assert float(jnp.mean(jnp.abs(logits - want))) <= (0.03 if fp8 else 0.015) * scale


def test_gpt2s_decode_takes_the_attention_kernel_too():
    """GPT-2 (LayerNorm, learned positions, multi-head) through the same float cache's attention kernel."""
    params = stacked.stack_blocks(GPT2, jax.tree.map(lambda a: (a * 4).astype(jnp.bfloat16),
                                                     init_params(GPT2, jax.random.key(1))))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, GPT2.vocab_size, (2, PROMPT + 3)))
    with native.disabled(), kernel_config.disabled():
        want, _, _ = _logits(params, tokens, GPT2)
    with native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True):
        got, step, _ = _logits(params, tokens, GPT2)
    assert step.count("name=append_decode_attention") == 1
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.03 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("cache", ["none", "float", "int8"])
def test_a_gpus_prompt_attends_through_cudnn(cache, cudnn_as_xla, monkeypatch):
    """A prompt traced for a GPU attends through cuDNN's flash attention (computed here by the fake in conftest) in
    every layer: without a cache (the models' forward), into a float cache and into an int8 one (the dequantized
    layer in the query's bf16); its logits follow the same GPU trace with XLA's attention. FLASH_MIN_ROWS lowered
    so that a short prompt takes it."""
    from llmeq_jax import calibrate
    from llmeq_jax.kv import attention, spec as kvspec
    from llmeq_jax.models import forward

    params = jax.tree.map(lambda a: (a * 4).astype(jnp.bfloat16), init_params(CONFIG, jax.random.key(2)))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CONFIG.vocab_size, (2, 6)))
    mask = jnp.asarray([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kv = None
    if cache == "int8":
        calib = np.random.default_rng(3).integers(0, CONFIG.vocab_size, (2, 16))
        kv = calibrate.make_kv_quantizer(kvspec.KVSpec(bits=8), CONFIG, params, calib)

    def prompt_logits():
        if cache == "none":
            return jax.jit(lambda p, t: forward(CONFIG, p, t, attention_mask=mask))(params, tokens)
        state = init_cache(CONFIG, 2, 8, jnp.bfloat16, kv=kv)
        return jax.jit(lambda p, t, c: forward_step(CONFIG, p, t, mask, c)[0])(params, tokens, state)

    with native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True):
        want = prompt_logits()
        assert cudnn_as_xla == []  # 6 positions: XLA's attention
        monkeypatch.setattr(attention, "FLASH_MIN_ROWS", 4)
        got = prompt_logits()
    assert [c["layout"] for c in cudnn_as_xla] == ["BNTH"] * CONFIG.num_layers
    rows = np.asarray(mask, bool)  # the left-padding position's logits are noise on either path
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got, np.float32)[rows], np.asarray(want, np.float32)[rows],
                               atol=0.03 * scale)


def _int8_transposes(jaxpr_text: str) -> int:
    """How many transposes of int8 arrays a jaxpr's text holds (its sub-jaxprs included)."""
    return len(re.findall(r"i8\[[\d,]+\] = transpose", jaxpr_text))


def test_a_gpus_w8a8_prompt_reads_its_weights_k_major(monkeypatch):
    """Laid out for a GPU's prompts (``pipeline.run_layout``), W8A8 weights are stored K-major with q/k/v and
    gate/up joined (``decode_layout.w8a8_kmajor``): traced for a GPU at ``w8a8.TRANSPOSE_MIN_M`` rows, no int8
    weight is transposed before the kernel (the checkpoint's ``(in, out)`` codes are, every call); the prompt's
    logits follow XLA's W8A8 path on the ``(in, out)`` layout. (The kernels take these small products as they
    take a 7B's: no size floor.)"""
    from llmeq_jax import decode_layout, kernel_dispatch
    from llmeq_jax.models import forward
    from pallas_kernels import settings, w8a8

    params = jax.tree.map(lambda a: (a * 4).astype(jnp.bfloat16), init_params(CONFIG, jax.random.key(4)))
    params = pipeline.run_recipe(CONFIG, params, None, pipeline.read_recipe("rtn-w8a8"), None, 16,
                                 progress=False).params
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, CONFIG.vocab_size, (2, 6)))
    long = jnp.zeros((w8a8.TRANSPOSE_MIN_M // 64, 64), jnp.int32)
    run = lambda p, t: forward(CONFIG, p, t)  # noqa: E731  a fresh function: traced here
    monkeypatch.setattr(kernel_dispatch, "MIN_KERNEL_WEIGHTS", 0)
    with native.disabled(), kernel_config.disabled():
        want = jax.jit(run)(pipeline.run_layout(CONFIG, params, scan_layers=True), tokens)
    # (its 12 rows are a decode step's to the codes kernel, pallas_kernels.token_codes, whose own test is below:
    # XLA's codes here, as the K-major layout's subject)
    with native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True), \
            settings.override("w8a8", codes="xla"):
        assert decode_layout.prompt_target() == "pallas"
        laid = pipeline.run_layout(CONFIG, params, scan_layers=True)
        got = jax.jit(run)(laid, tokens)
        kmajor = str(jax.make_jaxpr(run)(laid, long))
        as_stored = str(jax.make_jaxpr(run)(stacked.stack_blocks(CONFIG, params), long))
    block = laid[stacked.BLOCKS]
    assert set(block["attn"]) == {"qkv_proj", "o_proj"} and set(block["mlp"]) == {"gate_up_proj", "down_proj"}
    kernels = [m["kernel"] for part in ("attn", "mlp") for m in block[part].values()]
    assert all(isinstance(k, decode_layout.RowMajorKernel) for k in kernels)
    assert kmajor.count("name=w8a8_matmul") == 4 and _int8_transposes(kmajor) == 0
    assert _int8_transposes(as_stored) >= 4  # what the check would see without the layout
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=0.03 * scale)


@pytest.mark.parametrize("recipe,serves,table", [("rtn-w8a8", True, None), ("rtn-w4-g128", False, None),
                                                 ("rtn-w4-g128", True, "pallas"), ("rtn-w4-g128", False, "xla")])
def test_generate_fills_a_gpus_cache_from_the_decode_layout_where_it_serves_prompts(recipe, serves, table, monkeypatch):
    """On a GPU a W8A8 model's decode layout (K-major W8A8 kernels, ``decode_layout.serves_prompts``) is what
    ``generate``'s prompt runs on too, with the tokens of the prompt run on the checkpoint's layout; a weight-only
    model's (int4 words for decode rows) is too where a dispatch table sends prompts to the kernel over the words,
    and is not without one or where the table measured XLA's path faster."""
    import contextlib

    from llmeq_jax import decode_layout, dispatch_table, kernel_dispatch

    params = jax.tree.map(lambda a: (a * 4).astype(jnp.bfloat16), init_params(CONFIG, jax.random.key(5)))
    params = pipeline.run_recipe(CONFIG, params, None, pipeline.read_recipe(recipe), None, 16, progress=False).params
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, CONFIG.vocab_size, (2, 6)))
    seen, prefill = [], gen.prefill
    monkeypatch.setattr(gen, "prefill", lambda config, p, *a, **k: prefill(config, seen.append(p) or p, *a, **k))
    monkeypatch.setattr(kernel_dispatch, "MIN_KERNEL_WEIGHTS", 0)
    measured = dispatch_table.use(_prompt_words_table(table)) if table else contextlib.nullcontext()
    with native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True), measured:
        out = gen.generate(CONFIG, params, tokens, 4)
        monkeypatch.setattr(decode_layout, "serves_prompts", lambda p: False)
        plain = gen.generate(CONFIG, params, tokens, 4)
    is_laid = lambda a: isinstance(a, (decode_layout.RowMajorKernel, decode_layout.Int4WordKernel))  # noqa: E731
    laid = [a for a in jax.tree.leaves(seen[0], is_leaf=is_laid) if is_laid(a)]
    assert bool(laid) == serves and (seen[0] is params) != serves and seen[1] is params
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))


def _prompt_words_table(faster: str, kernels=((256, 256), (256, 64), (256, 512), (512, 256))):
    """A dispatch table for FAKE_H100 that measured the prompt kernel over int4 words (``int4_words_prefill``)
    ``faster`` ("pallas" or "xla") than XLA's path on CONFIG's products at 2048 rows (fused ones follow them)."""
    from llmeq_jax import dispatch_table as dt

    times = {"pallas_s": 1.0, "xla_s": 2.0, "bf16_s": 1.0} if faster == "pallas" else \
        {"pallas_s": 2.0, "xla_s": 1.0, "bf16_s": 1.0}
    keys = [dt.Key(FAKE_H100.device_kind, "int4_words_prefill", 4, 128, k, n, 2048, "bfloat16") for k, n in kernels]
    return dt.Table(FAKE_H100.device_kind, dict.fromkeys(keys, times), "test")


@pytest.mark.parametrize("faster", ["pallas", "xla"])
def test_a_gpus_int4_prompt_runs_on_the_decode_words_where_a_table_says_so(faster):
    """Where a dispatch table measured the prompt kernel over words faster than XLA's path, a GPU's prompt layout
    (``pipeline.run_layout``) stores rtn-w4-g128's kernels as words, q/k/v and gate/up joined, and a prompt of 80
    positions runs them through it (four kernels a layer, traced for a GPU), with XLA's logits on the checkpoint's
    layout; where it measured XLA faster the layout keeps the packed codes and no kernel runs."""
    from llmeq_jax import decode_layout, dispatch_table
    from llmeq_jax.models import forward

    params = jax.tree.map(lambda a: (a * 4).astype(jnp.bfloat16), init_params(CONFIG, jax.random.key(6)))
    params = pipeline.run_recipe(CONFIG, params, None, pipeline.read_recipe("rtn-w4-g128"), None, 16,
                                 progress=False).params
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, CONFIG.vocab_size, (2, 40)))
    run = lambda p, t: forward(CONFIG, p, t)  # noqa: E731  a fresh function: traced here
    with native.disabled(), kernel_config.disabled():
        want = jax.jit(run)(pipeline.run_layout(CONFIG, params, scan_layers=True), tokens)
    with (native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True),
          dispatch_table.use(_prompt_words_table(faster))):
        laid = pipeline.run_layout(CONFIG, params, scan_layers=True)
        got = jax.jit(run)(laid, tokens)
        jaxpr = str(jax.make_jaxpr(run)(laid, tokens))
    block = laid[stacked.BLOCKS]
    kernels = [m["kernel"] for part in ("attn", "mlp") for m in block[part].values()]
    if faster == "pallas":
        assert set(block["attn"]) == {"qkv_proj", "o_proj"} and set(block["mlp"]) == {"gate_up_proj", "down_proj"}
        assert all(isinstance(k, decode_layout.Int4WordKernel) for k in kernels)
        assert jaxpr.count("name=int4_words_prefill") == 4 and "name=int4_words_matmul" not in jaxpr
    else:
        assert not any(isinstance(k, decode_layout.Int4WordKernel) for k in kernels)
        assert "int4_words" not in jaxpr
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=0.03 * scale)


def _hopper_decode_case(recipe: str, kernel: str, bits: int, group):
    """The stacked model quantized by ``recipe``, teacher-forced tokens, its four decode products per layer ((in,
    out): q/k/v and gate/up joined) and a table measuring the Mosaic decode kernel ``kernel`` faster on each."""
    from llmeq_jax import dispatch_table

    params = jax.tree.map(lambda a: (a * 4).astype(jnp.bfloat16), init_params(CONFIG, jax.random.key(0)))
    params = pipeline.run_recipe(CONFIG, params, None, pipeline.read_recipe(recipe), None, 16,
                                 progress=False).params
    params = stacked.stack_blocks(CONFIG, params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, PROMPT + 2)))
    products = ((256, 384), (256, 256), (256, 1024), (512, 256))  # q/k/v, o, gate/up, down
    entry = {"pallas_s": 1.0, "xla_s": 2.0, "bf16_s": 2.0}
    table = dispatch_table.Table(FAKE_H100.device_kind, {
        dispatch_table.Key(FAKE_H100.device_kind, kernel, bits, group, k, n, dispatch_table.row_bucket(2),
                           "bfloat16"): entry for k, n in products})
    return params, tokens, products, table


def test_a_gpus_int4_decode_runs_the_hopper_kernel_where_a_table_says_so(monkeypatch):
    """Where a dispatch table measured the Mosaic GPU int4 decode kernel faster than the path it replaces, a GPU's
    decode layout stores rtn-w4-g128's kernels as (out, in) int4 rows (q/k/v and gate/up joined) and every decode
    step's four products per layer run on that kernel, each layer read in place from the stack (GPU interpret mode):
    the CPU's XLA decode's logits, step by step."""
    from llmeq_jax import dispatch_table, kernel_dispatch
    from pallas_kernels import decode_hopper

    calls = []
    real = decode_hopper.decode_hopper
    monkeypatch.setattr(decode_hopper, "decode_hopper",
                        lambda x, w, *a, **k: calls.append((w.shape, k.get("layer") is not None)) or real(x, w, *a,
                                                                                                           **k))
    monkeypatch.setattr(kernel_dispatch, "MIN_KERNEL_WEIGHTS", 0)  # this model's products: the kernels' own sizes
    params, tokens, products, table = _hopper_decode_case("rtn-w4-g128", "decode_hopper", 4, 128)
    with native.disabled(), kernel_config.disabled():
        want, _, _ = _logits(params, tokens)
    with native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True), \
            dispatch_table.use(table):
        got, _, kinds = _logits(params, tokens)
    assert kinds == {"Int4RowKernel"}
    assert sorted(set(calls)) == sorted(((2, n, k), True) for k, n in products)  # the stacks of (N, K) rows, a layer
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.03 * scale)
    assert float(jnp.max(jnp.abs(got[:, 1:] - got[:, :-1]))) > 0.2 * scale


@pytest.mark.parametrize("recipe,kernel", [("rtn-w8a8", "w8a8_decode_hopper"),
                                           ("fp8-w8a8", "fp8_w8a8_decode_hopper")])
def test_a_gpus_w8a8_decode_runs_the_hopper_kernel_where_a_table_says_so(monkeypatch, recipe, kernel):
    """Where a dispatch table measured the Mosaic GPU decode kernel's W8A8 mode faster than the path it replaces,
    every decode step's four W8A8 products per layer (q/k/v and gate/up joined, K-major) run on it, each layer read
    in place from the stack (GPU interpret mode): the logits of the Triton W8A8 kernel it replaces, step by step.
    (Against XLA's W8A8 path a code of x at a rounding boundary moves the logits by more than a kernel's rounding.)
    Like against like: the activation codes by XLA and the SwiGLU gate after the product on both paths (the Mosaic
    kernel takes neither; E4M3 codes one step off -- the Triton kernel gating its float32 sums -- moved logits by 5 %
    of their scale)."""
    from llmeq_jax import dispatch_table, kernel_dispatch
    from pallas_kernels import decode_hopper, hardware_checked

    monkeypatch.setenv(hardware_checked.ENV, ",".join(k for k in hardware_checked.UNCHECKED
                                                      if k not in ("token_codes", "split_fixup")))

    calls = []
    real = decode_hopper.w8a8_decode_hopper
    monkeypatch.setattr(decode_hopper, "w8a8_decode_hopper",
                        lambda x, w, *a, **k: calls.append((w.shape, k["fp8"], k.get("layer") is not None))
                        or real(x, w, *a, **k))
    monkeypatch.setattr(kernel_dispatch, "MIN_KERNEL_WEIGHTS", 0)  # this model's products: the kernels' own sizes
    params, tokens, products, table = _hopper_decode_case(recipe, kernel, 8, None)
    with native.disabled(), kernel_config.compiling_for(FAKE_H100), kernel_config.interpret(True):
        want, _, _ = _logits(params, tokens)
        assert calls == []
        with dispatch_table.use(table):
            got, _, kinds = _logits(params, tokens)
    assert kinds == {"RowMajorKernel"}
    fp8 = recipe.startswith("fp8")
    assert sorted(set(calls)) == sorted(((2, n, k), fp8, True) for k, n in products)  # a layer of (N, K) stacks
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.03 * scale)
    assert float(jnp.max(jnp.abs(got[:, 1:] - got[:, :-1]))) > 0.2 * scale
