"""The Triton IR (TTIR) that Pallas emits for a kernel lowered for CUDA, as text.

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` runs Pallas's Triton lowering on a
CPU-only jaxlib, but keeps each kernel's module only as bytecode inside the custom call. This module
captures the modules as they are built, for tests that check what reaches Triton (e.g. the FP8
dot's ``maxNumImpreciseAcc``) and for ``scripts/kernel_sass.py``, which compiles them to SASS.
"""

from __future__ import annotations

import contextlib

import jax


@contextlib.contextmanager
def _capturing(out: list[str]):
    # Pallas keeps no public hook on its Triton lowering; wrap the function for the duration only.
    from jax._src.pallas.triton import pallas_call_registration as registration

    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        out.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower


def triton_modules(fn, *args) -> list[str]:
    """The TTIR text of every Pallas kernel in ``jax.jit(fn)(*args)`` lowered for CUDA, in order
    (``args`` may be ``jax.ShapeDtypeStruct``s)."""
    modules: list[str] = []
    with _capturing(modules):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return modules
