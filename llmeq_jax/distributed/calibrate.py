"""Data-parallel calibration: windows split over the mesh's data axis, statistics combined
with the collective that is correct for each.

Statistics (calibration) combine with the collective that matches them:
absmax/max -> ``pmax``, min -> ``pmin``, sums (``abs_sum``, ``count``,
Hessians ``X^T X``) -> ``psum`` (:data:`STAT_COLLECTIVE`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llmeq_jax.calibrate import SAMPLE_TOKENS, STATS, CalibrationError, combine, input_stats, run_block_capturing
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


def calibrate_sharded(
    config: Any,
    params: dict,
    windows: np.ndarray,
    mesh: Mesh,
    *,
    wants: Iterable[str] = ("absmax", "abs_sum", "count"),
    batch_size: int = 4,
    process_block: Callable[[int, dict, dict, list], dict] | None = None,
    data_axis: str = DATA,
    ordered_sums: bool = False,
    sequential: bool = True,
) -> tuple[dict, dict]:
    """``calibrate.calibrate`` with the windows split over ``data_axis``; same contract and results.

    Each step takes ``batch_size`` windows per data shard; every shard runs the block on
    its own windows and the statistics are combined with :data:`STAT_COLLECTIVE`, so all
    devices (and processes) end with the same, replicated statistics. Extrema and counts
    equal single-device calibration (same ``batch_size``) exactly; with ``psum`` the sums
    equal it up to float summation order, and with ``ordered_sums=True`` (all_gather, then
    add shard by shard in batch order) bit for bit.
    """
    wants = tuple(dict.fromkeys(wants))
    unknown = [w for w in wants if w not in STATS]
    if unknown:
        raise CalibrationError(f"unknown statistic(s) {unknown}; available: {list(STATS)}")
    shards = mesh.shape[data_axis]
    windows = np.asarray(windows)
    if len(windows) % shards:
        raise CalibrationError(
            f"{len(windows)} calibration windows cannot be split evenly over the {shards} shards of mesh axis "
            f"{data_axis!r}; use a multiple of {shards}"
        )
    step = batch_size * shards
    batch_sharding = NamedSharding(mesh, P(data_axis))
    embed_fn = jax.jit(embed, static_argnums=0)
    params = replicate(params, mesh)
    inputs = []
    for start in range(0, len(windows), step):
        toks = windows[start : start + step]
        pos = np.broadcast_to(np.arange(toks.shape[1]), toks.shape)
        toks, pos = global_array(toks, batch_sharding), global_array(pos, batch_sharding)
        inputs.append((embed_fn(config, params, toks, pos), pos))
    stats: dict[str, dict] = {}
    new_params = dict(params)
    for i in range(config.num_layers):
        name = f"layers_{i}"
        bp = params[name]
        with_stats = _sharded_block_fn(config, i, wants, mesh, data_axis, True, ordered_sums)
        block_stats = None
        for h, pos in inputs:
            _, found = jax.block_until_ready(with_stats(bp, h, pos))  # see quantize_params_sharded
            if ordered_sums:
                block_stats = _fold_ordered(block_stats, found, shards)
            else:
                block_stats = found if block_stats is None else combine(block_stats, found)
        if process_block is not None:
            bp = process_block(i, bp, block_stats, inputs)
            new_params[name] = bp
        stats.update({f"{name}/{p}": s for p, s in block_stats.items()})
        plain = _sharded_block_fn(config, i, wants, mesh, data_axis, False)
        feed = bp if sequential else params[name]  # sequential=False: the float model's activations
        inputs = [(jax.block_until_ready(plain(feed, h, pos)), pos) for h, pos in inputs]
    return stats, new_params


def quantize_model_sharded(config: Any, params: dict, recipe: Any, windows: np.ndarray, mesh: Mesh, *,
                           batch_size: int = 4, ordered_sums: bool = True) -> tuple[dict, dict]:
    """``methods.quantize_model`` (any method: GPTQ, AWQ, SmoothQuant, ...) with data-parallel calibration.

    The calibration windows are split over the mesh's data axis (:func:`calibrate_sharded`);
    every device holds the same replicated statistics and runs the method's block step on
    them, so all processes end with the same quantized tree. ``ordered_sums`` (default)
    adds Hessians and sums shard by shard in batch order: the result is bit-identical to
    ``quantize_model`` on one device with the same per-shard ``batch_size``.
    """
    def calib(config, params, windows, *, wants, process_block=None, keep=None, progress=False, sequential=True):
        del keep, progress  # statistics live on the mesh, replicated; no progress bar across processes
        return calibrate_sharded(config, params, windows, mesh, wants=wants, batch_size=batch_size,
                                 process_block=process_block, ordered_sums=ordered_sums, sequential=sequential)

    return quantize_model(config, params, recipe, windows, calibrate_fn=calib)
