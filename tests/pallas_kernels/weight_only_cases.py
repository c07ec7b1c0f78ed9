"""What the Mosaic GPU weight-only kernels' tests share: devices to trace for, quantized weights, and the kernels'
scale and zero-point arguments."""

import types

import jax
import jax.numpy as jnp

from llmeq_jax.core.quantize import Spec, quantize

FAKE_H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
FAKE_A100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")


def quantized(k, n, group, zero_point, seed, bits):
    """A (k, n) weight of scale 0.05 quantized to ``bits`` per channel (``group`` None) or in groups, with zero points
    or symmetric."""
    w = jax.random.normal(jax.random.key(seed), (k, n)) * 0.05
    granularity = "channel" if group is None else "group"
    return quantize(w, Spec(bits=bits, granularity=granularity, group_size=group, symmetric=not zero_point))


def kernel_scales(q, group):
    """A QArray's scale and zero point as the kernels take them: (G, N) float32 and int8 (or None)."""
    k, n = q.shape
    groups = 1 if group is None else k // group
    scale = jnp.broadcast_to(q.scale.astype(jnp.float32), (groups, n))
    zp = None if q.zero_point is None else jnp.broadcast_to(q.zero_point, (groups, n)).astype(jnp.int8)
    return scale, zp
