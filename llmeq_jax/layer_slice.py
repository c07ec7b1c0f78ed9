"""One layer of a stacked quantized kernel, for the kernels that read it in place.

Inside the ``lax.scan`` over stacked decoder blocks (``models/stacked.py``) each block's
weights are a dynamic slice of arrays with a leading layer axis. XLA hands a custom call
(a Pallas kernel) whole buffers, so it copies each slice out first: a decode step then
reads every quantized weight three times (slice read, copy write, kernel read) instead of
once. A :class:`LayerSlice` keeps the stack and the traced layer index instead;
``ops.linear`` passes both to a kernel that indexes the layer itself
(``pallas_kernels.weight_only``'s and ``w8a8``'s ``layer=``, the native row-major CPU kernels'
``native.row_major_matmul(..., layer=)``; float kernels' ``pallas_kernels.float_matmul`` where a measured
dispatch table chose it, and on a CPU ``native.float_matmul`` at decode's rows), and takes the slice (:meth:`LayerSlice.value`) for
every other path, which is what the scan did before.
"""

from __future__ import annotations

import dataclasses

import jax

from llmeq_jax.core.qarray import QArray


def take_layer(a, layer):
    """Layer ``layer`` of the stacked array ``a`` (None stays None)."""
    return None if a is None else jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerSlice:
    """Layer ``layer`` of ``stack``: a QArray whose arrays carry a leading layer axis (its static
    metadata -- shape, bits, tile -- is one layer's, as ``jnp.stack`` over QArrays leaves it)."""

    # or a decode_layout.RowMajorKernel / Int4WordKernel / Int4RowKernel holding such a stack, or a float [L, ...]
    stack: QArray
    layer: jax.Array  # int32 scalar, traced inside the scan

    @property
    def shape(self) -> tuple[int, ...]:
        """One layer's logical shape (what ``ops.linear`` checks)."""
        return self.stack.shape[1:] if isinstance(self.stack, jax.Array) else self.stack.shape

    def value(self) -> QArray:
        """The layer as a value of its own (a dynamic slice of every array): a QArray, a wrapped layout,
        or a float array."""
        return jax.tree.map(lambda a: take_layer(a, self.layer), self.stack)
