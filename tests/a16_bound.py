"""The error bound of a weight-only product whose activations are quantized to int16 per flush group.

The native decode kernels (row-major) and the integer prefill panels quantize x per row and per flush
group -- the weight's groups along ``in``, or 128 values for one group a row -- with scale absmax / 32767,
then sum exactly in int32. Their error is that rounding (at most half a step per value, times the weights
it meets) plus float32 summation; a wrong nibble, offset, scale or group index moves a result by orders more.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.qarray import QArray, expand_to

EPS = np.finfo(np.float32).eps


def a16_bound(x: np.ndarray, w: QArray, nk: bool = False, levels: int = 32767) -> np.ndarray:
    """Per output [rows, out]: int16 rounding of x per flush group (half a step times sum |w|) + float32
    summation, from the actual magnitudes of ``x`` [rows, in] and the ``(in, out)`` kernel ``w`` (``nk``:
    an ``(out, in)`` one). ``levels``: the codes' absmax, 32767 (int16) or 127 (int8 activations)."""
    view = (lambda a: np.asarray(a, np.float64).T) if nk else (lambda a: np.asarray(a, np.float64))
    k, tile = (w.shape[1], w.tile[1]) if nk else (w.shape[0], w.tile[0])
    g = tile if tile < k else 128
    absw = np.abs(view(w.dequantize()))
    if w.zero_point is not None:  # the kernels fold zp * sum(x) separately: its terms count too
        absw = absw + np.abs(view(expand_to(w.zero_point.astype(jnp.float32) * w.scale, w.shape, w.tile)))
    bound = np.zeros((x.shape[0], absw.shape[1]))
    for k0 in range(0, k, g):
        xs = np.abs(x[:, k0:k0 + g].astype(np.float64))
        step = xs.max(axis=1, keepdims=True) / levels
        bound += 0.5 * step * absw[k0:k0 + g].sum(axis=0)[None] * (1 + 1e-3)
    mag = np.abs(x.astype(np.float64)) @ absw
    return bound + 4 * (k + 8) * EPS * mag + 1e-30
