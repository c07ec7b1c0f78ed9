"""The Triton IR (TTIR) that Pallas emits for a kernel lowered for CUDA, as text.

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` runs Pallas's Triton lowering on a
CPU-only jaxlib, but keeps each kernel's module only as bytecode inside the custom call. This module
captures the modules as they are built, for tests that check what reaches Triton (e.g. the FP8
dot's ``maxNumImpreciseAcc``) and for ``scripts/kernel_sass.py``, which compiles them to SASS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

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


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One Pallas kernel as handed to Triton: its TTIR text, launch grid and compiler params."""

    name: str
    ttir: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int


def _launch_params(lowered: str) -> list[tuple]:
    """(name, grid, num_warps, num_stages) of each Triton custom call in lowered StableHLO text
    (its backend_config prints grid_x/y/z before the module bytes, name and params after them)."""
    grids = re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32", lowered)
    params = re.findall(r'name = "([^"]*)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', lowered)
    return [(name, tuple(map(int, grid)), int(warps), int(stages)) for grid, (name, stages, warps) in zip(grids, params)]


def triton_modules(fn, *args) -> list[TritonKernel]:
    """Every Pallas kernel in ``jax.jit(fn)(*args)`` lowered for CUDA, in order (``args`` may be
    ``jax.ShapeDtypeStruct``s)."""
    modules: list[str] = []
    with _capturing(modules):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    params = _launch_params(lowered)
    if len(params) != len(modules):
        raise RuntimeError(f"found {len(params)} Triton calls in the lowering for {len(modules)} kernels built")
    return [TritonKernel(name, text, grid, warps, stages) for text, (name, grid, warps, stages) in zip(modules, params)]
