"""QArray: one pytree for every quantized tensor (weights, activations, KV cache).

Layout (DESIGN §2):

* ``qvalue`` -- signed integers in ``[-2^(b-1), 2^(b-1) - 1]``. For ``bits <= 4``
  they are packed along ``pack_axis``: four 2-bit values per byte, eight 3-bit
  values per three bytes, two 4-bit values per byte (:func:`packing`), so a
  4-bit tensor really occupies half the bytes of an int8 one and a 3-bit one
  three eighths.
* ``scale`` -- float, same rank as the logical array. Along each dim ``d`` the
  scale has ``ceil(shape[d] / tile[d])`` entries: ``tile[d] == shape[d]`` means
  one scale for the whole dim, ``1`` one per element, anything else a group.
  A group size need not divide the dim: the last group is shorter.
* ``zero_point`` -- integer offset with the scale's shape (asymmetric), or None. Quantizers store
  int8; a GGUF file kept quantized (``models.gguf_blocks``: Q4_1, Q5_1, K-quants) brings float32
  zero points (its block minimum over its scale), which every formula here and the CPU kernels take
  as they are (the GPU kernels do not: ``kernel_dispatch.plan``).

``dequantize(q) = (qvalue - zero_point) * scale`` broadcast over tiles.

A weight QArray may also say how the activations that meet it are quantized
(``act_spec`` and, for a static scale, ``act_scale``): that is how
``ops.linear`` picks W8A8 without the model knowing about methods.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)


def check_bits(bits: int) -> None:
    if not isinstance(bits, (int, np.integer)) or int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; expected an integer in {list(SUPPORTED_BITS)}")


def int_range(bits: int) -> tuple[int, int]:
    """Signed storage range of a ``bits``-bit integer."""
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def packing(bits: int) -> tuple[int, int]:
    """``(values, bytes)`` of one packed chunk along the pack axis.

    Four 2-bit or two 4-bit values share a byte; eight 3-bit values share three bytes
    (24 bits, none wasted: in 4-bit slots a quarter of a 3-bit tensor's bytes would be
    padding); 5-8-bit values take one int8 each.
    """
    return {2: (4, 1), 3: (8, 3), 4: (2, 1)}.get(int(bits), (1, 1))


def is_packed(bits: int) -> bool:
    """Whether ``bits``-bit values share bytes (2-4 bits), i.e. ``qvalue`` is not one int8 per value."""
    return packing(bits)[0] > 1


def packed_length(n: int, bits: int) -> int:
    """Stored bytes along the pack axis for ``n`` values (the last chunk zero-padded)."""
    values, nbytes = packing(bits)
    return math.ceil(n / values) * nbytes


# --------------------------------------------------------------------------- packing


def _split_axis(a: jax.Array, axis: int, inner: int) -> jax.Array:
    """``a`` with ``axis`` split into ``(a.shape[axis] // inner, inner)`` in place (no transpose)."""
    return a.reshape(*a.shape[:axis], -1, inner, *a.shape[axis + 1 :])


def _merge_axis(a: jax.Array, axis: int) -> jax.Array:
    """Inverse of :func:`_split_axis`: dims ``axis`` and ``axis + 1`` merged."""
    return a.reshape(*a.shape[:axis], -1, *a.shape[axis + 2 :])


def pack(values: jax.Array, bits: int, axis: int) -> jax.Array:
    """Pack signed ``bits``-bit integers along ``axis`` into uint8 bytes (:func:`packing`).

    Each chunk of values is one little-endian word: value ``i`` of the chunk in bits
    ``[i * bits, (i + 1) * bits)``, two's complement; the word's bytes follow each other
    along the axis. The axis is zero-padded to whole chunks.
    """
    per_chunk, nbytes = packing(bits)
    if per_chunk == 1:
        return values.astype(jnp.int8)
    axis = axis % values.ndim
    n = values.shape[axis]
    pad = (-n) % per_chunk
    if pad:
        widths = [(0, 0)] * values.ndim
        widths[axis] = (0, pad)
        values = jnp.pad(values, widths)
    trailing = (1,) * (values.ndim - axis - 1)
    u = _split_axis(values.astype(jnp.int32) & ((1 << bits) - 1), axis, per_chunk)
    shifts = (jnp.arange(per_chunk, dtype=jnp.int32) * bits).reshape((per_chunk,) + trailing)
    word = jnp.sum(u << shifts, axis=axis + 1)  # at most 24 bits: fits int32
    if nbytes == 1:
        return word.astype(jnp.uint8)
    byte_shifts = (jnp.arange(nbytes, dtype=jnp.int32) * 8).reshape((nbytes,) + trailing)
    return _merge_axis((jnp.expand_dims(word, axis + 1) >> byte_shifts) & 0xFF, axis).astype(jnp.uint8)


def unpack(packed: jax.Array, bits: int, axis: int, size: int) -> jax.Array:
    """Inverse of :func:`pack`: int8 values, ``size`` of them along ``axis``."""
    per_chunk, nbytes = packing(bits)
    if per_chunk == 1:
        return packed.astype(jnp.int8)
    axis = axis % packed.ndim
    trailing = (1,) * (packed.ndim - axis - 1)
    word = packed.astype(jnp.int32)
    if nbytes > 1:
        byte_shifts = (jnp.arange(nbytes, dtype=jnp.int32) * 8).reshape((nbytes,) + trailing)
        word = jnp.sum(_split_axis(word, axis, nbytes) << byte_shifts, axis=axis + 1)
    shifts = (jnp.arange(per_chunk, dtype=jnp.int32) * bits).reshape((per_chunk,) + trailing)
    # (..., chunks, ...) -> (..., chunks, per_chunk, ...): values next to their chunk, no transpose.
    u = (jnp.expand_dims(word, axis + 1) >> shifts) & ((1 << bits) - 1)
    s = jnp.where(u >= (1 << (bits - 1)), u - (1 << bits), u)  # sign-extend from `bits` bits
    return jax.lax.slice_in_dim(_merge_axis(s, axis), 0, size, axis=axis).astype(jnp.int8)


# --------------------------------------------------------------------------- tiles


def scale_shape(shape: tuple[int, ...], tile: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.ceil(s / t) for s, t in zip(shape, tile))


def expand_to(a: jax.Array, shape: tuple[int, ...], tile: tuple[int, ...]) -> jax.Array:
    """Broadcast a per-tile array (scale / zero point) to the logical ``shape``.

    Dims with one entry broadcast; grouped dims repeat each entry ``tile[d]``
    times and cut the (possibly shorter) last group to size.
    """
    for d, (size, t) in enumerate(zip(shape, tile)):
        if a.shape[d] not in (1, size):
            # A broadcast over a new axis then a merge, not jnp.repeat: repeat lowers to a gather over an
            # index array (a GPU prefill dequantized every weight through one); this stays elementwise.
            groups = a.shape[d]
            a = jnp.broadcast_to(jnp.expand_dims(a, d + 1), a.shape[: d + 1] + (t,) + a.shape[d + 1 :])
            a = a.reshape(a.shape[:d] + (groups * t,) + a.shape[d + 2 :])
            a = jax.lax.slice_in_dim(a, 0, size, axis=d)
    return jnp.broadcast_to(a, shape)


def granularity_name(shape: tuple[int, ...], tile: tuple[int, ...]) -> str:
    """Human-readable granularity, e.g. ``per-tensor``, ``per-channel(1)``, ``group(0:128)``."""
    if tuple(tile) == tuple(shape):
        return "per-tensor"
    grouped = [f"{d}:{t}" for d, (s, t) in enumerate(zip(shape, tile)) if 1 < t < s]
    kept = [str(d) for d, (s, t) in enumerate(zip(shape, tile)) if t == 1 and s > 1]
    if grouped:
        return f"group({','.join(grouped)})"
    return f"per-channel({','.join(kept)})"


# --------------------------------------------------------------------------- QArray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized array. See the module docstring for the layout."""

    qvalue: jax.Array
    scale: jax.Array
    zero_point: jax.Array | None
    act_scale: jax.Array | None = None
    bits: int = dataclasses.field(default=8, metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    tile: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    dtype: Any = dataclasses.field(default=jnp.float32, metadata=dict(static=True))
    pack_axis: int = dataclasses.field(default=0, metadata=dict(static=True))
    act_spec: Any = dataclasses.field(default=None, metadata=dict(static=True))
    # "uniform", "log2" (sign + exponent codes, core/log2grid.py) or "fp8" (E4M3 bit patterns,
    # core/fp8grid.py); only dequantize differs.
    grid: str = dataclasses.field(default="uniform", metadata=dict(static=True))

    # -- logical view -----------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def symmetric(self) -> bool:
        return self.zero_point is None

    @property
    def granularity(self) -> str:
        return granularity_name(self.shape, self.tile)

    @property
    def T(self) -> "QArray":  # noqa: N802 - numpy naming
        raise TypeError("QArray has no transpose view; quantize the transposed float array instead")

    def values(self) -> jax.Array:
        """The integer values, unpacked to int8 with the logical shape."""
        if not is_packed(self.bits):
            return self.qvalue
        return unpack(self.qvalue, self.bits, self.pack_axis, self.shape[self.pack_axis])

    def dequantize(self, dtype: Any = None) -> jax.Array:
        dtype = self.dtype if dtype is None else dtype
        if self.grid == "log2":
            from llmeq_jax.core import log2grid

            rel = log2grid.decode(self.values(), self.bits)
            return (rel * expand_to(self.scale.astype(jnp.float32), self.shape, self.tile)).astype(dtype)
        if self.grid == "fp8":
            from llmeq_jax.core import fp8grid

            rel = fp8grid.decode(self.qvalue)
            return (rel * expand_to(self.scale.astype(jnp.float32), self.shape, self.tile)).astype(dtype)
        q = self.values().astype(jnp.float32)
        if self.zero_point is not None:
            q = q - expand_to(self.zero_point.astype(jnp.float32), self.shape, self.tile)
        return (q * expand_to(self.scale.astype(jnp.float32), self.shape, self.tile)).astype(dtype)

    # -- storage ----------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes really stored: packed values + scales + zero points (+ activation scale)."""
        return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(self))

    def __repr__(self) -> str:
        zp = "asymmetric" if self.zero_point is not None else "symmetric"
        act = ""
        if self.act_spec is not None:
            a = "fp8" if self.act_spec.grid == "fp8" else f"int{self.act_spec.bits}"
            act = f", act={a}/{'static' if self.act_scale is not None else 'dynamic'}"
        kind = {"log2": f"log2-{self.bits}", "fp8": "fp8-e4m3"}.get(self.grid, f"int{self.bits}")
        return (
            f"QArray({kind} {zp}, shape={self.shape}, {self.granularity}, "
            f"scale={tuple(self.scale.shape)}, dtype={jnp.dtype(self.dtype).name}, "
            f"nbytes={self.nbytes}{act})"
        )


def is_qarray(x: Any) -> bool:
    """`is_leaf` for tree walks that must keep a QArray whole instead of visiting its children."""
    return isinstance(x, QArray)


def tree_nbytes(tree: Any) -> int:
    """Bytes of a parameter tree as stored (QArrays count their packed storage)."""
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in leaves)
