"""Stacked decoder blocks (models/stacked.py): one lax.scan computes what the unrolled blocks compute,
compiles one block whatever the depth, and refuses trees whose blocks cannot share a scan body."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import decode_layout, native, ops, pipeline
from llmeq_jax.core.qarray import QArray
from llmeq_jax.generate import generate
from llmeq_jax.kv import spec as kvspec
from llmeq_jax.models import ModelConfig, forward, init_params, load_model, stacked
from tests.shared_data import shared_data_path

LLAMA = ModelConfig("llama", 64, 32, 4, 4, 2, 8, 48, 1e-5, 64, False)
GPT2 = ModelConfig("gpt2", 64, 32, 3, 4, 4, 8, 64, 1e-5, 64, False)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)


@pytest.fixture(scope="module")
def stories():
    return load_model(str(shared_data_path("stories260K.gguf")))


@pytest.fixture(scope="module")
def stories_w4(stories):
    config, params, tokenizer = stories
    return pipeline.run_recipe(config, params, tokenizer, pipeline.read_recipe("rtn-w4-g128"), None, 1, False).params


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.abs(a).max()))


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_stacked_forward_equals_unrolled(config):
    params = jax.tree.map(lambda a: a * 5, init_params(config, jax.random.key(0)))
    packed = stacked.stack_blocks(config, params)
    assert set(packed) == {k for k in params if not k.startswith("layers_")} | {stacked.BLOCKS}
    assert all(a.shape[0] == config.num_layers for a in jax.tree.leaves(packed[stacked.BLOCKS]))
    _close(forward(config, params, TOKENS), jax.jit(lambda p, t: forward(config, p, t))(packed, TOKENS))


def test_quantized_model_in_prefill_layout_stacks(stories, stories_w4):
    config, _, _ = stories
    tokens = TOKENS % config.vocab_size
    unrolled = forward(config, decode_layout.for_prefill(stories_w4), tokens)
    scanned = forward(config, pipeline.run_layout(config, stories_w4, scan_layers=True), tokens)
    _close(unrolled, scanned)
    with pytest.raises(ValueError, match="for_prefill: the blocks are stacked already"):
        decode_layout.for_prefill(stacked.stack_blocks(config, stories_w4))


@pytest.mark.parametrize("kv_bits", [None, 4], ids=["float-cache", "int4-cache"])
def test_generate_with_stacked_blocks_gives_the_same_tokens(stories, stories_w4, kv_bits):
    """The cache is indexed by the traced layer inside the scan; the decode layout (row-major native
    kernels) is built for every stacked block."""
    config, _, _ = stories
    kv = None if kv_bits is None else kvspec.KVQuantizer(None, kvspec.KVSpec(bits=4, key_granularity="token", window=4))
    prompt = TOKENS[:, :6] % config.vocab_size
    want = generate(config, stories_w4, prompt, 12, kv=kv)
    got = generate(config, stacked.stack_blocks(config, stories_w4), prompt, 12, kv=kv)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _program_size(config, params) -> int:
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    shapes = jax.eval_shape(lambda: params)
    return len(jax.jit(lambda p, t: forward(config, p, t)).lower(shapes, tokens).as_text())


def test_scanned_program_does_not_grow_with_depth():
    sizes = {}
    for layers in (2, 8):
        config = dataclasses.replace(LLAMA, num_layers=layers)
        params = init_params(config, jax.random.key(0))
        sizes[layers] = (_program_size(config, params), _program_size(config, stacked.stack_blocks(config, params)))
    assert sizes[8][0] > 2.5 * sizes[2][0]  # unrolled: one copy of the block per layer
    assert sizes[8][1] < 1.05 * sizes[2][1]  # scanned: one body


def test_the_scan_carries_the_layer_index_and_scans_over_nothing():
    """The layer index rides in the carry: scanning over an index array made XLA slice it with a dynamic-slice
    fusion per layer, which on a GPU is a thunk of its own that command buffers cannot hold (the layer's
    kernels were split around it, 22 thunks a layer instead of 18: scripts/gpu_aot.py)."""
    params = stacked.stack_blocks(LLAMA, init_params(LLAMA, jax.random.key(0)))
    jaxpr = jax.make_jaxpr(lambda p, t: forward(LLAMA, p, t))(params, TOKENS)
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == LLAMA.num_layers
    scan = scans[0].params
    assert len(scans[0].invars) == scan["num_consts"] + scan["num_carry"]  # no xs


def test_blocks_that_differ_are_refused_by_name():
    params = init_params(LLAMA, jax.random.key(0))
    odd = {**params, "layers_2": jax.tree.map(lambda a: a, params["layers_2"])}
    odd["layers_2"]["attn"]["q_proj"]["kernel"] = odd["layers_2"]["attn"]["q_proj"]["kernel"].astype(jnp.bfloat16)
    reason = stacked.stacking_reason(LLAMA, odd)
    assert "layers_2" in reason and "attn/q_proj/kernel" in reason and "bfloat16" in reason
    with pytest.raises(ValueError, match="cannot stack the decoder blocks: layers_2 differs"):
        stacked.stack_blocks(LLAMA, odd)
    with pytest.warns(UserWarning, match="running the blocks unrolled instead: layers_2"):
        assert stacked.stack_blocks_or_warn(LLAMA, odd) is odd

    sliding = dataclasses.replace(LLAMA, sliding_window=4, sliding_layers=(True, False, True, False))
    assert "sliding-window" in stacked.stacking_reason(sliding, params)
    assert "no layers_3" in stacked.stacking_reason(LLAMA, {k: v for k, v in params.items() if k != "layers_3"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stacked.stack_blocks_or_warn(LLAMA, params)  # stackable: no warning


def test_unstack_inverts_stack(stories_w4, stories):
    config = stories[0]
    back = stacked.unstack_blocks(config, stacked.stack_blocks(config, stories_w4))
    assert jax.tree.structure(back) == jax.tree.structure(stories_w4)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(stories_w4)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cli_eval_with_scan_layers_matches_unrolled(tmp_path):
    from tests.test_cli import TEXT, llmeq

    model = str(shared_data_path("stories260K.gguf"))
    runs = [json.loads(llmeq("eval", model, "--text", TEXT, "--seq-len", "64", "--windows", "2", "--json", *flag).stdout)
            for flag in ([], ["--scan-layers"])]
    np.testing.assert_allclose(runs[1]["rows"][0]["ppl"], runs[0]["rows"][0]["ppl"], rtol=1e-5)


def test_stacked_blocks_run_the_pallas_kernels(stories, stories_w4):
    """Inside the scan the kernels get each layer's slice: interpret mode gives the unrolled logits, and the
    traced program holds the kernels once (in the scan body) instead of once per layer."""
    from pallas_kernels import config as kernel_config

    config = stories[0]
    tokens = TOKENS[:1, :4] % config.vocab_size
    packed = stacked.stack_blocks(config, stories_w4)
    with kernel_config.interpret(True):
        _close(forward(config, stories_w4, tokens), jax.jit(lambda p, t: forward(config, p, t))(packed, tokens))
        calls = {name: str(jax.make_jaxpr(lambda p, t: forward(config, p, t))(p, tokens)).count("pallas_call")
                 for name, p in (("unrolled", stories_w4), ("stacked", packed))}
        # the int8 LM head's product, outside the blocks: once in either program
        head = stories_w4["lm_head"]["kernel"]
        x = jnp.zeros((1, 4, config.hidden_size), jnp.float32)
        calls["head"] = str(jax.make_jaxpr(lambda x: ops.linear(x, head))(x)).count("pallas_call")
    blocks = calls["stacked"] - calls["head"]
    assert blocks > 0 and calls["unrolled"] - calls["head"] == config.num_layers * blocks, calls


def _weight_slices(config, params, tokens, dtype="u8") -> int:
    """Dynamic slices of ``dtype`` arrays (packed int4: u8; int8: i8) in the traced forward."""
    text = str(jax.make_jaxpr(lambda p, t: forward(config, p, t))(params, tokens))
    # the slice's result type (left of " = "): an index operand such as 0:i32[] is not a sliced weight
    return sum(1 for line in text.splitlines() if "= dynamic_slice" in line and f":{dtype}[" in line.split(" = ")[0])


def test_stacked_blocks_hand_the_kernels_the_stack_not_a_copy(stories, stories_w4):
    """Where a Pallas kernel runs, the scan gives it the stacked weights and the layer index (LayerSlice):
    no packed weight is sliced out (XLA would copy it for the custom call); without kernels it is."""
    from pallas_kernels import config as kernel_config

    config = stories[0]
    tokens = TOKENS[:1, :4] % config.vocab_size
    packed = stacked.stack_blocks(config, stories_w4)
    with kernel_config.interpret(True):
        assert _weight_slices(config, packed, tokens) == 0
    with kernel_config.disabled():
        assert _weight_slices(config, packed, tokens) > 0


def test_bf16_model_generates_with_a_bf16_cache_stacked_or_not():
    """Without native kernels (as on a GPU) the cache follows the model's dtype by default and attention returns
    the queries' dtype, so a bf16 residual stream stays bf16 (a scan's carry must keep one type); under a float32
    cache (the default where native kernels run) too, stacked or not."""
    params = jax.tree.map(lambda a: (a * 5).astype(jnp.bfloat16), init_params(LLAMA, jax.random.key(2)))
    prompt = TOKENS[:, :5]
    with native.disabled():
        want, cache = generate(LLAMA, params, prompt, 6, return_cache=True)
        assert cache.k.dtype == jnp.bfloat16
        got = generate(LLAMA, stacked.stack_blocks(LLAMA, params), prompt, 6)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for p in (params, stacked.stack_blocks(LLAMA, params)):
        _, f32_cache = generate(LLAMA, p, prompt, 2, cache_dtype=jnp.float32, return_cache=True)
        assert f32_cache.k.dtype == jnp.float32


def test_published_shapes():
    from llmeq_jax.models import shapes

    config = shapes.shape_config("llama-3-8b", num_layers=2)
    assert (config.hidden_size, config.num_kv_heads, config.num_layers, config.vocab_size) == (4096, 8, 2, 128256)
    with pytest.raises(ValueError, match="unknown model shapes 'llama-9b'; known: llama-2-7b"):
        shapes.shape_config("llama-9b")


def test_stacked_w8a8_static_reads_layers_in_place(stories):
    """W8A8 with static activation scales: the kernel reads each layer's int8 weights from the stack (and
    the layer's activation scale), with the unrolled model's logits."""
    from pallas_kernels import config as kernel_config

    from llmeq_jax import calibrate, methods

    config, params, tokenizer = stories
    windows = calibrate.calibration_windows(tokenizer, shared_data_path("wikitext2_valid.txt"), 2, 64)
    w8a8, _ = methods.quantize_model(config, params, pipeline.read_recipe("rtn-w8a8-static"), windows)
    kernels = [a for a in jax.tree.leaves(w8a8, is_leaf=lambda a: isinstance(a, QArray)) if isinstance(a, QArray)]
    assert any(q.act_scale is not None for q in kernels)  # static scales: the stack carries them per layer
    tokens = TOKENS[:1, :4] % config.vocab_size
    packed = stacked.stack_blocks(config, w8a8)
    with kernel_config.interpret(True):
        _close(forward(config, w8a8, tokens), jax.jit(lambda p, t: forward(config, p, t))(packed, tokens))
        assert _weight_slices(config, packed, tokens, "i8") == 0
    with kernel_config.disabled():
        assert _weight_slices(config, packed, tokens, "i8") > 0


def test_stacked_decode_layout_reads_layers_in_place_on_cpu(stories, stories_w4):
    """The native row-major decode kernels take each layer from the stacked codes (no dynamic slice of
    packed weights in a decode step); with native kernels off the scan slices them, as before."""
    from llmeq_jax import native

    if not native.available():
        pytest.fail(f"the native CPU library is needed here: {native.unavailable_reason()}")
    config = stories[0]
    token = TOKENS[:1, :1] % config.vocab_size
    packed = stacked.stack_blocks(config, stories_w4)
    step = decode_layout.for_decode(packed, rows=1)
    # what the row-major kernel cannot take stays a QArray and is sliced (stories260K: down_proj, K = 172)
    left = [a for a in jax.tree.leaves(step[stacked.BLOCKS], is_leaf=lambda a: not isinstance(a, dict))
            if isinstance(a, QArray)]
    assert len(left) == 1 and _weight_slices(config, step, token) == len(left)
    unrolled = decode_layout.for_decode(stories_w4, rows=1)
    _close(forward(config, unrolled, token), jax.jit(lambda p, t: forward(config, p, t))(step, token))
    with native.disabled():
        assert _weight_slices(config, decode_layout.for_decode(packed, rows=1), token) > len(left)
        # the same row-major layouts through XLA (each layer's slice of the stack)
        _close(forward(config, unrolled, token), forward(config, step, token))


def test_stacked_gpu_decode_layout_reads_int4_words_in_place(stories, stories_w4):
    """Where the Pallas kernels run (interpret mode, native kernels off), the decode layout gives the int4
    kernels words, which the scan hands the word kernel stacked (no slice of the words copied out), with
    the unrolled model's logits."""
    from llmeq_jax import native
    from llmeq_jax.decode_layout import Int4WordKernel
    from pallas_kernels import config as kernel_config

    config = stories[0]
    token = TOKENS[:1, :1] % config.vocab_size
    packed = stacked.stack_blocks(config, stories_w4)
    with native.disabled(), kernel_config.interpret(True):
        step = decode_layout.for_decode(packed, rows=1)
        leaves = jax.tree.leaves(step[stacked.BLOCKS], is_leaf=lambda a: isinstance(a, (QArray, Int4WordKernel)))
        words = [a for a in leaves if isinstance(a, Int4WordKernel)]
        assert words and all(w.w.qvalue.ndim == 3 for w in words)  # stacked [L, K'/8, N]
        assert _weight_slices(config, step, token, "i32") == 0
        _close(forward(config, stories_w4, token), jax.jit(lambda p, t: forward(config, p, t))(step, token))


def test_stacked_norms_go_to_the_norm_kernel_in_place_where_the_matmuls_read_x_as_it_is(stories, stories_w4,
                                                                                        monkeypatch):
    """Where the Pallas kernels run, a block whose matmuls take x as it is (int4, float, int8 weight-only) hands
    its norms' scales to the norm kernel stacked (read in place); with W8A8 codes (their activations quantized
    in XLA), or int8 whose float16 x XLA makes (a setting), it slices them as before. The kernel in every norm of
    a one-token step gives XLA's logits."""
    from llmeq_jax import kernel_dispatch
    from pallas_kernels import config as kernel_config
    from pallas_kernels import settings

    config, params, tokenizer = stories
    token = TOKENS[:1, :1] % config.vocab_size
    packed = stacked.stack_blocks(config, stories_w4)
    w8 = stacked.stack_blocks(config, pipeline.run_recipe(config, params, tokenizer, pipeline.read_recipe("rtn-w8"),
                                                          None, 1, False).params)
    blocks = packed[stacked.BLOCKS]
    assert stacked.norms_in_place(blocks, True) and not stacked.norms_in_place(blocks, False)
    assert stacked.norms_in_place(stacked.stack_blocks(config, params)[stacked.BLOCKS], True)  # float kernels
    assert stacked.norms_in_place(w8[stacked.BLOCKS], True)  # the int8 kernel makes its float16 x itself
    with settings.override("int8_f16", convert="xla"):  # unless XLA makes it, fused into XLA's own norm
        assert not stacked.norms_in_place(w8[stacked.BLOCKS], True)
        assert stacked.norms_in_place(blocks, True)
    w8a8 = pipeline.run_recipe(config, params, tokenizer, pipeline.read_recipe("rtn-w8a8"), None, 1, False).params
    assert not stacked.norms_in_place(stacked.stack_blocks(config, w8a8)[stacked.BLOCKS], True)
    taken = []
    real = kernel_dispatch.rms_norm

    def forced(x, scale, eps, layer=None, force=False):
        y = real(x, scale, eps, layer=layer, force=True)
        taken.append(y is not None and layer is not None)
        return y

    with native.disabled(), kernel_config.interpret(True):
        step = decode_layout.for_decode(packed, rows=1)
        want = jax.jit(lambda p, t: forward(config, p, t))(step, token)
        monkeypatch.setattr(kernel_dispatch, "rms_norm", forced)
        got = jax.jit(lambda p, t: forward(config, p, t))(step, token)
    assert taken == [True, True]  # the scan body's two norms, traced once; the final norm is not a block's
    _close(want, got)


def test_layer_norms_take_their_layer_of_a_stacked_scale_where_kernels_run():
    """GPT-2's LayerNorms get their scales as views too where Pallas kernels run (no kernel of their own: the
    layer's slice), with the unrolled model's logits."""
    from pallas_kernels import config as kernel_config

    params = jax.tree.map(lambda a: a * 5, init_params(GPT2, jax.random.key(0)))
    packed = stacked.stack_blocks(GPT2, params)
    with native.disabled(), kernel_config.interpret(True):
        assert stacked.norms_in_place(packed[stacked.BLOCKS], True)
        got = jax.jit(lambda p, t: forward(GPT2, p, t))(packed, TOKENS[:1, :3])
    _close(forward(GPT2, params, TOKENS[:1, :3]), got)


def _float_table(config, params, rows: int, pallas_faster: bool = True):
    """A dispatch table measuring the float kernel against XLA for every float kernel shape in ``params``."""
    from llmeq_jax import dispatch_table as dt

    leaves = jax.tree_util.tree_leaves_with_path(params)
    shapes = {a.shape[-2:] for path, a in leaves if getattr(path[-1], "key", None) == "kernel" and a.ndim >= 2}
    times = {"pallas_s": 1e-6 if pallas_faster else 1e-5, "xla_s": 5e-6, "bf16_s": 5e-6}
    device = jax.devices()[0].device_kind
    keys = [dt.Key(device, "float", 32, None, k, n, dt.row_bucket(rows), "float32") for k, n in shapes]
    return dt.from_json(dt.to_json(device, [(key, times) for key in keys]))


def _kernel_slices(config, params, tokens) -> int:
    """Dynamic slices of a whole float kernel ([1, in, out] out of its stack) in the traced forward."""
    text = str(jax.make_jaxpr(lambda p, t: forward(config, p, t))(params, tokens))
    return sum(1 for line in text.splitlines()
               if "= dynamic_slice" in line and re.search(r":(f32|bf16)\[1,\d+,\d+\]", line.split(" = ")[0]))


def test_stacked_float_kernels_are_read_in_place_where_a_table_chose_the_kernel(stories):
    """Float kernels inside the scan: XLA's slice-and-dot by default; the Pallas float kernel reading the
    layer from the stack (no kernel sliced out in the traced step) where a measured table says it is faster.
    Native kernels off: on a CPU the native float GEMV would take them first."""
    from llmeq_jax import dispatch_table as dt
    from llmeq_jax import native
    from pallas_kernels import config as kernel_config

    config, params, _ = stories
    token = TOKENS[:1, :1] % config.vocab_size
    packed = stacked.stack_blocks(config, params)
    want = forward(config, params, token)
    with native.disabled(), kernel_config.interpret(True):
        assert _kernel_slices(config, packed, token) > 0  # no table: XLA slices the kernels
        with dt.use(_float_table(config, packed, rows=1, pallas_faster=False)):
            assert _kernel_slices(config, packed, token) > 0
        with dt.use(_float_table(config, packed, rows=1)):
            assert _kernel_slices(config, packed, token) == 0
            got = jax.jit(lambda p, t: forward(config, p, t))(packed, token)
    _close(want, got)



@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_stacked_float_decode_reads_layers_in_place_on_cpu(dtype):
    """On a CPU the native float GEMV takes each decode step's float kernels from the stack (no layer
    copied out of it; XLA's dot of the slice copied it first, every step), with the unrolled logits;
    many rows (prefill) and native kernels off keep XLA's slice-and-dot."""
    from llmeq_jax import native

    if not native.available():
        pytest.fail(f"the native CPU library is needed here: {native.unavailable_reason()}")
    params = jax.tree.map(lambda a: (a * 5).astype(dtype), init_params(LLAMA, jax.random.key(4)))
    packed = stacked.stack_blocks(LLAMA, params)
    token = TOKENS[:1, :1]
    assert _kernel_slices(LLAMA, packed, token) == 0
    assert "llmeq_float_gemv" in jax.jit(lambda p, t: forward(LLAMA, p, t)).lower(packed, token).as_text()
    want = forward(LLAMA, params, token).astype(jnp.float32)
    got = jax.jit(lambda p, t: forward(LLAMA, p, t))(packed, token).astype(jnp.float32)
    if dtype == jnp.float32:
        _close(want, got)
    else:  # bf16 activations between the layers: a few bf16 roundings apart
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.05 * float(jnp.abs(want).max()))
    assert _kernel_slices(LLAMA, packed, TOKENS[:2, :16]) > 0  # 32 rows: XLA's GEMM
    with native.disabled():
        assert _kernel_slices(LLAMA, packed, token) > 0
