"""Building blocks shared by the model families (Flax linen).

Every parameter is read with ``self.variable("params", ...)`` rather than
``self.param``: linen's ``param`` re-runs the initializer's shape check against
the stored leaf, which a packed ``QArray`` (int4: half the rows) would fail.
``variable`` hands the stored leaf back as it is, so a quantized tree runs in
the same code and ``ops.linear`` picks the matmul path from the leaf's type.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from llmeq_jax import normed_rows, ops
from llmeq_jax.layer_slice import LayerSlice

_INIT_STD = 0.02

def _normal_init(module: nn.Module, shape: tuple[int, ...]):
    return lambda: _INIT_STD * jax.random.normal(module.make_rng("params"), shape, jnp.float32)


class Linear(nn.Module):
    """``x @ kernel + bias`` through ``ops.linear``; kernel is ``(in, out)``, float or QArray. ``residual``:
    ``residual + (x @ kernel + bias)``, which a decode step's kernel may add itself (``ops.linear``)."""

    features: int
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None = None) -> jax.Array:
        kernel = self.variable("params", "kernel", _normal_init(self, (x.shape[-1], self.features))).value
        bias = None
        if self.use_bias:
            bias = self.variable("params", "bias", lambda: jnp.zeros((self.features,), jnp.float32)).value
        return ops.linear(x, kernel, bias, residual=residual)


def parallel_linears(module: nn.Module, x: jax.Array, fused_name: str, linears) -> list[jax.Array]:
    """The outputs of several ``Linear`` s of the same input ``x``, created inside ``module``.

    ``linears``: ``(name, features, use_bias)`` per linear. When the param tree holds
    ``fused_name`` instead (the decode layout stacks such siblings into one kernel,
    ``decode_layout.FUSED_LINEARS``), one product runs and its output is split.
    """
    if module.has_variable("params", fused_name):
        widths = [features for _, features, _ in linears]
        fused = Linear(sum(widths), any(bias for _, _, bias in linears), name=fused_name)(x)
        cuts = [sum(widths[: i + 1]) for i in range(len(widths) - 1)]
        return jnp.split(fused, cuts, axis=-1)
    return [Linear(features, bias, name=name)(x) for name, features, bias in linears]


class Embed(nn.Module):
    """Row lookup in an ``(num_embeddings, features)`` table, float or QArray (only the rows read are dequantized)."""

    num_embeddings: int
    features: int

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        table = self.variable("params", "embedding", _normal_init(self, (self.num_embeddings, self.features))).value
        return ops.take_rows(table, ids)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32, output in the input dtype.

    ``fold``: the caller passes the output only to ``Linear`` s, so where their kernels can fold the norm in
    (a decode step of stacked blocks on a GPU) it may come back unevaluated (``llmeq_jax.normed_rows``)."""

    eps: float
    fold: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        # a scanned block's scale may be a LayerSlice: left in its stack for the norm kernel or a folding product
        scale = self.variable("params", "scale", lambda: jnp.ones((x.shape[-1],), jnp.float32)).value
        return normed_rows.normed(x, scale, self.eps) if self.fold else normed_rows.rms_norm(x, scale, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with scale and bias, computed in float32."""

    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.variable("params", "scale", lambda: jnp.ones((x.shape[-1],), jnp.float32)).value
        bias = self.variable("params", "bias", lambda: jnp.zeros((x.shape[-1],), jnp.float32)).value
        scale = scale.value() if isinstance(scale, LayerSlice) else scale  # no kernel: the layer's slice
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def apply_kron(x: jax.Array, factors) -> jax.Array:
    """``x @ kron(f_0, f_1, ...)`` over the last axis without forming the product (one small matmul per factor)."""
    lead = x.shape[:-1]
    y = x.reshape(*lead, *[int(f.shape[0]) for f in factors])
    k = len(lead)
    for i, f in enumerate(factors):
        y = jnp.moveaxis(jnp.tensordot(y, jnp.asarray(f, y.dtype), axes=([k + i], [0])), -1, k + i)
    return y.reshape(x.shape)


# --------------------------------------------------------------------------- attention


def attention_mask(
    query_index: jax.Array, key_valid: jax.Array, sliding_window: int | None = None
) -> jax.Array:
    """Boolean [B, T, S]: query t (at cache slot ``query_index[t]``) may see key slot s.

    Causal over cache slots, restricted to valid (non-padding, written) keys and,
    for sliding-window layers, to the last ``sliding_window`` slots (as HF does:
    ``key > query - window``).
    """
    key_index = jnp.arange(key_valid.shape[-1])
    allowed = key_index[None, :] <= query_index[:, None]  # [T, S]
    if sliding_window is not None:
        allowed &= key_index[None, :] > query_index[:, None] - sliding_window
    return allowed[None, :, :] & key_valid[:, None, :].astype(bool)
