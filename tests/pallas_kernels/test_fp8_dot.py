"""fp8_dot_acc: exact float32 ``acc + a @ b`` off the GPU; on Triton, a dot that may use FP8 wgmma."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.common import compiler_params
from pallas_kernels.fp8_dot import PROMOTE_EVERY, fp8_dot_acc
from pallas_kernels.ttir import triton_modules
from pallas_kernels.w8a8 import w8a8_matmul

F8 = jnp.float8_e4m3fn


def _operands(m, k, n, kmajor):
    a = jax.random.normal(jax.random.key(0), (m, k)).astype(F8)
    b = jax.random.normal(jax.random.key(1), (n, k) if kmajor else (k, n)).astype(F8)
    acc = jax.random.normal(jax.random.key(2), (m, n))
    return a, b, acc


@pytest.mark.parametrize("kmajor", [False, True])
def test_is_exact_acc_plus_product(kmajor):
    a, b, acc = _operands(16, 64, 32, kmajor)
    bt = b.astype(jnp.float32).T if kmajor else b.astype(jnp.float32)
    want = acc + np.asarray(a.astype(jnp.float32), np.float64) @ np.asarray(bt, np.float64)
    for got in (fp8_dot_acc(a, b, acc, b_kmajor=kmajor), jax.jit(fp8_dot_acc, static_argnames="b_kmajor")(a, b, acc, b_kmajor=kmajor)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)


def test_runs_in_an_interpreted_kernel():
    a, b, acc = _operands(16, 32, 16, False)

    def kernel(a_ref, b_ref, c_ref, o_ref):
        o_ref[...] = fp8_dot_acc(a_ref[...], b_ref[...], c_ref[...], b_kmajor=False)

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(acc.shape, jnp.float32), interpret=True)(a, b, acc)
    np.testing.assert_allclose(np.asarray(got), np.asarray(fp8_dot_acc(a, b, acc, b_kmajor=False)), rtol=1e-6)


def test_refuses_shapes_that_do_not_multiply():
    a, b, acc = _operands(16, 64, 32, False)
    with pytest.raises(ValueError, match="acc \\+ a @ b"):
        fp8_dot_acc(a, b[:32], acc, b_kmajor=False)


@pytest.mark.parametrize("m", [1, 4096])
def test_w8a8_fp8_kernel_hands_triton_an_fp8_dot_it_may_run_on_wgmma(m):
    """What reaches Triton: E4M3 operands, the accumulator inside the dot, and maxNumImpreciseAcc
    (without it Triton converts both operands to float16 for mma.sync instead of FP8 wgmma)."""
    sds = jax.ShapeDtypeStruct
    (kernel,) = triton_modules(lambda x, w, s: w8a8_matmul(x, w, s, fp8=True),
                               sds((m, 4096), jnp.bfloat16), sds((4096, 11008), jnp.int8), sds((1, 11008), jnp.float32))
    assert kernel.name == "w8a8_matmul" and kernel.num_warps in (4, 8)
    dots = [line for line in kernel.ttir.splitlines() if "tt.dot" in line]
    assert dots and all(f"maxNumImpreciseAcc = {PROMOTE_EVERY}" in d and "f8E4M3FN" in d for d in dots), dots


def test_pallas_own_fp8_dot_still_lacks_imprecise_accumulation():
    """Canary: when Pallas sets maxNumImpreciseAcc itself, fp8_dot_acc can go."""

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jax.lax.dot_general(a_ref[...], b_ref[...], (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)

    def f(a, b):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                              compiler_params=compiler_params())(a, b)

    (lowered,) = triton_modules(f, jax.ShapeDtypeStruct((64, 64), F8), jax.ShapeDtypeStruct((64, 64), F8))
    dots = [line for line in lowered.ttir.splitlines() if "tt.dot" in line]
    assert dots and not any("maxNumImpreciseAcc" in d for d in dots), dots
