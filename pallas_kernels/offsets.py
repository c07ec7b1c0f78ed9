"""64-bit pointer offsets for arrays of one-byte elements between 2 and 4 GiB (a Pallas lowering fix).

Why: Pallas's Triton lowering (``_compute_offsets_from_indices``, jax 0.10.2) computes a load's element
offsets in 32 bits unless the array holds more than 2**32 *bytes*, and Triton adds 32-bit offsets to a
pointer as signed numbers. An array of one-byte elements (int8 codes, FP8) with more than 2**31 elements
and at most 2**32 bytes is therefore read through negative offsets past element 2**31: an illegal
address on the GPU. Seen on an H200 (issue #15): rtn-w8 decode of Llama-2-7B shapes, whose fused
gate/up stack is [32, 22016, 4096] int8 (2.9 GB; layers 24-31 lie past 2**31) -- the process's CUDA
context was lost. Wider elements are safe: a 2-byte array below 2**32 bytes has fewer than 2**31
elements.

:func:`install` (run when :mod:`pallas_kernels` is imported) wraps that function so that such arrays
get 64-bit offsets; every other array's lowering is unchanged. :func:`check` is the guard where the
wrap could not be installed (another jax whose lowering has no such function): a kernel launch over
such an array raises a clear error instead of reading out of bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

SIGNED_32_LIMIT = 2**31  # element offsets at or past this wrap negative in 32 bits
LOWERING_32_BIT_BYTES = 2**32  # the lowering takes 32-bit offsets up to this many bytes
_installed = False


def needs_wide_offsets(shape, dtype) -> bool:
    """Whether Pallas's Triton lowering would address an array of this shape and dtype with 32-bit offsets
    that wrap: more than 2**31 elements in at most 2**32 bytes (one-byte elements)."""
    elements = math.prod(shape)
    return elements > SIGNED_32_LIMIT and elements * np.dtype(dtype).itemsize <= LOWERING_32_BIT_BYTES


def _wide(compute_offsets):
    @functools.wraps(compute_offsets)
    def compute(block_info, nd_indexer, *args, **kwargs):
        full = block_info.full_shape_dtype
        if needs_wide_offsets(full.shape, full.dtype):
            # the lowering sizes the offsets by the array's bytes: the same shape with 8-byte elements
            # (only the width is taken from it; strides and the pointer's element type are not)
            block_info = dataclasses.replace(block_info, full_shape_dtype=full.update(dtype=np.dtype(np.int64)))
        return compute_offsets(block_info, nd_indexer, *args, **kwargs)

    compute.wide_offsets = True
    return compute


def install() -> bool:
    """Wrap the Triton lowering's offset computation (once); whether the wrap is in place."""
    global _installed
    if _installed:
        return True
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:  # a jaxlib without the Triton lowering: no Pallas GPU kernels to fix
        return False
    compute_offsets = getattr(lowering, "_compute_offsets_from_indices", None)
    if compute_offsets is None:
        return False
    if not getattr(compute_offsets, "wide_offsets", False):
        lowering._compute_offsets_from_indices = _wide(compute_offsets)
    _installed = True
    return True


def installed() -> bool:
    return _installed


def check(operands, name: str) -> None:
    """Raise a clear error where a kernel would read an operand through wrapping 32-bit offsets (the fix
    could not be installed in this jax)."""
    if _installed:
        return
    for i, a in enumerate(operands):
        if needs_wide_offsets(a.shape, a.dtype):
            raise ValueError(
                f"{name}: operand {i} {tuple(a.shape)} {np.dtype(a.dtype).name} has more than 2**31 one-byte "
                f"elements, which this jax's Pallas lowering addresses with 32-bit offsets (reads past 2 GiB "
                f"would wrap: an illegal address); keep such arrays below 2**31 elements (e.g. split the stack)")


__all__ = ["check", "install", "installed", "needs_wide_offsets"]
