"""A decode product's weights read into the GPU's L2 while the small kernels before it run (issue #15).

Why: between a decode layer's matmuls run ~15 small kernels (norms, RoPE, attention, residual adds, the cache's
writes), ~0.7 ms of rtn-w4-g128's 2.4 ms step on an H200 (docs/kernels.md, 2026-12-04), while HBM mostly idles;
a 50 MB L2 holds most of a 7B model's int4 product. If the next product's first bytes are read during that time,
the product finds them in L2.

How: the scan over stacked blocks (``models.stacked.scan_blocks``) opens a chain for each layer
(:func:`layer_chain`); ``ops.linear`` calls :func:`before` on every product of at most :data:`DECODE_ROWS` rows
whose weights are a layer of a stack (a ``LayerSlice``) and :func:`after` on its output. :func:`before` XOR-reduces
the leading bytes of the product's largest weight array for the layer (:func:`read_token`). The reduction depends
only on the weights and on the previous product's output (the layer's input for its first product), so nothing
orders it after the small kernels between the two products; a zero made from its result is added to x, so the
product waits for it and XLA keeps it. ``stream="side"`` runs it on a second stream (XLA's explicit stream
annotation, ``compute_on("gpu_stream:1")``); "main" leaves it on the program's stream as a kernel of its own,
which runs beside the small kernels only where XLA's command buffer orders kernels by their data alone. A product
of the same x as the one before it (q, k and v as three products) is not prefetched: nothing runs between them.

Off unless asked: whether it helps, and at what size, only a GPU can say (``scripts/probe_prefetch.py`` on one
product; ``scripts/sweep_decode.py --settings prefetch:mb=16,stream=side`` on a whole decode)::

    with pallas_kernels.prefetch.ahead(mb=16, stream="side"):
        tokens = generate(...)

Like the kernels' launch settings (:mod:`pallas_kernels.settings`) it is read when a function is traced and is
part of ``llmeq_jax.generate.kernel_state``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels.settings import DECODE_ROWS

STREAMS = ("main", "side")
SIDE_STREAM = "gpu_stream:1"
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


@dataclasses.dataclass(frozen=True)
class Ahead:
    """How much of each product to read ahead (bytes of its largest weight array) and on which stream."""

    nbytes: int
    stream: str


_AHEAD = contextvars.ContextVar("pallas_kernels_prefetch", default=None)
_CHAIN = contextvars.ContextVar("pallas_kernels_prefetch_chain", default=None)


@contextlib.contextmanager
def ahead(mb: float, stream: str = "main"):
    """Inside this block, decode products of stacked layers read their weights' leading ``mb`` MB ahead of
    themselves (see the module doc), on ``stream`` ("main" or "side")."""
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0 or not math.isfinite(mb):
        raise ValueError(f"prefetch: mb must be a positive number of megabytes, got {mb!r}")
    if stream not in STREAMS:
        raise ValueError(f"prefetch: stream must be one of {STREAMS}, got {stream!r}")
    token = _AHEAD.set(Ahead(int(mb * (1 << 20)), stream))
    try:
        yield
    finally:
        _AHEAD.reset(token)


def current() -> Ahead | None:
    """The prefetch in force (hashable: a static argument of the jitted decode steps), or None."""
    return _AHEAD.get()


def parse(text: str) -> dict:
    """``"prefetch:mb=16,stream=side"`` -> ``{"mb": 16.0, "stream": "side"}`` (a sweep's command line), checked."""
    name, _, rest = text.partition(":")
    if name.strip() != "prefetch":
        raise ValueError(f"prefetch: expected 'prefetch:mb=N[,stream=main|side]', got {text!r}")
    fields = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or key not in ("mb", "stream"):
            raise ValueError(f"prefetch: {item!r} in {text!r} is not mb=N or stream=main|side")
        if key == "mb":
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"prefetch: mb={value!r} in {text!r} is not a number") from None
        fields[key] = value
    if "mb" not in fields:
        raise ValueError(f"prefetch: {text!r} gives no mb=N")
    with ahead(**fields):  # the checks of ahead itself
        pass
    return fields


@contextlib.contextmanager
def layer_chain(start):
    """One layer's chain of products (``models.stacked.scan_blocks``): its first product's read-ahead follows
    ``start`` (the layer's input: its first array, or a pytree's), each later one the product before it. Nothing
    without :func:`ahead`, or without an array to follow."""
    leaves = jax.tree.leaves(start)
    if _AHEAD.get() is None or not leaves:
        yield
        return
    token = _CHAIN.set({"output": leaves[0], "input": None})
    try:
        yield
    finally:
        _CHAIN.reset(token)


def leading_rows(shape, itemsize: int, nbytes: int) -> int:
    """Rows (along the first axis of one layer, ``shape``) holding ``nbytes``: at least one, at most all."""
    rows, row_bytes = shape[0], math.prod(shape[1:]) * itemsize
    return max(1, min(rows, nbytes // max(row_bytes, 1)))


def read_token(stack, layer, after, *, nbytes: int, stream: str = "main"):
    """XOR of the leading ``nbytes`` of ``stack[layer]`` (its bits: every byte read once) -> an int32 scalar,
    computed once ``after`` (an array) exists, on ``stream``."""
    if stream not in STREAMS:
        raise ValueError(f"prefetch: stream must be one of {STREAMS}, got {stream!r}")
    rows = leading_rows(stack.shape[1:], stack.dtype.itemsize, nbytes)
    layer = jnp.asarray(layer, jnp.int32)

    def token(stack, layer, after):
        # lax primitives only: a nested jit on the side stream becomes an async call of its own inside the
        # stream's, which XLA cannot give a stream to ("No ExecutionStreamId found").
        # ``after`` enters the slice's index (as a zero XLA cannot fold: x * 0 is not 0 for every float), so the
        # reads themselves wait for it: joined only to the reduction's result, XLA split the reads off into a
        # kernel that depended on nothing, and a layer's read-aheads all started with the layer.
        first = jax.lax.reshape(after, (after.size,))[0]
        start = layer + jax.lax.convert_element_type(first * 0, layer.dtype)
        part = jax.lax.dynamic_slice(stack, (start,) + (0,) * (stack.ndim - 1), (1, rows) + stack.shape[2:])
        bits = jax.lax.bitcast_convert_type(part, _UNSIGNED[stack.dtype.itemsize])
        xor = jax.lax.reduce(bits, bits.dtype.type(0), jax.lax.bitwise_xor, tuple(range(bits.ndim)))
        return jax.lax.convert_element_type(xor, jnp.int32)

    if stream == "main":
        return jax.lax.optimization_barrier(token(stack, layer, after))  # a kernel of its own, not fused into x's
    return _on_side_stream(token)(stack, layer, after)


def _on_side_stream(fn):
    """``fn`` on a second GPU stream. jax >= 0.11 wraps a function; jax 0.10 has only the context-manager form,
    around a jitted function."""
    from jax.experimental import compute_on as co

    try:
        return co.compute_on(fn, compute_type=SIDE_STREAM, out_memory_spaces=jax.memory.Space.Device)
    except (TypeError, AttributeError):  # jax 0.10: compute_on(compute_type) is a context manager, no jax.memory
        jitted = jax.jit(fn)

        def wrapped(*args):
            with co.compute_on(SIDE_STREAM):
                return jitted(*args)
        return wrapped


def readable(leaf) -> bool:
    """Whether :func:`read_token` can take this weight array: whole bytes (not jnp.int4 codes), a leading layer axis
    and at least one more."""
    return (isinstance(leaf, jax.Array) and leaf.ndim >= 2 and leaf.dtype.itemsize in _UNSIGNED
            and jnp.dtype(leaf.dtype).name not in ("int4", "uint4"))


def before(x, w):
    """``x`` for the product of ``w`` (a ``LayerSlice``), with the read-ahead of ``w``'s weights joined to it
    where a chain is open, x is a decode step's and ``w`` is not x's second product in a row."""
    chain, plan = _CHAIN.get(), _AHEAD.get()
    if chain is None or plan is None or math.prod(x.shape[:-1]) > DECODE_ROWS or x is chain["input"]:
        return x
    chain["input"] = x
    arrays = [a for a in jax.tree.leaves(w.stack) if readable(a)]
    if not arrays:
        return x
    largest = max(arrays, key=lambda a: a.size * a.dtype.itemsize)
    token = read_token(largest, w.layer, chain["output"], nbytes=plan.nbytes, stream=plan.stream)
    return x + (token.astype(jnp.float32) * 0.0).astype(x.dtype)


def after(y) -> None:
    """Record ``y``, a product's output, as what the next product's read-ahead follows."""
    chain = _CHAIN.get()
    if chain is not None:
        chain["output"] = y


__all__ = ["Ahead", "STREAMS", "after", "ahead", "before", "current", "layer_chain", "leading_rows", "parse",
           "read_token", "readable"]
