"""scripts/probe_words.py: the word kernel's launch with less work a K step (interpret mode, lowering for CUDA),
so that the GPU minutes it is written for time what it says."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import int4_words as iw
from pallas_kernels.blocks import Blocks
from pallas_kernels.ttir import triton_modules
from tests.scripts_loader import load_script



@pytest.fixture(scope="module")
def probe():
    return load_script("probe_words")


def _words(k, n, seed=0):
    values = jnp.asarray(np.random.default_rng(seed).integers(-8, 8, (k, n)), jnp.int8)
    return values, iw.pack_words(values, 128)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("work", ["loads", "nibbles", "sums"])
def test_each_probe_computes_its_reference(probe, work, splits, dtype):
    values, words = _words(384, 256)
    x = jax.random.normal(jax.random.key(1), (3, 384)).astype(dtype)
    got = probe.probe(x, words, work=work, k_splits=splits, blocks=Blocks(16, 128, 128, 4, 3), interpret=True)
    want = probe.probe_reference(x, words, work=work)
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    # bf16 output rounding; "sums" also loses bits to the offset's cancellation (128 + 8 per value in bf16)
    tol = 1e-5 if dtype == jnp.float32 else (1e-3 if work == "sums" else 8e-3)
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=tol * scale)
    if work == "sums":  # the offset taken off leaves the int4 product itself
        exact = x.astype(jnp.float32) @ values.astype(jnp.float32)
        np.testing.assert_allclose(want.astype(jnp.float32), exact, atol=1e-2 * scale)
    else:  # the other probes keep the offset: a value of ~(MAGIC + 8) * sum(x) that the product cannot be
        assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - x.astype(jnp.float32) @ values.astype(jnp.float32)))) > 1


def test_probe_refuses_what_its_launch_does_not_cover(probe):
    _, words = _words(256, 128)
    x = jnp.ones((1, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="work must be one of"):
        probe.probe(x, words, work="all", interpret=True)
    with pytest.raises(ValueError, match="K a multiple of 128"):
        probe.probe(jnp.ones((1, 200), jnp.bfloat16), words[:25], work="loads", interpret=True)
    with pytest.raises(ValueError, match="K steps of 128"):
        probe.probe(x, words, work="loads", blocks=Blocks(16, 128, 256, 4, 3), interpret=True)


@pytest.mark.parametrize("work, dots, asm", [("loads", 1, 1), ("nibbles", 8, 8), ("sums", 16, 8)])
def test_probes_lower_for_cuda_with_the_kernels_loads_and_less_work(probe, cuda_lowering, work, dots, asm):
    """Same launch as the word kernel (grid, K splits), each K step a word tile and ``dots`` dots."""
    sds = jax.ShapeDtypeStruct
    args = (sds((1, 4096), jnp.bfloat16), sds((512, 11008), jnp.int32))
    f = lambda x, w: probe.probe(x, w, work=work)  # noqa: E731
    (kernel,) = triton_modules(f, *args)
    assert kernel.ttir.count("tt.dot") == dots and kernel.ttir.count("tt.elementwise_inline_asm") == asm
    scales = sds((32, 11008), jnp.bfloat16)
    (words_kernel,) = triton_modules(lambda x, w, s: iw.int4_words_matmul(x, w, s, group=128), *args, scales)
    assert kernel.grid == words_kernel.grid and kernel.num_stages == words_kernel.num_stages
    cuda_lowering(f, *args)


def test_other_launches_differ_from_the_default(probe):
    d = iw.default_blocks(1, 11008, 128)
    launches = probe.launches(4096, 11008)
    assert {"splits 1", "2 stages", "4 stages", "8 warps", "128 columns"} <= set(launches)
    assert all(kw.get("blocks", d) != d or "k_splits" in kw for kw in launches.values())
    assert len({kw.get("k_splits") for kw in launches.values()} - {None}) == 3  # x0.5, x2 and none
