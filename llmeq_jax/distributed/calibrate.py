"""Data-parallel calibration: windows split over the mesh's data axis, statistics combined
with the collective that is correct for each. The block-by-block driver is
:func:`llmeq_jax.calibrate.calibrate`; :class:`ShardedBlockRunner` is how a block runs here.

Statistics (calibration) combine with the collective that matches them:
absmax/max -> ``pmax``, min -> ``pmin``, sums (``abs_sum``, ``count``,
Hessians ``X^T X``) -> ``psum`` (:data:`STAT_COLLECTIVE`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llmeq_jax.calibrate import (
    SAMPLE_TOKENS,
    BlockRunner,
    CalibrationError,
    calibrate,
    combine,
    input_stats,
    run_block_capturing,
)
from llmeq_jax.distributed.mesh import DATA, global_array, replicate
from llmeq_jax.methods import quantize_model
from llmeq_jax.models.model import apply_block, embed


def _gather_sample(v: jax.Array, axis_name: Any) -> jax.Array:
    """Input rows are not reduced: gather every shard's rows in shard order and keep the
    first ``SAMPLE_TOKENS``, as one device keeps the first rows it sees."""
    return jax.lax.all_gather(v, axis_name, tiled=True, to="invarying")[:SAMPLE_TOKENS]


# Which collective combines each calibration statistic over the data axis, and why:
# extrema are order-free (pmax/pmin, exact); sums and counts add (psum); the Hessian
# X^T X is a sum over tokens, so it adds too.
STAT_COLLECTIVE = {
    "absmax": jax.lax.pmax,
    "max": jax.lax.pmax,
    "min": jax.lax.pmin,
    "abs_sum": jax.lax.psum,
    "count": jax.lax.psum,
    "hessian": jax.lax.psum,
    "sample": _gather_sample,  # AWQ / SmoothQuant alpha search: rows, gathered (all_gather)
}


def reduce_stats(stats: dict, axis_name: Any, *, ordered_sums: bool = False) -> dict:
    """Combine per-shard statistics ``{path: {name: array}}`` across ``axis_name`` (inside shard_map).

    ``ordered_sums``: instead of ``psum`` (whose summation order is the backend's), sums are
    ``all_gather``-ed as ``[shards, ...]`` so the caller can add them in a fixed order --
    that reproduces single-device calibration bit for bit, at the cost of gathering.
    """

    def one(k, v):
        if ordered_sums and STAT_COLLECTIVE[k] is jax.lax.psum:
            return jax.lax.all_gather(v, axis_name, to="invarying")
        return STAT_COLLECTIVE[k](v, axis_name)

    return {path: {k: one(k, v) for k, v in s.items()} for path, s in stats.items()}


def _fold_ordered(block_stats: dict | None, found: dict, shards: int) -> dict:
    """Add gathered per-shard sums one shard at a time, in shard order (= single-device batch order)."""
    summed = [k for k, f in STAT_COLLECTIVE.items() if f is jax.lax.psum]

    def shard_part(k, v, j):
        if k in summed:
            return v[j]
        # Already combined over shards: extrema are idempotent, gathered rows must enter once.
        return v[:0] if (k == "sample" and j > 0) else v

    for j in range(shards):
        part = {p: {k: shard_part(k, v, j) for k, v in s.items()} for p, s in found.items()}
        block_stats = part if block_stats is None else combine(block_stats, part)
    return block_stats


@functools.lru_cache(maxsize=None)
def _sharded_block_fn(config, layer: int, wants: tuple, mesh: Mesh, data_axis: str, with_stats: bool,
                      ordered_sums: bool = False):
    def body(block_params, hidden, positions):
        if not with_stats:
            return apply_block(config, block_params, hidden, positions, layer=layer)
        found: dict[str, dict] = {}

        def record(path, x):
            found[path + "/kernel"] = input_stats(x, wants)

        out = run_block_capturing(lambda: apply_block(config, block_params, hidden, positions, layer=layer), record)
        return out, reduce_stats(found, data_axis, ordered_sums=ordered_sums)

    batch = P(data_axis)
    out_specs = (batch, P()) if with_stats else batch
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), batch, batch), out_specs=out_specs))


class ShardedBlockRunner(BlockRunner):
    """Runs a block under ``shard_map``: each data shard takes ``batch_size`` windows per step, and
    the statistics are combined across shards with :data:`STAT_COLLECTIVE` (replicated results).

    ``ordered_sums``: sums are gathered and added shard by shard in batch order (bit-identical
    to one device) instead of ``psum``-ed (the backend's summation order).
    """

    def __init__(self, mesh: Mesh, data_axis: str = DATA, ordered_sums: bool = False):
        self.mesh, self.data_axis, self.ordered_sums = mesh, data_axis, ordered_sums
        self.shards = mesh.shape[data_axis]

    def place(self, params: dict) -> dict:
        return replicate(params, self.mesh)

    def inputs(self, config, params, windows: np.ndarray, batch_size: int) -> list[tuple[jax.Array, jax.Array]]:
        windows = np.asarray(windows)
        if len(windows) % self.shards:
            raise CalibrationError(
                f"{len(windows)} calibration windows cannot be split evenly over the {self.shards} shards of mesh "
                f"axis {self.data_axis!r}; use a multiple of {self.shards}"
            )
        step = batch_size * self.shards
        batch_sharding = NamedSharding(self.mesh, P(self.data_axis))
        embed_fn = jax.jit(embed, static_argnums=0)
        out = []
        for start in range(0, len(windows), step):
            toks = windows[start : start + step]
            pos = np.broadcast_to(np.arange(toks.shape[1]), toks.shape)
            toks, pos = global_array(toks, batch_sharding), global_array(pos, batch_sharding)
            out.append((embed_fn(config, params, toks, pos), pos))
        return out

    # Each step waits for its result: collectives dispatched back to back can deadlock on few
    # cores (see quantize_params_sharded).
    def block_with_stats(self, config, block_params, hidden, positions, *, layer: int, wants: tuple):
        fn = _sharded_block_fn(config, layer, wants, self.mesh, self.data_axis, True, self.ordered_sums)
        return jax.block_until_ready(fn(block_params, hidden, positions))

    def block(self, config, block_params, hidden, positions, *, layer: int):
        fn = _sharded_block_fn(config, layer, (), self.mesh, self.data_axis, False)
        return jax.block_until_ready(fn(block_params, hidden, positions))

    def fold(self, block_stats: dict | None, found: dict) -> dict:
        if self.ordered_sums:
            return _fold_ordered(block_stats, found, self.shards)
        return super().fold(block_stats, found)


def calibrate_sharded(
    config: Any,
    params: dict,
    windows: np.ndarray,
    mesh: Mesh,
    *,
    data_axis: str = DATA,
    ordered_sums: bool = False,
    **kw,
) -> tuple[dict, dict]:
    """``calibrate.calibrate`` with the windows split over ``data_axis``; same contract and results.

    Each step takes ``batch_size`` windows per data shard; every shard runs the block on
    its own windows and the statistics are combined with :data:`STAT_COLLECTIVE`, so all
    devices (and processes) end with the same, replicated statistics. Extrema and counts
    equal single-device calibration (same ``batch_size``) exactly; with ``psum`` the sums
    equal it up to float summation order, and with ``ordered_sums=True`` (all_gather, then
    add shard by shard in batch order) bit for bit. ``kw``: as :func:`llmeq_jax.calibrate.calibrate`.
    """
    return calibrate(config, params, windows, runner=ShardedBlockRunner(mesh, data_axis, ordered_sums), **kw)


def quantize_model_sharded(config: Any, params: dict, recipe: Any, windows: np.ndarray, mesh: Mesh, *,
                           batch_size: int = 4, ordered_sums: bool = True) -> tuple[dict, dict]:
    """``methods.quantize_model`` (any method: GPTQ, AWQ, SmoothQuant, ...) with data-parallel calibration.

    The calibration windows are split over the mesh's data axis (:func:`calibrate_sharded`);
    every device holds the same replicated statistics and runs the method's block step on
    them, so all processes end with the same quantized tree. ``ordered_sums`` (default)
    adds Hessians and sums shard by shard in batch order: the result is bit-identical to
    ``quantize_model`` on one device with the same per-shard ``batch_size``.
    """
    def calib(config, params, windows, *, progress=False, **kw):
        # One progress bar, not one per process.
        return calibrate_sharded(config, params, windows, mesh, batch_size=batch_size, ordered_sums=ordered_sums,
                                 progress=progress and jax.process_index() == 0, **kw)

    return quantize_model(config, params, recipe, windows, calibrate_fn=calib)
