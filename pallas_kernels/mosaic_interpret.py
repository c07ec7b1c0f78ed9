"""What GPU interpret mode of this JAX's Mosaic GPU backend lacks, for the kernels here.

Mosaic GPU kernels (``plgpu.kernel``) run on a CPU in GPU interpret mode (``plgpu.InterpretGPUParams``), which
simulates shared memory, warpgroups, barriers and TMA copies. Its ``wgmma`` reads each operand through index
transforms only: an operand viewed through ``plgpu.transpose_ref`` -- how an int8 wgmma's B operand is given, since
int8 wgmma takes K-major operands only -- fails with ``'TransposeTransform' object has no attribute 'indices'``
(jax 0.10.2), and an A operand in registers -- how :mod:`pallas_kernels.decode_hopper` gives its dequantized
weights -- reaches the callback as the array itself, which it reads as a buffer's key (``Expected shape (5,)``).
:func:`install` replaces that one callback with one that takes a register operand as it is and reads a buffer
through its index transforms, then transposes it as the trailing transposes say. A canary test
(``tests/pallas_kernels/test_w8a8_hopper.py``) fails once JAX's own interpreter takes a transposed operand.

It also compiles each simulated thread's program once: the interpreter runs a kernel's warpgroups as one jaxpr on
several host threads, and lowered and compiled that jaxpr again in every thread of every call (``Lowered.compile``
misses JAX's in-memory caches): ~90 % of a small kernel's time in interpret mode (2.3 s a call -> 0.15 s). :func:`install` keeps the compiled
program per (jaxpr, argument types), so a kernel's threads and later calls reuse it.
"""

from __future__ import annotations

import functools
import threading

import jax
import numpy as np


def _split_transposes(transforms) -> tuple[tuple, list[tuple[int, ...]]]:
    """(the index transforms, the permutations of the trailing transposes, innermost last)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.state import types as state_types

    rest = list(gpu_callbacks._remove_noop_transforms(transforms))
    perms = []
    while rest and isinstance(rest[-1], state_types.TransposeTransform):
        perms.insert(0, rest.pop().permutation)
    if any(isinstance(t, state_types.TransposeTransform) for t in rest):
        raise NotImplementedError("GPU interpret mode: a wgmma operand indexed after a transpose")
    return tuple(rest), perms


def _wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms, acc_dtype,
           a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms, source_info=None):
    """The interpreter's wgmma (acc += a @ b, synchronously), with operands that may be transposed views."""
    from jax._src.pallas.mosaic.interpret import utils
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as callbacks

    device_id, thread_id = int(device_id), int(thread_id)
    memory = callbacks._get_shared_memory()
    thread = memory.get_global_thread_id(device_id, thread_id)
    info = utils.GPULoggingInfo(device_id=device_id, grid_point_coords=tuple(int(c) for c in grid_point_coords),
                                thread_id=thread_id, source_info=source_info)

    def read(key, transforms):
        indices, perms = _split_transposes(jax.tree.map(int, transforms))
        value, _, _ = memory.get_buffer_content(callbacks.HostAllocationKey.from_array(key), utils.to_range(indices),
                                                thread, logging_info=info)
        for perm in perms:
            value = np.transpose(value, perm)
        return value

    # a wgmma's A operand may be registers (an array: the weights dequantized by the warpgroup), not a buffer
    register_a = np.ndim(a_allocation_key_as_array) == 2
    a = np.asarray(a_allocation_key_as_array) if register_a else read(a_allocation_key_as_array, a_transforms)
    b = read(b_allocation_key_as_array, b_transforms)
    acc_key = callbacks.HostAllocationKey.from_array(acc_allocation_key_as_array)
    acc_range = utils.to_range(jax.tree.map(int, callbacks._remove_noop_transforms(acc_transforms)))
    acc, _, _ = memory.get_buffer_content(acc_key, acc_range, thread, logging_info=info)
    memory.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype), thread, logging_info=info)
    return token


_THREAD_PROGRAMS: dict = {}  # (jaxpr, argument types) -> its compiled program
_THREAD_PROGRAMS_LOCK = threading.Lock()
_MAX_THREAD_PROGRAMS = 512  # a test process interprets a few hundred kernels; past this, start afresh


def _types(values) -> tuple:
    return tuple((np.shape(v), v.dtype) for v in values)  # NumPy arrays and the thread id: all have one


def _thread_program(jaxpr, consts, args):
    """The compiled program of one simulated thread's ``jaxpr`` (the interpreter's ``eval_jaxpr`` of it), made once
    per argument types; the jaxpr is kept by the key, so its identity is not reused while the entry lives."""
    from jax._src import core

    const_types, arg_types = _types(consts), _types(args)
    key = (jaxpr, const_types, arg_types)
    with _THREAD_PROGRAMS_LOCK:  # a kernel's threads ask at once: one compiles, the others wait for it
        program = _THREAD_PROGRAMS.get(key)
        if program is None:
            if len(_THREAD_PROGRAMS) >= _MAX_THREAD_PROGRAMS:
                _THREAD_PROGRAMS.clear()
            shapes = lambda types: [jax.ShapeDtypeStruct(s, d) for s, d in types]  # noqa: E731
            run = lambda c, *a: core.eval_jaxpr(jaxpr, c, *a)  # noqa: E731  returns nothing: effects only
            program = jax.jit(run).trace(shapes(const_types), *shapes(arg_types)).lower().compile()
            _THREAD_PROGRAMS[key] = program
    return program


def _run_thread(jaxpr, consts, *args) -> None:
    """The interpreter's ``thread_map._run_jaxpr``: one simulated thread's jaxpr, its program compiled once."""
    _thread_program(jaxpr, consts, args)(list(consts), *args)


@functools.cache
def install() -> None:
    """Let GPU interpret mode's wgmma take transposed operands, and compile each simulated thread's program once
    (once per process)."""
    from jax._src.pallas.mosaic.interpret import thread_map
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    gpu_callbacks.wgmma = _wgmma  # looked up by the interpreter at each wgmma it runs
    thread_map._run_jaxpr = _run_thread  # looked up by the thread-map callback for each thread it starts
