"""The int4 word layout and its decode kernel (interpret mode; the PTX emulated; lowering for CUDA)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import int4_words as iw
from pallas_kernels.blocks import Blocks
from tests.pallas_kernels.ptx import check_word_pair_asm


def _values(k, n, seed=0, lead=()):
    return jnp.asarray(np.random.default_rng(seed).integers(-8, 8, (*lead, k, n)), jnp.int8)


@settings(max_examples=25, deadline=None)
@given(k=st.integers(1, 300), n=st.integers(1, 9), group=st.sampled_from([None, 32, 64, 128, 256]),
       layers=st.sampled_from([(), (2,)]))
def test_words_round_trip_for_any_shape(k, n, group, layers):
    q = _values(k, n, k * 31 + n, layers)
    words = iw.pack_words(q, group)
    assert words.dtype == jnp.int32 and words.shape == (*layers, iw.word_rows(k, group), n)
    np.testing.assert_array_equal(np.asarray(iw.unpack_words(words, k)), np.asarray(q))


def test_word_layout_puts_k_row_128b_16j_i_in_nibble_j_of_word_row_16b_i():
    k, n = 300, 3
    q = _values(k, n, 1)
    words = np.asarray(iw.pack_words(q)).view(np.uint32)
    for row in (0, 5, 127, 128, 150, 299):
        b, rest = divmod(row, 128)
        j, i = divmod(rest, 16)
        code = (words[16 * b + i] >> (4 * j)) & 15
        np.testing.assert_array_equal(code.astype(np.int32) - 8, np.asarray(q[row], np.int32))
    # K padded to whole steps with zero values (code 8)
    assert ((words[16 * 2 + 12:] >> 28) & 15 == 8).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_nibbles_are_the_values_plus_the_offset_exactly(dtype):
    q = _values(128, 16, 2)
    words = iw.pack_words(q)
    got = np.stack([np.asarray(iw.nibbles(words, j, dtype), np.float32) for j in range(8)])  # [j, i, n]
    want = np.asarray(q, np.float32).reshape(8, 16, 16)  # K row 16 j + i
    np.testing.assert_array_equal(got - iw.code_offset(dtype), want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_nibble_ptx_gives_the_jnp_bit_patterns_for_every_byte(dtype):
    """The inline PTX (which runs only on a GPU), emulated: for each nibble position, every byte value of
    one word paired with every byte value of the other gives :func:`nibbles`' two bit patterns."""
    for j in range(8):
        check_word_pair_asm(iw.nibble_asm(j, dtype), lambda w, j=j: iw.nibbles(jnp.asarray(w), j, dtype), j // 2)


CASES = [  # (m, k, n, group, zero point, bias, dtype, k_splits)
    (1, 256, 64, 128, False, False, jnp.bfloat16, None),
    (3, 576, 48, 128, True, True, jnp.bfloat16, None),  # K not a whole number of word blocks
    (16, 512, 40, 32, True, False, jnp.float16, 2),  # ragged N, groups shorter than a word block
    (5, 300, 32, None, True, True, jnp.bfloat16, None),  # per-channel scales, ragged K
    (20, 1024, 128, 256, False, False, jnp.float32, 3),  # two row blocks, steps of two word blocks
    (2, 640, 64, 64, True, False, jnp.float32, None),
]


def _weights(k, n, group, zp, seed=3, lead=()):
    rng = np.random.default_rng(seed)
    groups = 1 if group is None else -(-k // group)
    q = _values(k, n, seed, lead)
    scale = jnp.asarray(rng.uniform(0.005, 0.02, (*lead, groups, n)), jnp.float32)
    zero = jnp.asarray(rng.integers(-3, 4, (*lead, groups, n)), jnp.int8) if zp else None
    return iw.pack_words(q, group), scale, zero


@pytest.mark.parametrize("m,k,n,group,zp,bias,dtype,splits", CASES)
def test_kernel_matches_reference(m, k, n, group, zp, bias, dtype, splits):
    words, scale, zero = _weights(k, n, group, zp)
    x = jax.random.normal(jax.random.key(m), (m, k)).astype(dtype)
    b = jnp.linspace(-1, 1, n) if bias else None
    got = iw.int4_words_matmul(x, words, scale, group=group, w_zero_point=zero, bias=b, k_splits=splits,
                               interpret=True)
    want = iw.int4_words_reference(x, words, scale, group=group, w_zero_point=zero, bias=b)
    assert got.dtype == x.dtype and got.shape == (m, n)
    tol = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
                               atol=tol * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))


@pytest.mark.parametrize("k, group, bk, splits", [(1024, 128, 512, None), (700, 128, 256, None), (576, 64, 256, 2),
                                                  (300, None, 512, None)])
def test_k_steps_of_several_word_blocks_match_the_reference(k, group, bk, splits):
    """``blocks.bk`` a power-of-two multiple of k_step: the loop takes several word blocks an iteration, its
    last step running past the words (K padded to k_step only: 700 and 300 here) reads zeros there."""
    words, scale, zero = _weights(k, 48, group, True, seed=k)
    x = jax.random.normal(jax.random.key(k), (2, k)).astype(jnp.bfloat16)
    got = iw.int4_words_matmul(x, words, scale, group=group, w_zero_point=zero, blocks=Blocks(16, 32, bk, 4, 3),
                               k_splits=splits, interpret=True)
    want = iw.int4_words_reference(x, words, scale, group=group, w_zero_point=zero)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2,
                               atol=1e-2 * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))


def test_kernel_reads_one_layer_of_a_stack_in_place():
    words, scale, zero = _weights(256, 64, 128, True, lead=(3,))
    x = jax.random.normal(jax.random.key(9), (2, 256)).astype(jnp.bfloat16)
    at = jax.jit(lambda x, w, s, z, i: iw.int4_words_matmul(x, w, s, group=128, w_zero_point=z, layer=i,
                                                            interpret=True))
    for i in range(3):
        want = iw.int4_words_matmul(x, words[i], scale[i], group=128, w_zero_point=zero[i], interpret=True)
        np.testing.assert_array_equal(np.asarray(at(x, words, scale, zero, jnp.int32(i)), np.float32),
                                      np.asarray(want, np.float32))


def test_bad_inputs_are_refused_with_what_was_expected():
    words, scale, _ = _weights(256, 32, 128, False)
    x = jnp.ones((1, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"must be int32 with 32 rows \(pack_words\)"):
        iw.int4_words_matmul(x, words[:16], scale, group=128, interpret=True)
    with pytest.raises(ValueError, match="must be int32"):
        iw.int4_words_matmul(x, words.astype(jnp.uint32), scale, group=128, interpret=True)
    with pytest.raises(ValueError, match="group size must be a power of two >= 32"):
        iw.int4_words_matmul(x, words, scale, group=16, interpret=True)
    with pytest.raises(ValueError, match=r"w_scale has shape \(1, 32\), expected \(2, 32\)"):
        iw.int4_words_matmul(x, words, scale[:1], group=128, interpret=True)
    with pytest.raises(ValueError, match=r"the K block must be 128 \(k_step\(group=128\)\) times a power of two"):
        iw.int4_words_matmul(x, words, scale, group=128, blocks=Blocks(16, 64, 384), interpret=True)
    with pytest.raises(ValueError, match="x must be float32/bfloat16/float16"):
        iw.int4_words_matmul(x.astype(jnp.int32), words, scale, group=128, interpret=True)


def test_kernel_lowers_for_cuda_with_the_nibble_ptx(cuda_lowering):
    from pallas_kernels.ttir import triton_modules

    sds = jax.ShapeDtypeStruct
    args = [sds((1, 4096), jnp.bfloat16), sds((iw.word_rows(4096, 128), 11008), jnp.int32),
            sds((32, 11008), jnp.bfloat16), sds((32, 11008), jnp.int8)]
    f = lambda x, w, s, z: iw.int4_words_matmul(x, w, s, group=128, w_zero_point=z)  # noqa: E731
    (kernel,) = triton_modules(f, *args)
    # eight nibble positions, each one two-word asm call feeding a dot, and a dot for x's row sums
    assert kernel.ttir.count("tt.elementwise_inline_asm") == 8 and "packed_element = 2" in kernel.ttir
    assert kernel.ttir.count("tt.dot") == 16 and "prmt.b32" in kernel.ttir
    cuda_lowering(f, *args)


@pytest.mark.parametrize("group, zp, carried", [(128, True, 2), (64, True, 4), (64, False, 2), (256, False, 1),
                                                (None, True, 0)])
def test_scale_rows_are_read_one_k_step_ahead(group, zp, carried):
    """The K loop carries the next step's scale (and zero-point) rows, one (1, N-tile) row per scale group
    of the step: read where they were used, they compiled to synchronous global loads in every
    iteration (sm_90 SASS). Per channel (one row for all of K, read before the loop) carries none."""
    import re

    from pallas_kernels.ttir import triton_modules

    k, n = 768, 256
    sds = jax.ShapeDtypeStruct
    groups = 1 if group is None else -(-k // group)
    args = [sds((1, k), jnp.bfloat16), sds((iw.word_rows(k, group), n), jnp.int32), sds((groups, n), jnp.float32)]
    if zp:
        args.append(sds((groups, n), jnp.int8))
    f = lambda x, w, s, *z: iw.int4_words_matmul(x, w, s, group=group, w_zero_point=z[0] if z else None)  # noqa
    (kernel,) = triton_modules(f, *args)
    (results,) = re.findall(r"scf\.for .*?-> \((.*?)\)\s*:", kernel.ttir)
    types = [t.strip() for t in results.split(", tensor")]
    assert len(types) == 1 + carried and all(re.search(r"1x\d+xf32", t) for t in types[1:]), results


@pytest.mark.parametrize("m,k,n,group,zp,dtype,bk", [(1, 256, 64, 128, True, jnp.bfloat16, 128),
                                                     (3, 700, 48, 128, True, jnp.bfloat16, 256),
                                                     (16, 512, 40, 32, True, jnp.float16, 128),
                                                     (5, 640, 64, 64, False, jnp.float32, 128),
                                                     (2, 300, 32, None, True, jnp.bfloat16, 128)])
def test_mma_epilogue_matches_the_reference(m, k, n, group, zp, dtype, bk):
    """epilogue="mma": scale and zero-point rows taken into the accumulator's layout by dots (the rows in x's
    dtype: bf16 / f16 scales round, float32 ones are exact); per channel it is the "rows" epilogue."""
    words, scale, zero = _weights(k, n, group, zp, seed=k + m)
    x = jax.random.normal(jax.random.key(k), (m, k)).astype(dtype)
    blocks = iw.default_blocks(m, n, group)
    blocks = Blocks(blocks.bm, blocks.bn, max(bk, blocks.bk), blocks.num_warps, blocks.num_stages)
    got = iw.int4_words_matmul(x, words, scale, group=group, w_zero_point=zero, blocks=blocks, epilogue="mma",
                               k_splits=2, interpret=True)
    want = iw.int4_words_reference(x, words, scale, group=group, w_zero_point=zero)
    tol = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
                               atol=tol * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))
    with pytest.raises(ValueError, match=r"epilogue must be one of \('rows', 'mma'\), got 'dots'"):
        iw.int4_words_matmul(x, words, scale, group=group, w_zero_point=zero, epilogue="dots", interpret=True)


@pytest.mark.parametrize("zp", [True, False])
def test_mma_epilogue_reads_its_rows_as_dot_tiles_and_carries_none(zp):
    """The "mma" epilogue loads each group's scale (and zero-point) row as a masked 16-row tile feeding a dot
    (two more dots a group), and the K loop carries only the accumulator: no (1, N-tile) row loads."""
    import re

    from pallas_kernels.ttir import triton_modules

    k, n, group = 768, 256, 128
    sds = jax.ShapeDtypeStruct
    args = [sds((1, k), jnp.bfloat16), sds((iw.word_rows(k, group), n), jnp.int32), sds((k // group, n), jnp.float32)]
    if zp:
        args.append(sds((k // group, n), jnp.int8))
    f = lambda x, w, s, *z: iw.int4_words_matmul(x, w, s, group=group, w_zero_point=z[0] if z else None,  # noqa
                                                 epilogue="mma")
    (kernel,) = triton_modules(f, *args)
    (results,) = re.findall(r"scf\.for .*?-> \((.*?)\)\s*:", kernel.ttir)
    assert results.count("tensor") == 1, results  # the accumulator alone
    assert kernel.ttir.count("tt.dot") == 16 + 1 + zp
    assert not re.search(r"tt\.load .*tensor<1x\d+x", kernel.ttir)


@pytest.mark.parametrize("m,k,n,group,zp,bias,dtype,splits", CASES)
def test_xla_formulation_matches_reference(m, k, n, group, zp, bias, dtype, splits):
    """int4_words_xla (the words' product in XLA ops, one reduction) for every case the kernel takes."""
    words, scale, zero = _weights(k, n, group, zp)
    x = jax.random.normal(jax.random.key(m), (m, k)).astype(dtype)
    b = jnp.linspace(-1, 1, n) if bias else None
    got = jax.jit(lambda *a: iw.int4_words_xla(*a, group=group, w_zero_point=zero, bias=b))(x, words, scale)
    want = iw.int4_words_reference(x, words, scale, group=group, w_zero_point=zero, bias=b)
    assert got.dtype == x.dtype and got.shape == (m, n)
    tol = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
                               atol=tol * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))


def test_xla_formulation_reads_a_layer_of_a_stack():
    words, scale, zero = _weights(256, 64, 64, True, lead=(3,))
    x = jax.random.normal(jax.random.key(9), (2, 256))
    at = jax.jit(lambda x, w, s, z, i: iw.int4_words_xla(x, w, s, group=64, w_zero_point=z, layer=i))
    for i in range(3):
        want = iw.int4_words_reference(x, words[i], scale[i], group=64, w_zero_point=zero[i])
        np.testing.assert_allclose(at(x, words, scale, zero, jnp.int32(i)), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="w_scale has shape"):
        iw.int4_words_xla(x, words[0], scale[0][:1], group=64)
