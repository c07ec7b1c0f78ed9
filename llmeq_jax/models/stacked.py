"""Stacked decoder blocks: one ``lax.scan`` over the layers instead of one traced copy per layer.

A model's tree holds one subtree per block (``layers_0``, ``layers_1``, ...), and ``forward``
traces each, so the compiled program -- and XLA's compile time -- grows with depth (a 32-layer
Llama compiles 32 copies of the same block). :func:`stack_blocks` returns the tree with those
subtrees replaced by one, ``blocks``, whose every leaf has a leading layer axis; the model
functions (``models.model``) then run the blocks as one ``lax.scan`` whose body is traced once.

Only blocks that are the same function of their params can share a scan body: every block must
have the same tree (same leaves, QArray widths, tiles and layouts) and shapes, and the same kind
of attention (sliding-window or not). A mixed-precision allocation, a model with some
sliding-window layers or a half-converted tree are refused by name (:func:`stacking_reason`).

Stacking copies the block weights once (the caller drops the unstacked tree); run-time layouts
that copy kernels (``decode_layout.for_prefill``) are applied before it. Inside the scan the
layer index is traced, so the KV cache is indexed dynamically.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from llmeq_jax.core.qarray import QArray
from llmeq_jax.layer_slice import LayerSlice, take_layer

BLOCKS = "blocks"

Params = dict[str, Any]


def is_stacked(params) -> bool:
    """Whether ``params`` holds its decoder blocks stacked (:func:`stack_blocks`)."""
    return isinstance(params, dict) and BLOCKS in params


def block_names(config) -> list[str]:
    return [f"layers_{i}" for i in range(config.num_layers)]


def _signature(tree) -> tuple:
    """Tree structure (incl. QArray metadata) and each leaf's shape and dtype."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in leaves)


def _first_difference(first, other) -> str:
    """What differs between two block subtrees, in words (the first leaf path that does)."""
    paths_a = dict(jax.tree_util.tree_leaves_with_path(first, is_leaf=lambda a: isinstance(a, QArray)))
    paths_b = dict(jax.tree_util.tree_leaves_with_path(other, is_leaf=lambda a: isinstance(a, QArray)))
    name = lambda p: "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in p)  # noqa: E731
    if set(paths_a) != set(paths_b):
        extra = sorted(name(p) for p in set(paths_a) ^ set(paths_b))
        return f"different params ({', '.join(extra[:3])})"
    for path, a in paths_a.items():
        b = paths_b[path]
        if _signature(a) != _signature(b):
            describe = lambda x: (f"QArray int{x.bits} tile {x.tile}" if isinstance(x, QArray)  # noqa: E731
                                  else f"{type(x).__name__} {tuple(x.shape)} {x.dtype}")
            return f"{name(path)} is {describe(a)} in one and {describe(b)} in the other"
    return "different tree structure"


def stacking_reason(config, params) -> str | None:
    """None when :func:`stack_blocks` can stack ``params``' decoder blocks, else why not."""
    if is_stacked(params):
        return "the blocks are stacked already"
    names = block_names(config)
    missing = [n for n in names if n not in params]
    if missing:
        return f"the tree has no {missing[0]} (expected {names[0]} .. {names[-1]})"
    kinds = {config.is_sliding(i) for i in range(config.num_layers)}
    if len(kinds) > 1:
        return "some layers use sliding-window attention and some do not (one scan body runs one kind)"
    first = _signature(params[names[0]])
    for n in names[1:]:
        if _signature(params[n]) != first:
            return f"{n} differs from {names[0]}: {_first_difference(params[names[0]], params[n])}"
    return None


def stack_blocks(config, params: Params) -> Params:
    """``params`` with ``layers_0 .. layers_{L-1}`` replaced by ``blocks`` (each leaf [L, ...]).

    Raises ValueError naming the first block that cannot share the others' scan body."""
    reason = stacking_reason(config, params)
    if reason is not None:
        raise ValueError(f"stack_blocks: cannot stack the decoder blocks: {reason}")
    return _stacked_tree(config, params)


def _stacked_tree(config, params: Params) -> Params:
    names = block_names(config)
    blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *[params[n] for n in names])
    rest = {k: v for k, v in params.items() if k not in names}
    return {**rest, BLOCKS: blocks}


def stack_blocks_or_warn(config, params: Params) -> Params:
    """:func:`stack_blocks` where the blocks can share one scan body; else ``params`` unchanged and one
    warning saying why (the blocks then run unrolled: same results, a longer compile)."""
    if is_stacked(params):
        return params
    reason = stacking_reason(config, params)
    if reason is None:
        return _stacked_tree(config, params)
    warnings.warn(f"scan over layers: running the blocks unrolled instead: {reason}", stacklevel=2)
    return params


def unstack_blocks(config, params: Params) -> Params:
    """Inverse of :func:`stack_blocks` (e.g. before saving or quantizing block by block)."""
    if not is_stacked(params):
        return params
    blocks = params[BLOCKS]
    rest = {k: v for k, v in params.items() if k != BLOCKS}
    for i, n in enumerate(block_names(config)):
        rest[n] = jax.tree.map(lambda a: a[i], blocks)
    return rest


def in_place_kernels() -> bool:
    """Whether the scan hands quantized QArray kernels to ``ops.linear`` as :class:`LayerSlice` views
    (read in place by the Pallas kernels: on a GPU, or in interpret mode) rather than as copied-out
    slices. Row-major kernels (the native CPU decode layout) always go as views."""
    from pallas_kernels import config  # not at import time: pallas_kernels is optional for a model tree

    return config.kernels_available()


def float_views(in_place: bool) -> bool:
    """Whether the scan hands stacked float kernels to ``ops.linear`` as :class:`LayerSlice` views: where
    a Pallas kernel may read them (``in_place``), and on a one-device CPU with the native library (its
    float GEMV, ``native.float_matmul``, reads a layer in place at decode's rows)."""
    if in_place:
        return True
    from llmeq_jax import native

    return native.enabled() and native.prefill_kernels_ok()  # enabled(): tracing for a CPU, library loaded


def norms_in_place(blocks, in_place: bool) -> bool:
    """Whether the scan hands the norms' scales to the norm kernel as :class:`LayerSlice` views: where Pallas
    kernels run (``in_place``) and the block's matmuls read x as it is -- float kernels, int4 words, the int4
    dot kernel, the int8 ones (the float16-operand kernel converts x itself unless a setting has XLA do it), and
    W8A8 where ``pallas_kernels.token_codes`` makes the activations' codes (and folds the norm in). Not with other
    W8A8 / FP8 codes: their activations are quantized per token in XLA, which XLA fuses with its own norm; a norm
    kernel there only moves that into a launch of its own (``scripts/gpu_aot.py``: 26 -> 27 launches a W8A8
    layer)."""
    from llmeq_jax import kernel_dispatch
    from pallas_kernels import int8_f16

    if not in_place:
        return False
    leaves = jax.tree.leaves(blocks, is_leaf=lambda a: isinstance(a, QArray))
    quantized = [a for a in leaves if isinstance(a, QArray)]
    coded = [a for a in quantized if a.act_spec is not None]
    if not all(kernel_dispatch.codes_made_by_kernel(a, 1) for a in coded):
        return False
    return not (int8_f16.converts_in_xla(1) and any(a.bits == 8 and a.act_spec is None for a in quantized))


def block_at(blocks, layer, in_place: bool, floats: bool, norms: bool = False):
    """Block ``layer`` of the stacked ``blocks``: every array sliced, except the kernels a kernel can
    read in place, which stay stacked behind a :class:`LayerSlice`: row-major kernels (native CPU
    decode), int4 word and row kernels (GPU decode), when ``in_place`` (Pallas) 2-D uniform-grid QArrays, when
    ``norms`` (:func:`norms_in_place`) the norms' scales (``pallas_kernels.rms_norm``), and when ``floats``
    (:func:`float_views`) float kernels (``ops.linear`` and the norms still slice those unless a kernel takes
    them)."""
    from llmeq_jax.decode_layout import Int4RowKernel, Int4WordKernel, RowMajorKernel

    def one(path, leaf):
        if isinstance(leaf, (RowMajorKernel, Int4WordKernel, Int4RowKernel)) or (
                in_place and isinstance(leaf, QArray) and len(leaf.shape) == 2 and leaf.grid != "log2"):
            return LayerSlice(leaf, layer)
        if floats and _is_float_kernel(path, leaf):
            return LayerSlice(leaf, layer)
        if norms and is_norm_scale(path, leaf):  # the norm kernel reads it in place (models.layers)
            return LayerSlice(leaf, layer)
        return jax.tree.map(lambda a: take_layer(a, layer), leaf)

    # every node but the param dicts is taken whole (QArrays, and run-time layouts such as RowMajorKernel)
    return jax.tree_util.tree_map_with_path(one, blocks, is_leaf=lambda a: not isinstance(a, (dict, list, tuple)))


def is_norm_scale(path, leaf) -> bool:
    """A stacked norm's scale ([L, features] under the key "scale")."""
    last = path[-1] if path else None
    return (getattr(last, "key", None) == "scale" and isinstance(leaf, jax.Array) and leaf.ndim == 2
            and jnp.issubdtype(leaf.dtype, jnp.floating))


def _is_float_kernel(path, leaf) -> bool:
    """A stacked float ``(in, out)`` kernel of a Linear ([L, in, out] under the key "kernel")."""
    last = path[-1] if path else None
    return (getattr(last, "key", None) == "kernel" and isinstance(leaf, jax.Array) and leaf.ndim == 3
            and jnp.issubdtype(leaf.dtype, jnp.floating))


def scan_blocks(run_block, blocks, carry, num_layers: int):
    """``carry`` through ``run_block(block_params, layer, carry) -> carry`` for every stacked block,
    as one ``lax.scan`` (the layer index traced). The stack is closed over, not scanned over: each
    step takes its block with :func:`block_at`, so kernels that can read a layer in place do. The layer
    index rides in the carry rather than being scanned over (an index array): XLA sliced that array with a
    dynamic-slice fusion every layer, on a GPU a thunk of its own that command buffers cannot hold, which
    split each layer's kernels into several launches from the host.

    Where the kernels may add their split products' partials themselves (``pallas_kernels.split_fixup.wanted``),
    the counters they share ride in the carry too, made once before the layers."""
    from pallas_kernels import prefetch, split_fixup

    in_place = in_place_kernels()
    floats = float_views(in_place)
    norms = norms_in_place(blocks, in_place)
    counting = in_place and split_fixup.wanted()

    def body(state, _):
        c, layer, counters = state
        with prefetch.layer_chain(c), contextlib.ExitStack() as stack:  # where asked, weights read ahead
            held = stack.enter_context(split_fixup.scope(counters)) if counting else None
            c = run_block(block_at(blocks, layer, in_place, floats, norms), layer, c)
        return (c, layer + 1, held.value if counting else counters), None

    start = (carry, jnp.int32(0), split_fixup.zeros() if counting else ())
    (carry, _, _), _ = jax.lax.scan(body, start, None, length=num_layers)
    return carry
