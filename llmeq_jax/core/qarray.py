"""QArray: one pytree for every quantized tensor (weights, activations, KV cache).

Layout (DESIGN §2):

* ``qvalue`` -- signed integers in ``[-2^(b-1), 2^(b-1) - 1]``. For ``bits <= 4``
  they are packed two (3-4 bit) or four (2 bit) per byte along ``pack_axis``,
  so a 4-bit tensor really occupies half the bytes of an int8 one.
* ``scale`` -- float, same rank as the logical array. Along each dim ``d`` the
  scale has ``ceil(shape[d] / tile[d])`` entries: ``tile[d] == shape[d]`` means
  one scale for the whole dim, ``1`` one per element, anything else a group.
  A group size need not divide the dim: the last group is shorter.
* ``zero_point`` -- integer offset with the scale's shape (asymmetric), or None.

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


def values_per_byte(bits: int) -> int:
    """How many values share one stored byte: 4 for 2-bit, 2 for 3/4-bit, else 1."""
    if bits <= 2:
        return 4
    if bits <= 4:
        return 2
    return 1


def container_bits(bits: int) -> int:
    """Bits each value occupies in storage (3-bit values live in 4-bit slots)."""
    return 8 // values_per_byte(bits)


# --------------------------------------------------------------------------- packing


def pack(values: jax.Array, bits: int, axis: int) -> jax.Array:
    """Pack signed ``bits``-bit integers along ``axis`` into uint8 bytes.

    Values are stored in two's complement within their slot; the axis is padded
    with zeros up to a multiple of the values per byte.
    """
    per_byte = values_per_byte(bits)
    if per_byte == 1:
        return values.astype(jnp.int8)
    axis = axis % values.ndim
    width = container_bits(bits)
    n = values.shape[axis]
    pad = (-n) % per_byte
    if pad:
        widths = [(0, 0)] * values.ndim
        widths[axis] = (0, pad)
        values = jnp.pad(values, widths)
    mask = (1 << width) - 1
    u = values.astype(jnp.int32) & mask
    # Split the axis into (bytes, per_byte) in place: no transpose of the array.
    u = u.reshape(*u.shape[:axis], -1, per_byte, *u.shape[axis + 1 :])
    shifts = (jnp.arange(per_byte, dtype=jnp.int32) * width).reshape((per_byte,) + (1,) * (values.ndim - axis - 1))
    return jnp.sum(u << shifts, axis=axis + 1).astype(jnp.uint8)


def unpack(packed: jax.Array, bits: int, axis: int, size: int) -> jax.Array:
    """Inverse of :func:`pack`: int8 values, ``size`` of them along ``axis``."""
    per_byte = values_per_byte(bits)
    if per_byte == 1:
        return packed.astype(jnp.int8)
    axis = axis % packed.ndim
    width = container_bits(bits)
    trailing = (1,) * (packed.ndim - axis - 1)
    shifts = (jnp.arange(per_byte, dtype=jnp.int32) * width).reshape((per_byte,) + trailing)
    # (..., bytes, ...) -> (..., bytes, per_byte, ...): slots next to their byte, no transpose.
    u = (jnp.expand_dims(packed.astype(jnp.int32), axis + 1) >> shifts) & ((1 << width) - 1)
    # Sign-extend from `width` bits.
    s = jnp.where(u >= (1 << (width - 1)), u - (1 << width), u)
    s = s.reshape(*packed.shape[:axis], -1, *packed.shape[axis + 1 :])
    return jax.lax.slice_in_dim(s, 0, size, axis=axis).astype(jnp.int8)


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
            a = jnp.repeat(a, t, axis=d, total_repeat_length=a.shape[d] * t)
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
    # "uniform" or "log2" (sign + exponent codes, core/log2grid.py); only dequantize differs.
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
        if values_per_byte(self.bits) == 1:
            return self.qvalue
        return unpack(self.qvalue, self.bits, self.pack_axis, self.shape[self.pack_axis])

    def dequantize(self, dtype: Any = None) -> jax.Array:
        dtype = self.dtype if dtype is None else dtype
        if self.grid == "log2":
            from llmeq_jax.core import log2grid

            rel = log2grid.decode(self.values(), self.bits)
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
            act = f", act=int{self.act_spec.bits}/{'static' if self.act_scale is not None else 'dynamic'}"
        kind = "log2-" if self.grid == "log2" else "int"
        return (
            f"QArray({kind}{self.bits} {zp}, shape={self.shape}, {self.granularity}, "
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
