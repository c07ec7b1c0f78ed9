"""pallas_kernels.offsets: one-byte arrays of 2-4 GiB are addressed with 64-bit offsets in the kernels'
Triton IR (lowered for CUDA here, from shapes alone: no memory), every other array as before."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import offsets
from pallas_kernels.ttir import triton_modules
from pallas_kernels.w8a8 import w8a8_matmul
from pallas_kernels.weight_only import weight_only_matmul

S = jax.ShapeDtypeStruct
K = 4096


@pytest.mark.parametrize("shape, dtype, wide", [
    ((2**31,), jnp.int8, False),  # the last offset, 2**31 - 1, fits
    ((2**31 + 1,), jnp.int8, True),
    ((2**32,), jnp.int8, True),  # 2**32 bytes: still 32-bit offsets in the lowering
    ((2**32 + 1,), jnp.int8, False),  # past 2**32 bytes the lowering takes 64 bits itself
    ((32, 22016, 4096), jnp.int8, True),  # Llama-2-7B's fused gate/up, int8 K-major
    ((32, 11008, 4096), jnp.int8, False),  # one of them: 1.4 GB
    ((2**31 + 1,), jnp.bfloat16, False),  # two-byte elements: past 2**32 bytes
])
def test_which_arrays_need_wide_offsets(shape, dtype, wide):
    assert offsets.needs_wide_offsets(shape, dtype) == wide


def _int8_pointer_offsets(fn, *args) -> set[str]:
    """The offset element types of every ``tt.addptr`` on an i8 pointer tensor in ``fn``'s kernels."""
    ttir = "\n".join(k.ttir for k in triton_modules(fn, *args))
    found = set(re.findall(r"tt\.addptr .*: tensor<[0-9x]*!tt\.ptr<i8>>, tensor<[0-9x]*(i32|i64)>", ttir))
    assert found, "no int8 weight tile load found in the kernel's TTIR"
    return found


KERNELS = {  # the decode step's int8 products of a stacked K-major layer
    "w8_nk": lambda x, w, s, l: weight_only_matmul(x, w, s, bits=8, layer=l, w_layout="nk"),
    "int8_f16": lambda x, w, s, l: weight_only_matmul(x, w, s, bits=8, layer=l, w_layout="nk", dequant="f16"),
    "w8a8_nk": lambda x, w, s, l: w8a8_matmul(x, w, s, layer=l, w_layout="nk"),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("n, width", [(22016, "i64"), (11008, "i32")])
def test_int8_stacks_past_2gib_get_64_bit_offsets(kernel, n, width):
    args = (S((1, K), jnp.bfloat16), S((32, n, K), jnp.int8), S((32, 1, n), jnp.float32), S((), jnp.int32))
    found = _int8_pointer_offsets(KERNELS[kernel], *args)
    # past 2 GiB the weight tiles' offsets are 64-bit (W8A8's x codes, a small int8 array, stay 32-bit);
    # below, nothing changed: all 32-bit
    assert width in found if width == "i64" else found == {"i32"}


def test_without_the_fix_a_launch_over_such_an_array_is_refused(monkeypatch):
    assert offsets.installed()  # importing pallas_kernels installed it
    big = S((32, 22016, K), jnp.int8)
    offsets.check([S((1, K), jnp.bfloat16), big], "k")  # installed: nothing to refuse
    monkeypatch.setattr(offsets, "_installed", False)
    offsets.check([S((32, 11008, K), jnp.int8)], "k")  # below 2**31 elements: fine either way
    with pytest.raises(ValueError, match=r"k: operand 1 \(32, 22016, 4096\) int8 .* 32-bit offsets"):
        offsets.check([S((1, K), jnp.bfloat16), big], "k")
    def launch(x, w, s, l):  # a function not traced before (a traced one's checks ran then)
        return weight_only_matmul(x, w, s, bits=8, layer=l, w_layout="nk")

    with pytest.raises(ValueError, match="32-bit offsets"):  # a kernel's launch checks its operands
        jax.eval_shape(launch, S((1, K), jnp.bfloat16), big, S((32, 1, 22016), jnp.float32), S((), jnp.int32))
    assert np.dtype(big.dtype).itemsize == 1
