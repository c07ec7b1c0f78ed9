"""An RMSNorm's output left unevaluated for the decode products that read it, which fold the norm in.

In a Llama-family block the two norms feed only products (q/k/v, gate/up). Where those run as Pallas kernels
that can fold a norm (``pallas_kernels.norm_fold``: the float and int4 word kernels, reading a layer of the
stacked blocks in place), ``models.layers.RMSNorm(fold=True)`` returns a :class:`NormedRows` instead of the
normalized rows, and ``ops.linear`` hands its input, scale and eps to the kernel: no launch for the norm. Any
other consumer takes :meth:`NormedRows.value`, the norm as it was (evaluated once, however many ask).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from llmeq_jax import kernel_dispatch
from llmeq_jax.layer_slice import LayerSlice


def rms_norm(x: jax.Array, scale, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps) * scale`` in float32, out in x's dtype. ``scale``: (K,), or a
    :class:`LayerSlice` of a stacked block's norm, which the norm kernel reads in place where it runs."""
    if isinstance(scale, LayerSlice):
        y = kernel_dispatch.rms_norm(x, scale.stack, eps, layer=scale.layer)
        if y is not None:
            return y
        scale = scale.value()
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


@dataclasses.dataclass(eq=False)
class NormedRows:
    """``rms_norm(x, scale, eps)`` not yet evaluated: ``x`` a decode step's rows, ``scale`` a layer of the stacked
    blocks' norm scales (:class:`LayerSlice`)."""

    x: jax.Array
    scale: LayerSlice
    eps: float
    _evaluated: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.x.shape

    @property
    def dtype(self):
        return self.x.dtype

    @property
    def ndim(self) -> int:
        return self.x.ndim

    def value(self) -> jax.Array:
        """The normalized rows (the first call evaluates them; the rest share that)."""
        if not self._evaluated:
            self._evaluated.append(rms_norm(self.x, self.scale, self.eps))
        return self._evaluated[0]

    def fold_for(self, layer):
        """The norm as a product of the weights' ``layer`` folds it (``pallas_kernels.norm_fold.NormFold``: the
        stacked scale, read at that layer), or None where the scale is another layer's."""
        from pallas_kernels.norm_fold import NormFold

        return NormFold(self.scale.stack, float(self.eps)) if self.scale.layer is layer else None


def normed(x: jax.Array, scale, eps: float):
    """A :class:`NormedRows` where the products after the norm may fold it (a stacked block's scale and
    ``kernel_dispatch.folds_norm``), else the norm evaluated."""
    if isinstance(scale, LayerSlice) and isinstance(scale.stack, jax.Array) and kernel_dispatch.folds_norm(x):
        return NormedRows(x, scale, eps)
    return rms_norm(x, scale, eps)


__all__ = ["NormedRows", "normed", "rms_norm"]
