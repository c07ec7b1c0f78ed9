import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import ops
from llmeq_jax.core.quantize import Spec, quantize
from pallas_kernels.blocks import Blocks
from tests.pallas_kernels.ptx import run_ptx
from pallas_kernels.weight_only import (
    can_use,
    dequant_int4,
    int4_offset,
    unpack_int4_rows,
    weight_only_matmul,
    weight_only_reference,
)

# (M, K, N, bits, group, symmetric, dtype)
CASES = [
    (1, 100, 70, 8, None, True, jnp.float32),
    (37, 130, 90, 4, 32, False, jnp.float32),
    (5, 127, 33, 4, 64, True, jnp.bfloat16),  # odd K: last packed byte half empty
    (3, 300, 40, 4, 128, False, jnp.float16),
    (20, 64, 33, 8, 32, False, jnp.float32),
    (1, 100, 70, 8, None, True, jnp.bfloat16),  # int8 with half-precision x: no int4 offset folded
    (6, 96, 40, 8, 32, False, jnp.float16),
]


def _qweight(k, n, bits, group, symmetric):
    spec = Spec(bits=bits, granularity="group" if group else "channel", group_size=group, symmetric=symmetric)
    return quantize(jax.random.normal(jax.random.key(3), (k, n)), spec)


@pytest.mark.parametrize("m,k,n,bits,group,symmetric,dtype", CASES)
def test_kernel_matches_reference_and_core(m, k, n, bits, group, symmetric, dtype):
    q = _qweight(k, n, bits, group, symmetric)
    x = jax.random.normal(jax.random.key(4), (m, k)).astype(dtype)
    kw = dict(bits=bits, w_zero_point=q.zero_point, group=group)
    y = weight_only_matmul(x, q.qvalue, q.scale, interpret=True, **kw)
    r = weight_only_reference(x, q.qvalue, q.scale, **kw)
    core = ops.weight_only_xla(x, q)
    assert y.shape == (m, n) and y.dtype == dtype
    y32, r32, c32 = (np.asarray(a, np.float32) for a in (y, r, core))
    scale = float(np.max(np.abs(r32)))
    tight, loose = (1e-6, 1e-5) if dtype == jnp.float32 else (8e-3, 2e-2)
    np.testing.assert_allclose(y32, r32, rtol=tight, atol=tight * scale)
    np.testing.assert_allclose(y32, c32, rtol=loose, atol=loose * scale)


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32), (4, None)])
def test_k_splits_match_one_pass(bits, group):
    """Split-K (decode grids): float32 partial sums, bias added once after the splits."""
    q = _qweight(200, 40, bits, group, False)
    x = jax.random.normal(jax.random.key(5), (3, 200))
    b = jnp.arange(40.0)
    kw = dict(bits=bits, w_zero_point=q.zero_point, group=group, bias=b)
    r = weight_only_reference(x, q.qvalue, q.scale, **kw)
    for splits in (1, 3):
        y = weight_only_matmul(x, q.qvalue, q.scale, k_splits=splits, blocks=Blocks(16, 16, group or 32),
                               interpret=True, **kw)
        np.testing.assert_allclose(y, r, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(r))))


@pytest.mark.parametrize("dequant", ["magic", "fold", "asm"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_bit_pattern_dequant_matches_convert(dequant, dtype, symmetric):
    """Magic-number dequantization (and its folded offset) computes what int->float conversion does,
    over every nibble value, with and without zero points, and K steps spanning two groups."""
    k, n, group = 256, 48, 32
    q = _qweight(k, n, 4, group, symmetric)
    assert set(np.unique(np.asarray(unpack_int4_rows(q.qvalue, k)))) >= set(range(-7, 8))
    x = jax.random.normal(jax.random.key(6), (5, k)).astype(dtype)
    kw = dict(bits=4, w_zero_point=q.zero_point, group=group, interpret=True)
    ref = np.asarray(weight_only_reference(x, q.qvalue, q.scale, bits=4, w_zero_point=q.zero_point, group=group),
                     np.float32)
    for blocks in (None, Blocks(16, 16, 2 * group)):
        y = np.asarray(weight_only_matmul(x, q.qvalue, q.scale, dequant=dequant, blocks=blocks, **kw), np.float32)
        np.testing.assert_allclose(y, ref, rtol=1e-2, atol=1e-2 * float(np.max(np.abs(ref))))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_scaled_dequant_multiplies_the_weights_xla_multiplies(dtype, symmetric):
    """dequant='scaled': each tile dequantized with its scale and zero point, rounded once to x's dtype --
    XLA's path's weights -- and accumulated across groups (K steps of one and of two groups, and the
    256-row prefill blocks)."""
    k, n, group = 256, 48, 32
    q = _qweight(k, n, 4, group, symmetric)
    for m, blocks in ((5, None), (5, Blocks(16, 16, 2 * group)), (300, None)):
        x = jax.random.normal(jax.random.key(6), (m, k)).astype(dtype)
        want = np.asarray(ops.weight_only_xla(x, q), np.float32)
        y = weight_only_matmul(x, q.qvalue, q.scale, bits=4, w_zero_point=q.zero_point, group=group, dequant="scaled",
                               blocks=blocks, interpret=True)
        assert y.dtype == dtype
        np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=8e-3, atol=8e-3 * float(np.max(np.abs(want))))


def test_scaled_dequant_is_refused_where_it_does_not_apply():
    q4, q8 = _qweight(64, 32, 4, 32, False), _qweight(64, 32, 8, 32, False)
    for x, q, bits, group in ((jnp.ones((2, 64)), q4, 4, 32), (jnp.ones((2, 64), jnp.bfloat16), q8, 8, 32)):
        with pytest.raises(ValueError, match="'scaled' those and int4 group scales"):
            weight_only_matmul(x, q.qvalue, q.scale, bits=bits, w_zero_point=q.zero_point, group=group,
                               dequant="scaled", interpret=True)


def test_scaled_prefill_blocks_lower_for_cuda(cuda_lowering):
    sds = jax.ShapeDtypeStruct
    args = [sds((2048, 4096), jnp.bfloat16), sds((2048, 11008), jnp.uint8), sds((32, 11008), jnp.float32),
            sds((32, 11008), jnp.int8)]
    text = cuda_lowering(lambda x, w, s, z: weight_only_matmul(x, w, s, bits=4, w_zero_point=z, group=128,
                                                               dequant="scaled"), *args)
    assert "weight_only_int4_matmul" in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_asm_dequant_ptx_gives_fold_values_for_every_byte(dtype):
    """The inline PTX of dequant='asm' (which runs only on a GPU), emulated instruction by instruction:
    every byte value in every position of a word gives fold's bit patterns, low and high nibbles."""
    from pallas_kernels.weight_only import _ASM_MAGIC, _asm_nibbles

    codes = np.arange(256, dtype=np.uint8)
    low, high = (np.asarray(a).view(np.uint16) for a in dequant_int4(jnp.asarray(codes)[None, :], dtype, "fold"))
    for shift in range(4):  # each byte value at each of the 4 positions (columns) of a packed word
        words = np.roll(codes.reshape(64, 4), shift, axis=1)
        for row in words:
            word = int.from_bytes(row.tobytes(), "little")
            for high_half, want in ((False, low[0]), (True, high[0])):
                regs = run_ptx(_asm_nibbles(high_half, _ASM_MAGIC[jnp.dtype(dtype)]), **{"$2": word})
                r0, r1 = regs["$0"], regs["$1"]
                halves = [r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16]  # elements 0..3, little-endian packing
                assert halves == [int(want[b]) for b in row], (shift, row, high_half)


def test_asm_dequant_lowers_to_inline_ptx(cuda_lowering):
    from pallas_kernels.ttir import triton_modules

    sds = jax.ShapeDtypeStruct
    args = [sds((1, 4096), jnp.bfloat16), sds((2048, 11008), jnp.uint8), sds((32, 11008), jnp.float32)]
    f = lambda x, w, s: weight_only_matmul(x, w, s, bits=4, group=128, dequant="asm")  # noqa: E731
    (kernel,) = triton_modules(f, *args)
    assert kernel.ttir.count("tt.elementwise_inline_asm") == 2 and "lop3.b32" in kernel.ttir
    cuda_lowering(f, *args)


def test_dequant_int4_values_are_exact():
    codes = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8).reshape(16, 16)
    want_low, want_high = (np.asarray(a) for a in dequant_int4(codes, jnp.float32, "convert"))
    assert sorted(set(want_low.ravel())) == list(range(-8, 8))
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        low, high = dequant_int4(codes, dtype, "magic")
        np.testing.assert_array_equal(np.asarray(low, np.float32), want_low)
        np.testing.assert_array_equal(np.asarray(high, np.float32), want_high)
        if dtype != jnp.float32:
            low, high = dequant_int4(codes, dtype, "fold")
            np.testing.assert_array_equal(np.asarray(low, np.float32) - int4_offset(dtype), want_low)
            np.testing.assert_array_equal(np.asarray(high, np.float32) - int4_offset(dtype), want_high)


def test_integer_path_is_exact():
    """Unit scales, integer activations: exactly the integer product of the unpacked int4 values."""
    rng = np.random.default_rng(0)
    k, n = 70, 24
    v = rng.integers(-7, 8, size=(k, n))  # symmetric int4 grid: [-7, 7]
    q = quantize(jnp.asarray(v, jnp.float32), Spec(bits=4, granularity="channel"), scale=jnp.ones((1, n)))
    np.testing.assert_array_equal(q.values(), v)
    xi = rng.integers(-50, 50, size=(4, k))
    y = weight_only_matmul(jnp.asarray(xi, jnp.float32), q.qvalue, q.scale, bits=4, bias=jnp.zeros(n), interpret=True)
    np.testing.assert_array_equal(np.asarray(y), (xi @ v).astype(np.float32))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m,k,n,group", [(1, 4096, 11008, 128), (16, 11008, 4096, None), (2048, 4096, 4096, 64), (3, 130, 90, 32)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_lowers_for_cuda(cuda_lowering, bits, m, k, n, group, dtype):
    groups = 1 if group is None else -(-k // group)
    sds = jax.ShapeDtypeStruct
    wq = sds((k, n), jnp.int8) if bits == 8 else sds((-(-k // 2), n), jnp.uint8)

    def f(x, w, s, z, b):
        return weight_only_matmul(x, w, s, bits=bits, w_zero_point=z, bias=b, group=group)

    cuda_lowering(f, sds((m, k), dtype), wq, sds((groups, n), jnp.float32), sds((groups, n), jnp.int8), sds((n,), dtype))


def test_bad_input_is_rejected_clearly():
    x = jnp.ones((2, 64))
    with pytest.raises(ValueError, match="must be uint8 with 32 rows"):
        weight_only_matmul(x, jnp.zeros((64, 8), jnp.int8), jnp.ones((1, 8)), bits=4, interpret=True)
    with pytest.raises(ValueError, match="'fold' and 'asm' need bfloat16"):
        weight_only_matmul(x, jnp.zeros((32, 8), jnp.uint8), jnp.ones((1, 8)), bits=4, dequant="fold", interpret=True)
    with pytest.raises(ValueError, match="multiple of the group"):
        weight_only_matmul(x, jnp.zeros((32, 8), jnp.uint8), jnp.ones((2, 8)), bits=4, group=32,
                           blocks=Blocks(16, 16, 48), interpret=True)
    with pytest.raises(ValueError, match="bits=3"):
        weight_only_matmul(x, jnp.zeros((64, 8), jnp.int8), jnp.ones((1, 8)), bits=3, interpret=True)
    assert can_use((2, 64), jnp.bfloat16, 4, 64, 128) == (True, "")
    assert not can_use((2, 64), jnp.bfloat16, 2, 64, None)[0]
    assert not can_use((2, 64), jnp.bfloat16, 4, 64, 16)[0]


@pytest.mark.parametrize("dequant", ["magic", "fold"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("zp,strided", [(False, False), (True, False), (True, True)])
def test_bit_pattern_dequant_lowers_for_cuda(cuda_lowering, dequant, dtype, zp, strided):
    m, k, n, group = 4, 4096, 11008, 128
    sds = jax.ShapeDtypeStruct
    z = sds((k // group, n), jnp.int8) if zp else None

    def f(x, w, s, z):
        return weight_only_matmul(x, w, s, bits=4, w_zero_point=z, group=group, dequant=dequant,
                                  strided_x=strided, blocks=Blocks(16, 128, 2 * group))

    cuda_lowering(f, sds((m, k), dtype), sds((k // 2, n), jnp.uint8), sds((k // group, n), jnp.float32), z)


@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, False), (8, None, True), (4, None, True)])
def test_a_layer_of_a_stack_is_read_in_place(bits, group, symmetric):
    """layer=l on stacked weights [L, ...] computes what the kernel computes on layer l alone,
    for a traced layer index too (inside a jit, as in a scan over stacked blocks)."""
    k, n, layers = 96, 40, 3
    qs = [quantize(jax.random.normal(jax.random.key(10 + i), (k, n)),
                   Spec(bits=bits, granularity="group" if group else "channel", group_size=group,
                        symmetric=symmetric)) for i in range(layers)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *qs)
    x = jax.random.normal(jax.random.key(7), (3, k))
    bias = jnp.arange(n, dtype=jnp.float32)
    kw = dict(bits=bits, group=group, bias=bias, interpret=True)

    @jax.jit
    def at_layer(x, stack, layer):
        return weight_only_matmul(x, stack.qvalue, stack.scale, w_zero_point=stack.zero_point, layer=layer, **kw)

    for layer in range(layers):
        q = qs[layer]
        want = weight_only_matmul(x, q.qvalue, q.scale, w_zero_point=q.zero_point, **kw)
        np.testing.assert_array_equal(np.asarray(at_layer(x, stack, jnp.int32(layer))), np.asarray(want))
    with pytest.raises(ValueError, match="must be stacks"):
        weight_only_matmul(x, qs[0].qvalue, qs[0].scale, w_zero_point=qs[0].zero_point, layer=0, **kw)


def test_a_layer_of_a_stack_lowers_for_cuda(cuda_lowering):
    sds = jax.ShapeDtypeStruct
    k, n, layers, group = 4096, 11008, 4, 128

    def f(x, w, s, z, layer):
        return weight_only_matmul(x, w, s, bits=4, w_zero_point=z, group=group, layer=layer)

    cuda_lowering(f, sds((1, k), jnp.bfloat16), sds((layers, k // 2, n), jnp.uint8),
                  sds((layers, k // group, n), jnp.float32), sds((layers, k // group, n), jnp.int8), sds((), jnp.int32))


GEMV_CASES = [  # (M, K, N, bits, group, symmetric, dtype, bias): M <= 4, ragged and whole shapes
    (1, 100, 70, 8, None, True, jnp.float32, False),
    (3, 130, 90, 4, 32, False, jnp.float32, True),
    (4, 127, 33, 4, 64, True, jnp.bfloat16, False),  # odd K
    (2, 300, 40, 4, 128, False, jnp.float16, True),
    (1, 256, 128, 4, 128, False, jnp.bfloat16, False),  # blocks divide every dim: unmasked
    (1, 96, 40, 8, 32, False, jnp.float16, False),
]


@pytest.mark.parametrize("m,k,n,bits,group,symmetric,dtype,bias", GEMV_CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_gemv_matches_reference(m, k, n, bits, group, symmetric, dtype, bias, splits):
    """gemv=True: the multiply-and-sum formulation computes what the dot kernel's reference does."""
    q = _qweight(k, n, bits, group, symmetric)
    x = jax.random.normal(jax.random.key(6), (m, k)).astype(dtype)
    b = jnp.linspace(-1.0, 1.0, n) if bias else None
    kw = dict(bits=bits, w_zero_point=q.zero_point, group=group, bias=b)
    y = weight_only_matmul(x, q.qvalue, q.scale, gemv=True, k_splits=splits, interpret=True, **kw)
    r = weight_only_reference(x, q.qvalue, q.scale, **kw)
    assert y.shape == (m, n) and y.dtype == dtype
    tol = 1e-6 if dtype == jnp.float32 else 8e-3
    y32, r32 = np.asarray(y, np.float32), np.asarray(r, np.float32)
    np.testing.assert_allclose(y32, r32, rtol=tol, atol=tol * float(np.max(np.abs(r32))))


def test_gemv_reads_a_layer_of_a_stack_and_refuses_many_rows():
    qs = [_qweight(128, 64, 4, 32, False) for _ in range(3)]
    stack = [jnp.stack([getattr(q, f) for q in qs]) for f in ("qvalue", "scale", "zero_point")]
    x = jax.random.normal(jax.random.key(7), (2, 128))
    at = jax.jit(lambda x, w, s, z, layer: weight_only_matmul(x, w, s, bits=4, w_zero_point=z, group=32, gemv=True,
                                                              layer=layer, interpret=True))
    for i, q in enumerate(qs):
        want = weight_only_matmul(x, q.qvalue, q.scale, bits=4, w_zero_point=q.zero_point, group=32, gemv=True,
                                  interpret=True)
        np.testing.assert_array_equal(np.asarray(at(x, *stack, jnp.int32(i))), np.asarray(want))
    with pytest.raises(ValueError, match="at most 4 rows"):
        weight_only_matmul(jnp.ones((5, 128)), qs[0].qvalue, qs[0].scale, bits=4, w_zero_point=qs[0].zero_point,
                           group=32, gemv=True, interpret=True)


@pytest.mark.parametrize("bits,m,k,n,group", [(4, 1, 4096, 11008, 128), (8, 4, 11008, 4096, None), (4, 3, 130, 90, 32)])
def test_gemv_lowers_for_cuda(cuda_lowering, bits, m, k, n, group):
    sds = jax.ShapeDtypeStruct
    rows, dt = (k, jnp.int8) if bits == 8 else (-(-k // 2), jnp.uint8)
    groups = 1 if group is None else -(-k // group)
    args = [sds((m, k), jnp.bfloat16), sds((rows, n), dt), sds((groups, n), jnp.float32)]
    text = cuda_lowering(lambda x, w, s: weight_only_matmul(x, w, s, bits=bits, group=group, gemv=True), *args)
    assert "gemv" in text
