"""A split-K product's partial sums added by the kernel itself: the last program of each output tile adds them.

Why: at decode rows a matmul kernel splits its K loop over programs to fill the GPU, and the float32 partial sums
``[splits, M, N]`` were added by XLA afterwards (``common.sum_splits``), which, with what follows the product (the
cast, a bias, a norm's row factor, a residual add), is a kernel launch of its own after every product: four of a
Llama decode layer's 11 launches (deviceless H100 compile, rtn-w4-g128). Here each program writes its partial sum,
counts itself in with an atomic add on its tile's counter, and the program that counts last -- the others' partials
are all written by then -- adds the splits in their order (the same sum whichever program is last: deterministic),
applies the epilogue (norm factor, bias, residual) and writes the finished tile; it then sets the counter back to
zero. The fix-up of CUTLASS's serial split-K and of stream-K's tiles, without their spin waits: nothing waits on a
program that may not have started.

Memory order: every thread's partial store comes before a barrier, the count after it is one thread's
``atom.acq_rel.gpu`` (Triton's scalar atomic, its result broadcast through shared memory), and the last program
reads the partials with volatile loads (not L1's copy of an earlier call's).

The counters are an int32 buffer that must be zero when a kernel starts. A fresh zero buffer for every launch would
be a launch of its own (XLA's broadcast fusion, deviceless compile), so one buffer of :data:`CAPACITY` counters is
threaded through a scan's layers (``models.stacked.scan_blocks``): :func:`scope` holds it while a layer is traced,
each kernel takes it (:func:`take`) as an input aliased to an output and hands the output back (:func:`give`), every
kernel leaving it zero as it found it. Outside a scope (or traced at another level than the scope's, e.g. inside a
nested loop) the kernels write their partials for ``common.sum_splits`` as before.

The kernels that finish their products so: the float, int4 word and int8 matmul kernels (``common.launch_matmul``:
bias, a folded norm's factor, a residual, a SwiGLU gate -- ``common.store_matmul``) and the float cache's decode
attention (``decode_attention``: the splits' softmax merge).

On a GPU it runs where :func:`wanted` (the scan then carries the counters): it has not run on one yet, so only where
``LLMEQ_UNCHECKED_KERNELS`` names ``split_fixup`` (``pallas_kernels.hardware_checked``); the setting ``reduce=xla``
of a kernel (``pallas_kernels.settings``) keeps its sums in XLA (A/B runs).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import config
from pallas_kernels.common import load_tile, store_tile, tile_mask

# Counters the threaded buffer holds: one per output tile of a launch (a 7B model's widest decode product,
# 12288 or 22016 columns in 256-column tiles, has under 100; the float cache's attention, one a batch row and kv
# head: 512 at batch 16 over 32 heads). A launch with more tiles sums in XLA.
CAPACITY = 1024


class _Held:
    """The counters while a layer is traced, and the trace they belong to."""

    def __init__(self, value: jax.Array):
        self.value = value
        self.trace = jax_core.trace_ctx.trace


_HELD = contextvars.ContextVar("pallas_kernels_split_counters", default=None)


def zeros() -> jax.Array:
    """A fresh counter buffer (made once a scan, outside its layers)."""
    return jnp.zeros((CAPACITY,), jnp.int32)


@contextlib.contextmanager
def scope(counters: jax.Array):
    """Hold ``counters`` while the block traces a layer; yields the holder, whose ``value`` after the block is the
    buffer the layer's last kernel handed back (to carry to the next layer)."""
    held = _Held(counters)
    token = _HELD.set(held)
    try:
        yield held
    finally:
        _HELD.reset(token)


def take(tiles: int) -> jax.Array | None:
    """The held counters for a launch of ``tiles`` output tiles, or None: no scope, a launch traced at another
    level than the scope's (a loop inside the layer: its value could not be handed back), or too many tiles."""
    held = _HELD.get()
    if held is None or tiles > CAPACITY or held.trace is not jax_core.trace_ctx.trace:
        return None
    return held.value


def give(counters: jax.Array) -> None:
    """Hand back the counters a kernel returned (its aliased output), for the next kernel of the layer."""
    _HELD.get().value = counters


def wanted() -> bool:
    """Whether a scan over decode layers should carry counters: the Pallas kernels run on a GPU (or are traced for
    one, interpret mode included) and the fix-up may run there (``hardware_checked``: ``split_fixup``)."""
    from pallas_kernels import hardware_checked

    return config.kernels_available() and config.on_gpu() and hardware_checked.allowed("split_fixup")


# --------------------------------------------------------------------------- in the kernel


class Refs(NamedTuple):
    """A fixing-up kernel's refs beyond the product's: the output, the residual to add (or None), the partials'
    scratch ``[splits, M, N]`` float32 and the counters (input and aliased output; None without K splits); and
    the launch's splits and interpret mode (static)."""

    out: object
    residual: object
    partials: object
    counters: object
    splits: int
    interpret: bool


def finish(refs: Refs, acc, program, epilogue) -> None:
    """Write a program's float32 (bm, bn) product ``acc``: with K splits, its partial, and if it is the tile's last
    program, ``epilogue(sum of the partials)`` -- (a float32 tile, its output columns: ``common.store_matmul``'s)
    -- plus the residual, cast to the output; without splits, the same of ``acc`` at once. The residual is added
    to the product rounded to the output's dtype, as ``residual + linear(x)`` adds them (a W8A8 model's next
    activation codes follow every rounding)."""
    rows, cols = program.rows, program.cols

    def write(total):
        total, out_cols = epilogue(total)
        if refs.residual is not None:  # the product rounded to the output's dtype first: XLA's add, bit for bit
            residual = load_tile(refs.residual, rows, out_cols, 0).astype(jnp.float32)
            total = total.astype(refs.out.dtype).astype(jnp.float32) + residual
        store_tile(refs.out, rows, out_cols, total.astype(refs.out.dtype))

    splits = refs.splits
    if splits == 1:
        write(acc)
        return
    # program ids read outside the branch: interpret mode has none inside one
    split, tile = pl.program_id(2), pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)
    mask = tile_mask(rows, cols)
    plgpu.store(refs.partials.at[split, rows[0], cols[0]], acc, mask=mask)

    @pl.when(arrived_last(refs.counters, tile, splits, refs.interpret))
    def _():
        total = None
        for s in range(splits):  # in split order, whichever program is last: the same sum every run
            part = read(refs.partials.at[jnp.int32(s), rows[0], cols[0]], mask)
            total = part if total is None else total + part
        write(total)
        release(refs.counters, tile)


def arrived_last(counters, tile, splits: int, interpret: bool):
    """Count the running program in on counter ``tile`` after its partial results are written: whether it is the
    last of the ``splits`` programs that count there (all their partials written, and visible to it)."""
    if not interpret:  # every thread's partial written before the count (interpret mode runs programs in turn)
        plgpu.debug_barrier()
    return plgpu.atomic_add(counters, (tile,), jnp.int32(1)) == splits - 1


def read(view, mask=None, other=0.0):
    """Another program's partial result: a volatile load (the memory's value, not L1's copy of an earlier call's)."""
    return plgpu.load(view, volatile=True) if mask is None else plgpu.load(view, mask=mask, other=other, volatile=True)


def release(counters, tile) -> None:
    """Counter ``tile`` back to zero (by the last program, which alone touches it now): as the next kernel expects."""
    counters[tile] = jnp.int32(0)


__all__ = ["CAPACITY", "Refs", "arrived_last", "finish", "give", "read", "release", "scope", "take", "wanted", "zeros"]
