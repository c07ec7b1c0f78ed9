"""A W8A8 decode step's activation codes in one kernel, its RMSNorm folded in (pallas_kernels/token_codes.py):
interpret mode against XLA's quantization, the W8A8 kernel on those codes, refusals, lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.core import fp8grid
from pallas_kernels import token_codes as tc
from pallas_kernels import w8a8
from pallas_kernels.norm_fold import NormFold


def _x(m, k, dtype):
    return (jax.random.normal(jax.random.key(m + k), (m, k)) * 3 + 0.5).astype(dtype)


@pytest.mark.parametrize("m, k, dtype", [(1, 4096, jnp.bfloat16), (3, 300, jnp.float32), (16, 576, jnp.float16),
                                         (2, 11008, jnp.bfloat16)])
@pytest.mark.parametrize("fp8", [False, True])
def test_codes_are_xlas_quantization(m, k, dtype, fp8):
    x = _x(m, k, dtype)
    codes, scale = tc.token_codes(x, fp8=fp8, interpret=True)
    # jitted as the interpret-mode kernel is (XLA's CPU compiles a division by 448 as a multiplication)
    want_codes, want_scale = jax.jit(tc.token_codes_reference, static_argnames="fp8")(x, fp8=fp8)
    assert codes.dtype == jnp.int8 and codes.shape == (m, k) and scale.shape == (m, 1)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(want_codes))  # the same arithmetic: bit for bit
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))
    values = fp8grid.decode(codes) if fp8 else codes.astype(jnp.float32)
    assert float(jnp.max(jnp.abs(values))) == (448.0 if fp8 else 127.0)  # each row's absmax onto the grid's edge


@pytest.mark.parametrize("m, k, dtype, fp8", [(1, 4096, jnp.bfloat16, False), (3, 300, jnp.float32, False),
                                              (16, 576, jnp.bfloat16, False), (2, 4096, jnp.bfloat16, True)])
@pytest.mark.parametrize("stacked", [False, True])
def test_codes_of_the_norms_output(m, k, dtype, fp8, stacked):
    """With the norm folded: the codes of ``rms_norm(x)`` rounded to x's dtype, as XLA quantizes the norm's output;
    the sum of squares in another order may move a value across a rounding boundary: one code in a thousand at
    most, and by one (E4M3 codes: one step of the grid, their bit patterns one apart)."""
    x = _x(m, k, dtype)
    scale = jax.random.uniform(jax.random.key(k), (k,), minval=0.5, maxval=1.5)
    if stacked:  # layer 2 of a stack, read in place
        codes, sx = tc.token_codes(x, norm=NormFold(jnp.stack([scale * 0, scale * 3, scale]), 1e-5),
                                   layer=jnp.int32(2), fp8=fp8, interpret=True)
    else:
        codes, sx = tc.token_codes(x, norm=NormFold(scale, 1e-5), fp8=fp8, interpret=True)
    want_codes, want_sx = tc.token_codes_reference(x, NormFold(scale, 1e-5), fp8=fp8)
    off = np.abs(np.asarray(codes, np.int32) - np.asarray(want_codes, np.int32))
    assert off.max() <= 1 and off.mean() <= 1e-3, (off.max(), off.mean())
    np.testing.assert_allclose(np.asarray(sx), np.asarray(want_sx), rtol=1e-2 if dtype != jnp.float32 else 1e-6)
    assert not np.array_equal(np.asarray(codes), np.asarray(tc.token_codes_reference(x, fp8=fp8)[0]))  # normed


@pytest.mark.parametrize("fp8", [False, True])
def test_the_w8a8_kernel_takes_the_codes_made_already(fp8):
    """``w8a8_matmul(..., codes=)``: the product of XLA's own codes, whichever made them (int8, or E4M3 bit patterns
    against E4M3 weights); only dynamic per-token codes."""
    m, k, n = 2, 512, 256
    x = _x(m, k, jnp.bfloat16)
    if fp8:
        wq = fp8grid.encode(jax.random.normal(jax.random.key(1), (k, n)) * 100)
    else:
        wq = jax.random.randint(jax.random.key(1), (k, n), -127, 128).astype(jnp.int8)
    s = jax.random.uniform(jax.random.key(2), (1, n), minval=0.001, maxval=0.002)
    want = w8a8.w8a8_matmul(x, wq, s, fp8=fp8, interpret=True)
    got = w8a8.w8a8_matmul(x, wq, s, fp8=fp8, codes=tc.token_codes(x, fp8=fp8, interpret=True), interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(got, np.float32), np.asarray(  # the other grid's codes: another product
        w8a8.w8a8_matmul(x, wq, s, fp8=fp8, codes=tc.token_codes(x, fp8=not fp8, interpret=True), interpret=True),
        np.float32))
    with pytest.raises(ValueError, match="dynamic per-token codes"):
        w8a8.w8a8_matmul(x, wq, s, act_scale=0.1, codes=tc.token_codes(x, interpret=True), interpret=True)
    with pytest.raises(ValueError, match=r"codes= must be int8 \(2, 512\) codes"):
        w8a8.w8a8_matmul(x, wq, s, codes=(jnp.zeros((2, 512), jnp.int32), jnp.ones((2, 1))), interpret=True)


def test_bad_inputs_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match="17 rows"):
        tc.token_codes(jnp.ones((17, 64)), interpret=True)
    with pytest.raises(ValueError, match="without norm= there is none to read"):
        tc.token_codes(jnp.ones((1, 64)), layer=jnp.int32(0), interpret=True)
    with pytest.raises(ValueError, match=r"scale must be a float \(64,\)"):
        tc.token_codes(jnp.ones((1, 64)), norm=NormFold(jnp.ones(32), 1e-5), interpret=True)


def test_kernel_lowers_for_cuda(cuda_lowering):
    x = jnp.ones((1, 4096), jnp.bfloat16)
    cuda_lowering(lambda x, s, i: tc.token_codes(x, norm=NormFold(s, 1e-5), layer=i), x, jnp.ones((4, 4096)),
                  jnp.int32(1))
    cuda_lowering(lambda x: tc.token_codes(x), jnp.ones((3, 11008), jnp.bfloat16))
    cuda_lowering(lambda x: tc.token_codes(x, fp8=True), jnp.ones((2, 4096), jnp.bfloat16))


def test_dispatch_makes_codes_in_the_kernel_for_a_gpus_decode_rows_only(monkeypatch):
    """``kernel_dispatch.codes_made_by_kernel``: dynamic per-token int8 codes of a decode step's rows, traced for a
    GPU where the kernel may run (unchecked: named in LLMEQ_UNCHECKED_KERNELS), unless ``w8a8:codes=xla``; a
    prompt's rows, a static scale, a dynamic per-tensor scale, a weight-only product, a CPU keep XLA's quantization;
    FP8 W8A8's E4M3 codes too."""
    import dataclasses
    import types

    from llmeq_jax import kernel_dispatch as dispatch
    from llmeq_jax.core.quantize import Spec, quantize
    from pallas_kernels import config, hardware_checked, settings

    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    w = jax.random.normal(jax.random.key(0), (256, 64)) * 0.1
    int8 = quantize(w, Spec(8, "channel"), act_spec=Spec(8, "token"))
    fp8 = quantize(w, Spec(8, "channel", grid="fp8"), act_spec=Spec(8, "token", grid="fp8"))
    static = dataclasses.replace(int8, act_scale=jnp.float32(0.1))
    per_tensor = dataclasses.replace(int8, act_spec=Spec(8, "tensor"))
    weight_only = quantize(w, Spec(8, "channel"))
    assert not dispatch.codes_made_by_kernel(int8, 1)  # no GPU
    with config.compiling_for(gpu):
        assert not dispatch.codes_made_by_kernel(int8, 1)  # not yet run on a GPU: off unless named
        monkeypatch.setenv(hardware_checked.ENV, "token_codes")
        assert dispatch.codes_made_by_kernel(int8, 1) and dispatch.codes_made_by_kernel(int8, 16)
        assert dispatch.codes_made_by_kernel(fp8, 1)
        assert not dispatch.codes_made_by_kernel(int8, 17)  # a prompt's rows
        assert not any(dispatch.codes_made_by_kernel(q, 1) for q in (static, per_tensor, weight_only))
        with settings.override("w8a8", codes="xla"):
            assert not dispatch.codes_made_by_kernel(int8, 1)
