"""An RMSNorm folded into the decode products that read its output (pallas_kernels/norm_fold.py): the float and int4
word kernels and the int8 float16-operand kernel with ``norm=`` against the norm then the product, in interpret mode; split K; refusals; lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common
from pallas_kernels.float_matmul import float_matmul
from pallas_kernels.int4_words import int4_words_matmul, int4_words_reference, pack_words
from pallas_kernels.norm_fold import NormFold
from pallas_kernels.rms_norm import rms_norm_reference

EPS = 1e-5
# float32 x folds exactly (up to accumulation order); bf16 / f16 round the scaled operand where the reference
# rounds the normalized one: ~2^-8 of each operand, a few tenths of a percent of the product's scale
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2, jnp.float16: 4e-3}


def _operands(m, k, n, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = (jax.random.normal(keys[0], (m, k)) * 3 + 0.5).astype(dtype)  # not unit scale: the norm matters
    scales = 1 + 0.5 * jax.random.normal(keys[1], (3, k))  # a stack of three layers' norms
    return x, scales, keys[2]


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0,
                               atol=TOL[dtype] * scale)


@pytest.mark.parametrize("m, k, n, group, zp, bias, splits, dtype, epilogue", [
    (1, 512, 256, 128, False, False, None, jnp.float32, None),   # the launch's own splits
    (1, 512, 256, 128, False, False, 1, jnp.float32, None),      # one program over K: the row factor in the kernel
    (3, 384, 200, 128, True, True, 2, jnp.bfloat16, None),       # ragged N, zero points, bias after the factor
    (2, 1000, 130, 64, False, False, 3, jnp.float16, "mma"),     # ragged K, groups < a word block, the mma epilogue
    (16, 256, 96, None, True, False, 2, jnp.bfloat16, None),     # per channel, a batch of 16 decode rows
])
def test_word_kernel_folds_the_norm(m, k, n, group, zp, bias, splits, dtype, epilogue):
    x, scales, key = _operands(m, k, n, dtype)
    keys = jax.random.split(key, 4)
    q = jax.random.randint(keys[0], (3, k, n), -8, 8)
    groups = 1 if group is None else -(-k // group)
    s = 0.01 * (1 + jax.random.uniform(keys[1], (3, groups, n)))
    z = jax.random.randint(keys[2], (3, groups, n), -3, 4).astype(jnp.int8) if zp else None
    b = jax.random.normal(keys[3], (n,)) if bias else None
    words = pack_words(q, group)
    got = int4_words_matmul(x, words, s, group=group, w_zero_point=z, bias=b, layer=jnp.int32(1),
                            norm=NormFold(scales, EPS), k_splits=splits, epilogue=epilogue, interpret=True)
    want = int4_words_reference(rms_norm_reference(x, scales[1], EPS), words[1], s[1], group=group,
                                w_zero_point=None if z is None else z[1], bias=b)
    _close(got, want, dtype)


@pytest.mark.parametrize("m, k, n, splits, dtype", [
    (1, 512, 256, None, jnp.float32), (1, 300, 200, 1, jnp.bfloat16), (4, 1000, 130, 3, jnp.bfloat16),
    (16, 256, 64, 2, jnp.float16),
])
def test_float_kernel_folds_the_norm(m, k, n, splits, dtype):
    x, scales, key = _operands(m, k, n, dtype, seed=1)
    w = jax.random.normal(key, (3, k, n)).astype(dtype)
    b = jnp.linspace(-1, 1, n)
    got = float_matmul(x, w, bias=b, layer=jnp.int32(2), norm=NormFold(scales, EPS), k_splits=splits, interpret=True)
    normed = rms_norm_reference(x, scales[2], EPS).astype(jnp.float32)
    want = (jnp.dot(normed, w[2].astype(jnp.float32), precision="highest") + b).astype(dtype)
    _close(got, want, dtype)


@pytest.mark.parametrize("m, k, n, zp, bias, splits", [
    (1, 512, 256, False, False, None),  # the launch's own splits: the factor from the splits' squares
    (1, 384, 200, True, True, 1),       # one program over K, zero points, bias after the factor
    (16, 1000, 130, False, False, 3),   # ragged K and N, a batch of 16 decode rows
])
def test_int8_float16_kernel_folds_the_norm(m, k, n, zp, bias, splits):
    """rtn-w8's decode kernel (float16 operands, K-major codes): bf16 x times the norm's scale, then into float16."""
    from pallas_kernels.int8_f16 import int8_f16_matmul

    x, scales, key = _operands(m, k, n, jnp.bfloat16, seed=2)
    keys = jax.random.split(key, 4)
    q = jax.random.randint(keys[0], (3, n, k), -127, 128).astype(jnp.int8)  # K-major: (N, K) a layer
    s = 0.002 * (1 + jax.random.uniform(keys[1], (3, 1, n)))
    z = jax.random.randint(keys[2], (3, 1, n), -3, 4).astype(jnp.int8) if zp else None
    b = jax.random.normal(keys[3], (n,)) if bias else None
    got = int8_f16_matmul(x, q, s, w_zero_point=z, bias=b, layer=jnp.int32(1), norm=NormFold(scales, EPS),
                          k_splits=splits, interpret=True)
    normed = rms_norm_reference(x, scales[1], EPS).astype(jnp.float32)
    w = (q[1].astype(jnp.float32) - (0 if z is None else z[1].astype(jnp.float32).T)) * s[1].T  # (N, K)
    want = (jnp.dot(normed, w.T, precision="highest") + (0 if b is None else b)).astype(jnp.bfloat16)
    _close(got, want, jnp.bfloat16)
    with pytest.raises(ValueError, match="a folded norm needs bfloat16 x converted in the kernel"):
        int8_f16_matmul(x.astype(jnp.float16), q, s, layer=jnp.int32(1), norm=NormFold(scales, EPS), interpret=True)


@pytest.mark.parametrize("scales", ["powers of two", "bf16 values", "float32 values"])
def test_the_fold_rounds_no_more_than_the_norm_before_the_product(scales):
    """Against float32 math on the same bf16 x and int4 weights: the fold rounds ``x * scale`` (exact for a power of
    two: only the output's own rounding is left), the reference path rounds the norm's output; a float32 scale is
    multiplied in float32 (one rounding), a bf16 one in bf16 (one rounding too)."""
    m, k, n, group = 2, 512, 384, 128
    errors = []
    for trial in range(3):
        keys = jax.random.split(jax.random.key(10 + trial), 5)
        x = (jax.random.normal(keys[0], (m, k)) * 30).astype(jnp.bfloat16)
        g = {"powers of two": jnp.full((2, k), 4.0, jnp.bfloat16),
             "bf16 values": (1 + 0.3 * jax.random.normal(keys[1], (2, k))).astype(jnp.bfloat16),
             "float32 values": 1 + 0.3 * jax.random.normal(keys[1], (2, k))}[scales]
        q = jax.random.randint(keys[2], (2, k, n), -8, 8)
        s = 0.01 * (1 + jax.random.uniform(keys[3], (2, k // group, n)))
        z = jax.random.randint(keys[4], (2, k // group, n), -3, 4).astype(jnp.int8)
        words = pack_words(q, group)
        w = (q[1] - jnp.repeat(z[1], group, 0)) * jnp.repeat(s[1], group, 0)
        truth = jnp.dot(rms_norm_reference(x.astype(jnp.float32), g[1], EPS), w, precision="highest")
        kw = dict(group=group, w_zero_point=z, layer=jnp.int32(1), interpret=True)
        fold = int4_words_matmul(x, words, s, norm=NormFold(g, EPS), **kw)
        apart = int4_words_matmul(rms_norm_reference(x, g[1], EPS), words, s, **kw)
        errors.append([float(jnp.sqrt(jnp.mean(jnp.square(a.astype(jnp.float32) - truth))))
                       for a in (fold, apart, truth.astype(jnp.bfloat16))])
    fold, apart, output = np.mean(errors, 0)
    assert fold <= 1.1 * apart, (fold, apart)
    if scales == "powers of two":
        assert fold <= 1.01 * output < 0.9 * apart, (fold, output, apart)


def test_a_fold_of_one_layer_unstacked():
    """Without ``layer=`` the norm's scale is one (K,) row beside an unstacked weight."""
    x, scales, key = _operands(2, 256, 64, jnp.float32, seed=2)
    w = jax.random.normal(key, (256, 64))
    got = float_matmul(x, w, norm=NormFold(scales[0], EPS), interpret=True)
    _close(got, jnp.dot(rms_norm_reference(x, scales[0], EPS), w, precision="highest"), jnp.float32)


def test_split_sums_apply_the_row_factor_from_every_splits_squares():
    """``common.sum_splits`` with a fold: the partials' sum times rsqrt(sum of the splits' squares / K + eps), then
    the bias -- each split's squares counted (a split left out moves the factor)."""
    parts = jnp.arange(2 * 3 * 1 * 4, dtype=jnp.float32).reshape(3, 1, 2, 4)[:, 0]  # [splits, M, N]
    squares = jnp.asarray([[[1.0], [4.0]], [[2.0], [0.0]], [[5.0], [4.0]]])  # [splits, M, 1]
    bias = jnp.asarray([1.0, 0.0, 0.0, -1.0])
    got = common.sum_splits((parts, squares), 3, bias, jnp.float32, fold=(8, 0.5))
    want = jnp.sum(parts, 0) * jax.lax.rsqrt(jnp.sum(squares, 0) / 8 + 0.5) + bias
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    assert not np.allclose(np.asarray(got), np.asarray(jnp.sum(parts, 0) * jax.lax.rsqrt(squares[0] / 8 + 0.5) + bias))


def test_bad_folds_are_refused_with_what_was_expected():
    x, scales, _ = _operands(1, 128, 32, jnp.float32)
    w = jnp.ones((3, 128, 32))
    with pytest.raises(ValueError, match=r"stack \(L, 128\).*got float32 \(128,\)"):
        float_matmul(x, w, layer=0, norm=NormFold(scales[0], EPS), interpret=True)
    with pytest.raises(ValueError, match=r"float \(128,\).*got float32 \(3, 128\)"):
        float_matmul(x, w[0], norm=NormFold(scales, EPS), interpret=True)
    with pytest.raises(ValueError, match="eps must be > 0, got 0"):
        float_matmul(x, w[0], norm=NormFold(scales[0], 0), interpret=True)
    words = pack_words(jnp.zeros((3, 128, 32), jnp.int8), 128)
    with pytest.raises(ValueError, match=r"int4_words_matmul: the folded norm's scale must be a float \(128,\)"):
        int4_words_matmul(x, words, jnp.ones((3, 1, 32)), group=128, layer=0,
                          norm=NormFold(jnp.ones((3, 64)), EPS), interpret=True)


def test_folding_kernels_lower_for_cuda(cuda_lowering):
    x = jnp.ones((1, 4096), jnp.bfloat16)
    scales = jnp.ones((4, 4096))
    words, s = jnp.zeros((4, 512, 1024), jnp.int32), jnp.ones((4, 32, 1024))
    cuda_lowering(lambda x, w, s, g, i: int4_words_matmul(x, w, s, group=128, layer=i, norm=NormFold(g, EPS)),
                  x, words, s, scales, jnp.int32(1))
    cuda_lowering(lambda x, w, s, g, i: int4_words_matmul(x, w, s, group=128, layer=i, norm=NormFold(g, EPS),
                                                          k_splits=1), x, words, s, scales, jnp.int32(1))
    cuda_lowering(lambda x, w, g, i: float_matmul(x, w, layer=i, norm=NormFold(g, EPS)),
                  x, jnp.ones((4, 4096, 512), jnp.bfloat16), scales.astype(jnp.bfloat16), jnp.int32(3))
    from pallas_kernels.int8_f16 import int8_f16_matmul

    cuda_lowering(lambda x, w, s, g, i: int8_f16_matmul(x, w, s, layer=i, norm=NormFold(g, EPS)),
                  x, jnp.ones((4, 12288, 4096), jnp.int8), jnp.ones((4, 1, 12288)), scales.astype(jnp.bfloat16),
                  jnp.int32(1))
