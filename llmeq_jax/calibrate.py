"""Calibration: run the model over real text and collect what methods need per linear input.

Collection is explicit: one decoder block at a time is applied under
``flax.linen.intercept_methods``, and the interceptor records the input of
every :class:`~llmeq_jax.models.layers.Linear` it sees (keyed by the kernel's
param path). Nothing in jax or flax is patched, and the model code knows
nothing about calibration.

Per kernel input ``x`` (``[tokens, in_features]``) the statistics are sums or
extrema, so batches (and devices, see :mod:`llmeq_jax.distributed.calibrate`) combine with max / min / add:

  ``absmax``  max |x_j| per input channel         (combine: max)
  ``min``/``max`` per input channel               (combine: min / max)
  ``abs_sum`` sum |x_j| per channel, with ``count`` (mean |x| = abs_sum / count)
  ``hessian`` X^T X, float32 ``[in, in]``          (combine: add; GPTQ)
  ``sample``  up to ``SAMPLE_TOKENS`` input rows, evenly strided over the
              batch's tokens (combine: concatenate, keep the first
              ``SAMPLE_TOKENS``; AWQ and SmoothQuant's alpha search)

Running block by block keeps memory bounded by one block's activations, and
lets a sequential method quantize block ``i`` before block ``i+1``'s inputs are
computed (``process_block``), as GPTQ and AWQ do.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from llmeq_jax.core.rope import apply_rope, rope_inv_freq
from llmeq_jax.kv import grid as kvgrid
from llmeq_jax.kv.spec import KeyRanges, KVQuantizer, KVSpec, KVSpecError
from llmeq_jax.models.layers import Linear
from llmeq_jax.models.model import apply_block, embed, forward_step, init_cache, same_block_layer

STATS = ("absmax", "min", "max", "abs_sum", "count", "hessian", "sample")
# Rows of each linear input kept by the "sample" statistic: enough for a
# per-layer error estimate, small enough that one block's samples stay small.
SAMPLE_TOKENS = 512


def _keep_sample(a, b):
    if a.shape[0] >= SAMPLE_TOKENS:  # full already: nothing of b would be kept
        return a
    return jnp.concatenate([a, b], axis=0)[:SAMPLE_TOKENS]


_COMBINE = {"absmax": jnp.maximum, "min": jnp.minimum, "max": jnp.maximum, "abs_sum": jnp.add, "count": jnp.add,
            "hessian": jnp.add, "sample": _keep_sample}


class CalibrationError(ValueError):
    """Calibration data or settings that cannot give the requested statistics."""


# --------------------------------------------------------------------------- data


def calibration_windows(tokenizer: Any, text_path: str | Path, n_samples: int, seq_len: int) -> np.ndarray:
    """The first ``n_samples`` non-overlapping windows of ``seq_len`` tokens of the text (no BOS)."""
    from llmeq_jax.evaluate import tokenize_text

    path = Path(text_path)
    if not path.is_file():
        raise CalibrationError(f"calibration text {str(path)!r} does not exist")
    if n_samples <= 0:
        raise CalibrationError(f"calibration needs at least one sample; got {n_samples}")
    ids = tokenize_text(tokenizer, path.read_text())
    have = len(ids) // seq_len
    if have < n_samples:
        raise CalibrationError(
            f"calibration text {path.name} has {len(ids)} tokens = {have} samples of {seq_len}; "
            f"{n_samples} were requested (use fewer samples, a shorter --seq-len or a longer text)"
        )
    return ids[: n_samples * seq_len].reshape(n_samples, seq_len)


def fresh_windows(tokenizer: Any, text_path: str | Path, n_samples: int, seq_len: int) -> np.ndarray:
    """Up to ``n_samples`` non-overlapping windows of ``seq_len`` tokens from the start of the text (fewer when
    the text is shorter; at least one)."""
    from llmeq_jax.evaluate import tokenize_text

    path = Path(text_path)
    if not path.is_file():
        raise CalibrationError(f"training text {str(path)!r} does not exist")
    ids = tokenize_text(tokenizer, path.read_text())
    n = min(n_samples, len(ids) // seq_len)
    if n < 1:
        raise CalibrationError(f"training text {path.name} has {len(ids)} tokens, fewer than one window of {seq_len}")
    return ids[: n * seq_len].reshape(n, seq_len)


# --------------------------------------------------------------------------- statistics of one input


def input_stats(x: jax.Array, wants: Iterable[str]) -> dict[str, jax.Array]:
    """Statistics of one linear input ``x [..., in]`` over all its tokens."""
    xf = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    out: dict[str, jax.Array] = {}
    for name in wants:
        if name == "absmax":
            out[name] = jnp.max(jnp.abs(xf), axis=0)
        elif name == "min":
            out[name] = jnp.min(xf, axis=0)
        elif name == "max":
            out[name] = jnp.max(xf, axis=0)
        elif name == "abs_sum":
            out[name] = jnp.sum(jnp.abs(xf), axis=0)
        elif name == "count":
            out[name] = jnp.asarray(xf.shape[0], jnp.float32)
        elif name == "hessian":
            out[name] = jnp.einsum("ti,tj->ij", xf, xf, precision=jax.lax.Precision.HIGHEST)
        elif name == "sample":
            stride = max(1, xf.shape[0] // SAMPLE_TOKENS)
            out[name] = xf[::stride][:SAMPLE_TOKENS]
        else:
            raise CalibrationError(f"unknown statistic {name!r}; available: {list(STATS)}")
    return out


def combine(a: dict, b: dict) -> dict:
    """Merge two stats dicts (same keys) with each statistic's own reduction."""
    return {path: {k: _COMBINE[k](a[path][k], b[path][k]) for k in a[path]} for path in a}


# --------------------------------------------------------------------------- block runs


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, Linear)


def run_block_capturing(
    apply_fn: Callable[[], jax.Array], record: Callable[[str, jax.Array], None]
) -> jax.Array:
    """Call ``apply_fn()`` and hand every Linear input to ``record(path_in_block, x)``."""

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name == "__call__" and _is_linear(context.module):
            record("/".join(context.module.scope.path), args[0])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        return apply_fn()


@functools.partial(jax.jit, static_argnames=("config", "layer", "wants"))
def _block_with_stats(config, block_params, hidden, positions, *, layer, wants):
    found: dict[str, dict] = {}

    def record(path, x):
        found[path + "/kernel"] = input_stats(x, wants)

    out = run_block_capturing(lambda: apply_block(config, block_params, hidden, positions, layer=layer), record)
    return out, found


@functools.partial(jax.jit, static_argnames=("config", "layer"))
def _block(config, block_params, hidden, positions, *, layer):
    return apply_block(config, block_params, hidden, positions, layer=layer)


def _block_inputs(config, params, windows: np.ndarray, batch_size: int) -> list[tuple[jax.Array, jax.Array]]:
    out = []
    for start in range(0, len(windows), batch_size):
        toks = jnp.asarray(windows[start : start + batch_size])
        positions = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
        out.append((jax.jit(embed, static_argnums=0)(config, params, toks, positions), positions))
    return out


class BlockRunner:
    """How :func:`calibrate` runs one decoder block: this one under plain ``jit`` on one device.

    ``llmeq_jax.distributed.calibrate.ShardedBlockRunner`` runs it under ``shard_map`` with the
    windows split over a mesh's data axis. The driver (which block, what is kept, what feeds
    the next block) is the same for both.
    """

    def place(self, params: dict) -> dict:
        """``params`` where the blocks run (here: as they are)."""
        return params

    def inputs(self, config, params, windows: np.ndarray, batch_size: int) -> list[tuple[jax.Array, jax.Array]]:
        """The first block's inputs: ``(hidden, positions)`` per batch of ``batch_size`` windows."""
        return _block_inputs(config, params, windows, batch_size)

    def block_with_stats(self, config, block_params, hidden, positions, *, layer: int, wants: tuple):
        """``(block output, {kernel path in block: statistics of its input})`` of one batch."""
        return _block_with_stats(config, block_params, hidden, positions, layer=layer, wants=wants)

    def block(self, config, block_params, hidden, positions, *, layer: int):
        """The block's output alone (the next block's input after a method changed this one)."""
        return _block(config, block_params, hidden, positions, layer=layer)

    def fold(self, block_stats: dict | None, found: dict) -> dict:
        """``block_stats`` with one more batch's statistics ``found`` added."""
        return found if block_stats is None else combine(block_stats, found)


def check_wants(wants: Iterable[str]) -> tuple[str, ...]:
    """``wants`` without repeats, or a CalibrationError naming the unknown statistics."""
    wants = tuple(dict.fromkeys(wants))
    unknown = [w for w in wants if w not in STATS]
    if unknown:
        raise CalibrationError(f"unknown statistic(s) {unknown}; available: {list(STATS)}")
    return wants


def calibrate(
    config: Any,
    params: dict,
    windows: np.ndarray,
    *,
    wants: Iterable[str] = ("absmax", "abs_sum", "count"),
    batch_size: int = 4,
    process_block: Callable[[int, dict, dict, list], dict] | None = None,
    progress: bool = False,
    keep: Iterable[str] | None = None,
    sequential: bool = True,
    runner: BlockRunner | None = None,
) -> tuple[dict, dict]:
    """Run ``windows`` ``[N, T]`` through the model one block at a time.

    Returns ``(stats, params)``: ``stats`` maps each kernel path (e.g.
    ``layers_0/attn/q_proj/kernel``) to its input statistics; ``params`` is the
    tree after ``process_block(layer, block_params, block_stats, block_inputs)``
    replaced each block (unchanged without it). Block ``i+1`` sees the outputs
    of the processed block ``i``. ``keep`` limits which statistics are
    returned (default: all of ``wants``); a sequential method that consumes
    its Hessians or samples block by block passes ``keep=()`` so memory stays
    bounded by one block. ``sequential=False`` feeds the *unprocessed* block's
    outputs forward instead (statistics of the float model, one block pass
    instead of two; what SmoothQuant and AWQ calibrate on).
    ``runner``: how a block runs (default: :class:`BlockRunner`, plain jit on one device).
    """
    runner = BlockRunner() if runner is None else runner
    wants = check_wants(wants)
    params = runner.place(params)
    inputs = runner.inputs(config, params, windows, batch_size)
    layers = range(config.num_layers)
    if progress:
        layers = tqdm(layers, desc="calibrate", unit="block", leave=False)
    stats: dict[str, dict] = {}
    new_params = dict(params)
    for i in layers:
        name = f"layers_{i}"
        bp = params[name]
        kind = same_block_layer(config, i)  # one compile per kind of block, not per block
        block_stats, outs = None, []
        for h, pos in inputs:
            out, found = runner.block_with_stats(config, bp, h, pos, layer=kind, wants=wants)
            outs.append((out, pos))
            block_stats = runner.fold(block_stats, found)
        if process_block is not None:
            bp = process_block(i, bp, block_stats, inputs)
            new_params[name] = bp
        kept = {p: {k: v for k, v in s.items() if keep is None or k in keep} for p, s in block_stats.items()}
        stats.update({f"{name}/{p}": s for p, s in kept.items() if s})
        if process_block is None or not sequential:
            inputs = outs  # the block is unchanged: its outputs from the statistics pass are the next inputs
        else:
            del outs
            inputs = [(runner.block(config, bp, h, pos, layer=kind), pos) for h, pos in inputs]
    return stats, new_params


# --------------------------------------------------------------------------- KV cache: static key ranges


def collect_keys(config, params, windows: np.ndarray, *, pre_rope: bool, batch_size: int = 4) -> jax.Array:
    """Keys of every layer for calibration token ``windows`` [N, S]: ``[layers, N, kv_heads, S, head_dim]``.

    They are read from a float cache after a prefill (post-RoPE); pre-RoPE keys
    are recovered by rotating back by each token's position.
    """
    windows = np.asarray(windows, np.int32)
    n, s = windows.shape

    @jax.jit
    def keys_of(tokens):
        cache = init_cache(config, tokens.shape[0], s)
        _, cache = forward_step(config, params, tokens, jnp.ones(tokens.shape, jnp.int32), cache)
        return cache.k

    out = []
    for start in range(0, n, batch_size):
        k = keys_of(jnp.asarray(windows[start : start + batch_size]))
        if pre_rope and config.family != "gpt2":
            inv = jnp.asarray(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling))
            back = -jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (k.shape[1], s))
            k = jax.vmap(lambda kl: apply_rope(kl, back, inv, heads_axis=1))(k)
        out.append(k)
    return jnp.concatenate(out, axis=1)


def calibrate_key_ranges(config, params, windows: np.ndarray, spec: KVSpec, batch_size: int = 4) -> KeyRanges:
    """Static per-channel key ranges of ``spec`` (pre- or post-RoPE) from calibration ``windows``."""
    keys = collect_keys(config, params, windows, pre_rope=spec.pre_rope, batch_size=batch_size)
    return kvgrid.key_ranges_from_keys(keys, spec.outlier_frac, spec.sink_tokens)


def make_kv_quantizer(spec: KVSpec | None, config=None, params=None, windows: np.ndarray | None = None) -> KVQuantizer | None:
    """A ready KVQuantizer: calibrates key ranges from ``windows`` when the spec needs them
    (online keys start without a running range)."""
    if spec is None:
        return None
    if not spec.needs_key_ranges:
        return KVQuantizer(None, spec)
    if windows is None:
        raise KVSpecError("per-channel keys need calibration windows to compute static key ranges")
    return KVQuantizer(calibrate_key_ranges(config, params, windows, spec), spec)
