"""int8 decode with float16 operands (pallas_kernels/int8_f16.py): interpret mode, the PTX emulated, lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import int8_f16
from pallas_kernels.blocks import Blocks
from pallas_kernels.weight_only import weight_only_matmul, weight_only_reference
from tests.pallas_kernels.ptx import run_ptx

CASES = [  # (M, K, N, zero point, bias, dtype, k_splits, blocks)
    (1, 512, 256, False, False, jnp.bfloat16, None, None),
    (3, 700, 300, True, True, jnp.bfloat16, 2, None),  # ragged K and N, split K, bias after the splits
    (16, 384, 64, True, False, jnp.float16, None, (16, 64, 128, 4, 3)),  # float16 x: no scaling
    (20, 256, 40, False, True, jnp.bfloat16, 1, None),  # two row blocks, bias in the kernel
]


def _weights(k, n, zp, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.001, 0.01, (1, n)), jnp.float32)
    zero = jnp.asarray(rng.integers(-20, 20, (1, n)), jnp.int8) if zp else None
    return q, scale, zero


@pytest.mark.parametrize("m,k,n,zp,bias,dtype,splits,blocks", CASES)
def test_kernel_matches_reference(m, k, n, zp, bias, dtype, splits, blocks):
    q, scale, zero = _weights(k, n, zp, m)
    x = (jax.random.normal(jax.random.key(m), (m, k)) * 3).astype(dtype)
    b = jnp.linspace(-1, 1, n) if bias else None
    got = weight_only_matmul(x, q.T, scale, bits=8, w_zero_point=zero, bias=b, w_layout="nk", dequant="f16",
                             k_splits=splits, blocks=blocks and Blocks(*blocks), interpret=True)
    want = weight_only_reference(x, q, scale, bits=8, w_zero_point=zero, bias=b)
    assert got.dtype == x.dtype and got.shape == (m, n)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2,
                               atol=1e-2 * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))


def test_bf16_x_converted_in_the_kernel_or_by_xla_gives_the_same_product():
    """By default each K step's bf16 x tile becomes float16 operands in the kernel (the launch takes x as it is);
    with convert="xla" XLA makes them before the launch: the same values either way."""
    from pallas_kernels import settings

    q, scale, zero = _weights(700, 300, True, 3)
    x = (jax.random.normal(jax.random.key(3), (2, 700)) * 3).astype(jnp.bfloat16)

    def run(x):
        return weight_only_matmul(x, q.T, scale, bits=8, w_zero_point=zero, w_layout="nk", dequant="f16",
                                  k_splits=2, interpret=True)

    in_kernel, in_kernel_text = run(x), str(jax.make_jaxpr(lambda x: run(x))(x))
    with settings.override("int8_f16", convert="xla"):
        by_xla, by_xla_text = run(x), str(jax.make_jaxpr(lambda x: run(x))(x))
    np.testing.assert_array_equal(np.asarray(in_kernel, np.float32), np.asarray(by_xla, np.float32))
    operand = lambda text: text.split("pallas_call[")[0]  # noqa: E731  what the launch is handed
    assert ":f16[2,700]" not in operand(in_kernel_text) and ":f16[2,700]" in operand(by_xla_text)


def test_bf16_activations_keep_their_small_and_large_values():
    """bf16 x is scaled by X_SCALE into float16: values far apart in size (1e-4 .. 1e4) still give the
    product of the bf16 values to float32 accumulation's accuracy, nothing overflows."""
    k, n = 256, 8
    q, scale, _ = _weights(k, n, False, 5)
    x = jnp.asarray(np.geomspace(1e-4, 1e4, k)[None] * np.where(np.arange(k) % 2, 1, -1), jnp.bfloat16)
    got = weight_only_matmul(x, q.T, scale, bits=8, w_layout="nk", dequant="f16", interpret=True)
    want = (x.astype(jnp.float32) @ (q.astype(jnp.float32) * scale))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=1e-3)


def test_code_ptx_gives_float16_1152_plus_every_code():
    """CODE_ASM (runs only on a GPU), emulated: every int8 value in every byte of a word becomes the float16
    1152 + value, in element order (two per output register)."""
    values = np.arange(-128, 128, dtype=np.int8)
    want = np.asarray(int8_f16.codes(jnp.asarray(values))).view(np.uint16)
    assert np.array_equal(np.asarray(want.view(np.float16), np.float32), values.astype(np.float32) + 1152)
    for shift in range(4):
        for row in np.roll(values.reshape(64, 4), shift, axis=1):
            regs = run_ptx(int8_f16.CODE_ASM, **{"$2": int.from_bytes(row.tobytes(), "little")})
            halves = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
            assert halves == [int(want[int(v) + 128]) for v in row], row


def test_f16_dequant_is_refused_where_it_does_not_apply():
    q, scale, _ = _weights(256, 32, False, 1)
    x = jnp.ones((1, 256), jnp.bfloat16)
    msg = "dequant='f16' takes int8 weights stored K-major"
    with pytest.raises(ValueError, match=msg):
        weight_only_matmul(x, q, scale, bits=8, dequant="f16", interpret=True)  # N-major
    with pytest.raises(ValueError, match=msg):
        weight_only_matmul(x.astype(jnp.float32), q.T, scale, bits=8, w_layout="nk", dequant="f16", interpret=True)
    with pytest.raises(ValueError, match=msg):
        weight_only_matmul(x, q.T, jnp.ones((2, 32)), bits=8, group=128, w_layout="nk", dequant="f16",
                           interpret=True)


def test_a_layer_of_a_stack_is_read_in_place():
    qs, scales = zip(*[_weights(256, 64, False, i)[:2] for i in range(3)])
    stack, scale = jnp.stack([q.T for q in qs]), jnp.stack(scales)
    x = jax.random.normal(jax.random.key(0), (2, 256)).astype(jnp.bfloat16)
    at = jax.jit(lambda x, w, s, i: weight_only_matmul(x, w, s, bits=8, w_layout="nk", dequant="f16", layer=i,
                                                       interpret=True))
    for i in range(3):
        want = weight_only_matmul(x, qs[i].T, scales[i], bits=8, w_layout="nk", dequant="f16", interpret=True)
        np.testing.assert_array_equal(np.asarray(at(x, stack, scale, jnp.int32(i)), np.float32),
                                      np.asarray(want, np.float32))


def test_lowers_for_cuda_with_the_code_ptx(cuda_lowering):
    from pallas_kernels.ttir import triton_modules

    sds = jax.ShapeDtypeStruct
    args = [sds((1, 4096), jnp.bfloat16), sds((11008, 4096), jnp.int8), sds((1, 11008), jnp.float32),
            sds((1, 11008), jnp.int8)]
    f = lambda x, w, s, z: weight_only_matmul(x, w, s, bits=8, w_zero_point=z, w_layout="nk", dequant="f16")  # noqa
    (kernel,) = triton_modules(f, *args)
    # one asm call per K step feeding the one dot (no dot against ones: x's sums are a reduction)
    assert kernel.ttir.count("tt.elementwise_inline_asm") == 1 and "prmt.b32" in kernel.ttir
    assert kernel.ttir.count("tt.dot") == 1 and "f16" in kernel.ttir
    cuda_lowering(f, *args)
