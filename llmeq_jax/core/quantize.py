"""Scales, zero points, quantize, dequantize and fake-quant (STE).

Pure functions on arrays, jit-able, no globals. A :class:`Spec` says *how* to
quantize; :func:`tile_for` turns it into the per-dim tile of a concrete shape;
:func:`quantize` does the rest.

Numerics
  symmetric:  qmax = 2^(b-1) - 1, scale = absmax / qmax, q = round(x / scale)
              (the largest magnitude is exactly representable; values live in
              [-qmax, qmax]).
  asymmetric: the range [min(x, 0), max(x, 0)] maps onto [-2^(b-1), 2^(b-1)-1];
              zero_point = round(qmin - lo / scale) is an integer, so 0.0 is
              exactly representable; q = clip(round(x / scale) + zero_point).
  clipping:   a fixed ratio (0, 1] of the range, a percentile of |x| per tile,
              "mse": the ratio from a grid that minimises the squared error
              per tile, or "rms": mean +- gamma standard deviations per tile
              (gamma the Gaussian-optimal value for the width).
  scale_dtype: "float16" rounds each scale to a float16 value *before* the
              integers are computed (and recomputes asymmetric zero points on
              it), so a format that stores float16 scales (GGUF's Q4_0/Q4_1/
              Q8_0) holds the grid exactly. Asymmetric grids (up to 4 bits)
              keep 7 significand bits, so that (zp + 8) * scale, GGUF Q4_1's
              block minimum, is a float16 value too.

Bad input
  non-finite: :func:`quantize` raises on NaN/Inf in a concrete array
              (``nan_policy="raise"``, the default). Traced code cannot raise on
              values, so there (and with ``nan_policy="propagate"``) a tile whose
              range is not finite gets a NaN scale: its values dequantize to NaN,
              never silently to 0.
  extremes:   ranges near the float32 maximum (``hi - lo`` overflows) still give
              finite scales.
  empty:      a zero-size array quantizes to an empty QArray.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax.core import fp8grid, log2grid
from llmeq_jax.core.qarray import QArray, check_bits, expand_to, int_range, pack, scale_shape

Granularity = Literal["tensor", "channel", "group", "token"]
GRANULARITIES = ("tensor", "channel", "group", "token")
SCALE_DTYPES = (None, "float16")
NAN_POLICIES = ("raise", "propagate")
# Value grids: evenly spaced integers, sign + power-of-two exponent (core/log2grid.py), or
# 8-bit floats (E4M3, core/fp8grid.py).
GRIDS = ("uniform", "log2", "fp8")
# Clip ratios tried by the MSE search (coarse enough to stay fast, fine near 1).
MSE_GRID = tuple(float(r) for r in np.linspace(0.5, 1.0, 21))


@dataclasses.dataclass(frozen=True)
class Spec:
    """How to quantize one array.

    granularity:
      ``tensor``  one scale for everything.
      ``channel`` one scale per index of ``axis`` (default -1: output features
                  of an ``(in, out)`` kernel).
      ``group``   groups of ``group_size`` along ``axis`` (default 0: the
                  contraction dim of an ``(in, out)`` kernel), one scale per
                  group and per index of every other dim.
      ``token``   one scale per token: reduce over ``axis`` (default -1, the
                  features of an activation ``(..., tokens, features)``).
    clip: None, a ratio in (0, 1], ``"pNN.N"`` (percentile of |x|), ``"mse"`` (searched per tile)
      or ``"rms"`` / ``"rmsG"``: the range cut to mean +- gamma standard deviations of the tile
      (second moments; gamma the Gaussian-optimal one for the width, :func:`gaussian_clip_gamma`,
      or ``G``), a smooth function of the weights that QAT's recomputed scales can follow.
    grid: ``uniform`` (integers times the scale) or ``log2`` (sign and power-of-two
      exponent relative to the tile's absmax, see :mod:`llmeq_jax.core.log2grid`;
      symmetric only, stored and packed like uniform codes of the same bits) or ``fp8``
      (E4M3 floats, the tile's absmax mapped onto 448, see :mod:`llmeq_jax.core.fp8grid`; 8 bits,
      symmetric; with an ``fp8`` activation spec a linear runs FP8 x FP8 dots).
    """

    bits: int = 8
    granularity: Granularity = "channel"
    axis: int | None = None
    group_size: int | None = None
    symmetric: bool = True
    clip: float | str | None = None
    scale_dtype: str | None = None
    grid: str = "uniform"

    def __post_init__(self):
        check_bits(self.bits)
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype={self.scale_dtype!r} is not one of {list(SCALE_DTYPES)}")
        if self.scale_dtype == "float16" and not self.symmetric and self.bits > 4:
            # A nibble offset zp + 8 takes 4 of float16's 11 significand bits; wider offsets would leave too few.
            raise ValueError(f"scale_dtype='float16' with asymmetric int{self.bits}: only asymmetric grids of up to "
                             "4 bits keep float16-exact zero offsets (GGUF's Q4_1); use symmetric=True or bits <= 4")
        if self.grid not in GRIDS:
            raise ValueError(f"grid={self.grid!r} is not one of {list(GRIDS)}")
        if self.grid == "log2" and not self.symmetric:
            raise ValueError("grid='log2' is a sign + exponent code around zero; it needs symmetric=True")
        if self.grid == "log2" and self.bits > 7:  # 8-bit codes would need magnitudes down to 2^-126
            raise ValueError(f"grid='log2' takes 2 to 7 bits (a {self.bits}-bit code's smallest magnitude 2^{2 - 2 ** (self.bits - 1)} "
                             "leaves float32's normal range); use a uniform grid for 8 bits")
        if self.grid == "fp8" and (self.bits != 8 or not self.symmetric):
            raise ValueError(f"grid='fp8' is the 8-bit E4M3 float format (sign, exponent, mantissa): it needs bits=8 "
                             f"and symmetric=True, got bits={self.bits}, symmetric={self.symmetric}")
        if self.grid != "uniform" and isinstance(self.clip, str) and self.clip.startswith(("mse", "rms")):
            raise ValueError(f"clip={self.clip!r} is made for uniform grids; with grid={self.grid!r} use None, a ratio "
                             "or 'pNN'")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity={self.granularity!r} is not one of {list(GRANULARITIES)}")
        if self.granularity == "group":
            if self.group_size is None or not isinstance(self.group_size, int) or self.group_size <= 0:
                raise ValueError(f"group granularity needs a positive integer group_size, got {self.group_size!r}")
        elif self.group_size is not None:
            raise ValueError(f"group_size={self.group_size} given with granularity={self.granularity!r}; use 'group'")
        _parse_clip(self.clip)  # validates

    @property
    def default_axis(self) -> int:
        return {"tensor": 0, "channel": -1, "group": 0, "token": -1}[self.granularity]

    def describe(self) -> str:
        g = {"tensor": "per-tensor", "channel": "per-channel", "token": "per-token"}.get(
            self.granularity, f"g{self.group_size}"
        )
        if self.grid == "fp8":
            return f"fp8-e4m3 {g}" + (f" clip={self.clip}" if self.clip else "")
        kind = "log2-" if self.grid == "log2" else "int"
        return (f"{kind}{self.bits} {g} {'sym' if self.symmetric else 'asym'}" + (f" clip={self.clip}" if self.clip else "")
                + (f" {self.scale_dtype} scales" if self.scale_dtype else ""))


def largest_value(spec: Spec) -> float:
    """The largest magnitude of a symmetric ``spec``'s codes, which a tile's absmax maps onto: 448 on the
    fp8 (E4M3) grid, ``2^(bits-1) - 1`` on a uniform one (127 for int8)."""
    return fp8grid.MAX if spec.grid == "fp8" else float(int_range(spec.bits)[1])


CLIP_CHOICES = "a ratio in (0, 1], 'pNN' (percentile), 'mse', 'rms' or 'rmsG' (G > 0: G standard deviations)"


def _parse_clip(clip: float | str | None) -> tuple[str, float]:
    """-> (kind, value) with kind in none | ratio | percentile | mse | rms (value 0: the Gaussian-optimal gamma)."""
    if clip is None:
        return "none", 1.0
    if isinstance(clip, str):
        if clip in ("mse", "rms"):
            return clip, 1.0 if clip == "mse" else 0.0
        for prefix, kind, ok in (("rms", "rms", lambda v: 0.0 < v < math.inf), ("p", "percentile", lambda v: 0.0 < v <= 100.0)):
            if clip.startswith(prefix):
                try:
                    v = float(clip[len(prefix):])
                except ValueError:
                    v = -1.0
                if ok(v):
                    return kind, v
        raise ValueError(f"clip={clip!r} is not understood; expected {CLIP_CHOICES}")
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and 0.0 < float(clip) <= 1.0:
        return "ratio", float(clip)
    raise ValueError(f"clip={clip!r} is not understood; expected {CLIP_CHOICES}")


@functools.lru_cache(maxsize=None)
def gaussian_clip_gamma(bits: int, symmetric: bool) -> float:
    """The clipping half-range, in standard deviations, that minimises the expected squared error of this
    grid on a Gaussian (``clip: rms``; the "second-moment scaling" of ACIQ, Banner et al. 2019).

    Computed, not tabulated: the exact error of rounding to the grid (2^b - 1 levels symmetric, 2^b
    asymmetric, over [-gamma, gamma]) integrated against the normal density, minimised over gamma
    coarse-to-fine. E.g. about 2.0 at 3 bits and 2.5 at 4 (symmetric)."""
    x = np.linspace(-9.0, 9.0, 36001)
    density = np.exp(-0.5 * x * x)
    density /= density.sum()
    qmin, qmax = int_range(bits)
    levels = 2 * qmax if symmetric else qmax - qmin

    def error(gamma: float) -> float:
        step = 2.0 * gamma / levels
        q = np.clip(np.round((x + gamma) / step), 0, levels) * step - gamma
        return float(np.sum((q - x) ** 2 * density))

    best = min(np.arange(0.5, 6.0, 0.05), key=error)
    return float(min(np.arange(best - 0.05, best + 0.05, 0.001), key=error))


def tile_for(spec: Spec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The per-dim tile (elements sharing one scale) of ``spec`` on ``shape``."""
    shape = tuple(int(s) for s in shape)
    ndim = len(shape)
    if ndim == 0:
        return ()
    axis = spec.default_axis if spec.axis is None else spec.axis
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for an array of shape {shape}")
    axis %= ndim
    # A zero-size dim still gets a tile of 1: the scale shape divides by the tile.
    whole = tuple(max(s, 1) for s in shape)
    if spec.granularity == "tensor":
        return whole
    if spec.granularity == "channel":
        return tuple(1 if d == axis else s for d, s in enumerate(whole))
    if spec.granularity == "token":
        return tuple(s if d == axis else 1 for d, s in enumerate(whole))
    return tuple(min(spec.group_size, s) if d == axis else 1 for d, s in enumerate(whole))


# --------------------------------------------------------------------------- tile reductions


def _blocked(x: jax.Array, tile: tuple[int, ...], fill: float) -> jax.Array:
    """Reshape ``x`` to (n0, t0, n1, t1, ...), padding ragged last tiles with ``fill``."""
    pads = [(0, (-s) % t) for s, t in zip(x.shape, tile)]
    if any(p for _, p in pads):
        x = jnp.pad(x, pads, constant_values=fill)
    blocked_shape = []
    for s, t in zip(x.shape, tile):
        blocked_shape += [s // t, t]
    return x.reshape(blocked_shape)


def _tile_axes(ndim: int) -> tuple[int, ...]:
    return tuple(range(1, 2 * ndim, 2))


def tile_reduce(x: jax.Array, tile: tuple[int, ...], op: str) -> jax.Array:
    """Reduce each tile with ``op`` in absmax | min | max | sum; result has the scale's shape."""
    fill = {"absmax": 0.0, "min": jnp.inf, "max": -jnp.inf, "sum": 0.0}[op]
    xf = x.astype(jnp.float32)
    if all(t in (1, s) for s, t in zip(x.shape, tile)):
        # Per-tensor / per-channel / per-token: plain reductions over whole dims,
        # no blocked reshape (XLA's CPU backend fuses these best).
        axes = tuple(d for d, (s, t) in enumerate(zip(x.shape, tile)) if t == s and s > 1)
        fn = {"absmax": lambda a, **k: jnp.max(jnp.abs(a), **k), "min": jnp.min, "max": jnp.max, "sum": jnp.sum}[op]
        return fn(xf, axis=axes, keepdims=True)
    b = _blocked(xf, tile, fill)
    axes = _tile_axes(x.ndim)
    if op == "absmax":
        # max(max, -min) == max|x| exactly; on blocked groups XLA's CPU backend
        # fuses two plain reductions but materialised |x| first (5x slower).
        return jnp.maximum(jnp.max(b, axis=axes), -jnp.min(b, axis=axes))
    if op == "min":
        return jnp.min(b, axis=axes)
    if op == "max":
        return jnp.max(b, axis=axes)
    return jnp.sum(b, axis=axes)


def _split_bits(x):
    """``x`` as high + low float32 parts of at most 12 significant bits each (high is x with its low
    mantissa bits cleared, so the split is exact), whose pairwise products are exact in float32."""
    high_mask = np.uint32(0xFFFFF000)
    if isinstance(x, np.ndarray):
        high = (x.view(np.uint32) & high_mask).view(np.float32)
    else:
        high = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) & high_mask, jnp.float32)
    return high, x - high


def _tile_percentile(x: jax.Array, tile: tuple[int, ...], p: float) -> jax.Array:
    """The ``p``-th percentile of |x| per tile, linear between the two order statistics around it.

    Written out rather than jnp.nanpercentile so that every compiled program rounds it the same way
    (quantize and quantize_dequantize of one x had disagreed by an ulp of the scale): the positions
    and weights are numpy constants (the tile counts are static), and lo + (hi - lo) * w is summed
    from products of 12-bit parts, which are exact, so whether XLA fuses a multiply and an add into
    an FMA (it did in some programs and not in others) cannot change the result.
    """
    b = _blocked(jnp.abs(x.astype(jnp.float32)), tile, jnp.nan)
    nd = x.ndim
    b = jnp.transpose(b, tuple(range(0, 2 * nd, 2)) + _tile_axes(nd))
    ordered = jnp.sort(b.reshape(*b.shape[:nd], -1), axis=-1)  # the NaN padding sorts last
    extents = [np.minimum(t, n - np.arange(0, n, t)) for n, t in zip(x.shape, tile)]
    count = functools.reduce(np.multiply.outer, extents).astype(np.int64)  # values per tile
    pos = p / 100.0 * (count - 1)
    below = np.floor(pos)
    lo_at = below.astype(np.int32)
    hi_at = np.minimum(lo_at + 1, count - 1).astype(np.int32)
    w_high, w_low = _split_bits((pos - below).astype(np.float32))
    lo = jnp.take_along_axis(ordered, lo_at[..., None], axis=-1)[..., 0]
    d_high, d_low = _split_bits(jnp.take_along_axis(ordered, hi_at[..., None], axis=-1)[..., 0] - lo)
    return lo + ((d_high * w_high + (d_high * w_low + d_low * w_high)) + d_low * w_low)


# --------------------------------------------------------------------------- scales


def _exact_divisor(n: int) -> jax.Array:
    """``n`` as a float32 that XLA cannot see as a constant.

    Under jit XLA rewrites ``x / constant`` into ``x * (1 / constant)``, which is not
    exactly rounded (1/127 is inexact), so jitted, eager and sharded quantization could
    give scales one ulp apart. Hiding the constant keeps a true division everywhere.
    """
    return jax.lax.optimization_barrier(jnp.float32(n))


def scale_from_range(lo: jax.Array, hi: jax.Array, bits: int, symmetric: bool):
    """Scale (and integer zero point) for a per-tile range [lo, hi] (absmax in ``hi`` if symmetric).

    A range that is not finite (NaN or Inf in the tile) gives a NaN scale, so the damage
    shows on dequantize instead of turning into zeros or a silently wrong grid.
    """
    qmin, qmax = int_range(bits)
    tiny = jnp.finfo(jnp.float32).tiny
    if symmetric:
        amax = hi
        scale = jnp.where(amax > 0, amax / _exact_divisor(qmax), 1.0)
        # amax at the float32 maximum: a scale rounded up would dequantize +-qmax to Inf.
        scale = jnp.where(jnp.isfinite(scale * qmax), scale, jnp.nextafter(scale, jnp.float32(0)))
        return jnp.where(jnp.isfinite(amax), jnp.maximum(scale, tiny), jnp.nan), None
    lo = jnp.minimum(lo, 0.0)
    hi = jnp.maximum(hi, 0.0)
    span = hi - lo
    # hi - lo overflows to Inf near the float32 maximum (ranges up to twice it). Then: halve
    # before subtracting (exact), spread over one level more and floor the zero point, so the
    # whole grid lies inside [lo, hi] and no grid point dequantizes past the float32 maximum
    # (a rounded zero point could shift the end half a step out, to Inf); the cost there is an
    # error bound of one step instead of half a step.
    wide = ~jnp.isfinite(span)
    scale = jnp.where(wide, (hi * 0.5 - lo * 0.5) / _exact_divisor(qmax - qmin + 1) * 2.0,
                      span / _exact_divisor(qmax - qmin))
    scale = jnp.where(hi > lo, scale, 1.0)
    scale = jnp.where(jnp.isfinite(lo) & jnp.isfinite(hi), jnp.maximum(scale, tiny), jnp.nan)
    zp = qmin - lo / scale
    zero_point = jnp.clip(jnp.where(wide, jnp.floor(zp), jnp.round(zp)), qmin, qmax)
    return scale, jnp.where(jnp.isnan(zero_point), 0.0, zero_point)


def _range(x: jax.Array, tile: tuple[int, ...], symmetric: bool):
    if symmetric:
        return None, tile_reduce(x, tile, "absmax")
    return tile_reduce(x, tile, "min"), tile_reduce(x, tile, "max")


def quantize_values(x: jax.Array, scale, zero_point, bits: int, tile, grid: str = "uniform") -> jax.Array:
    """Integer values (int8, logical shape) of ``x`` on a given grid (log2 grids: sign + exponent codes)."""
    qmin, qmax = int_range(bits)
    s = expand_to(scale, x.shape, tile)
    if grid == "log2":
        return log2grid.encode(x.astype(jnp.float32) / s, bits)
    if grid == "fp8":
        return fp8grid.encode(x.astype(jnp.float32) / s)
    q = jnp.round(x.astype(jnp.float32) / s)
    if zero_point is None:
        return jnp.clip(q, -qmax, qmax).astype(jnp.int8)
    q = q + expand_to(zero_point, x.shape, tile)
    return jnp.clip(q, qmin, qmax).astype(jnp.int8)


def _dequant_values(q, scale, zero_point, shape, tile, grid="uniform", bits=8):
    if grid == "log2":
        return log2grid.decode(q, bits) * expand_to(scale, shape, tile)
    if grid == "fp8":
        return fp8grid.decode(q) * expand_to(scale, shape, tile)
    q = q.astype(jnp.float32)
    if zero_point is not None:
        q = q - expand_to(zero_point, shape, tile)
    return q * expand_to(scale, shape, tile)


def _mse_scale(x, tile, bits, symmetric, weight=None):
    """Per tile, the clip ratio from MSE_GRID with the lowest squared error.

    ``weight`` (broadcastable to ``x``): the error of each element counts that many times, e.g.
    GPTQ's Hessian diagonal per input row (how much the layer's output feels that row's error).
    """
    lo, hi = _range(x, tile, symmetric)
    xf = x.astype(jnp.float32)

    def error(ratio):
        scale, zp = scale_from_range(None if lo is None else lo * ratio, hi * ratio, bits, symmetric)
        q = quantize_values(xf, scale, zp, bits, tile)
        err = (_dequant_values(q, scale, zp, x.shape, tile) - xf) ** 2
        if weight is not None:
            err = err * weight
        return tile_reduce(err, tile, "sum"), scale, zp

    def step(best, ratio):
        err, scale, zp = error(ratio)
        better = err < best[0]
        new_zp = None if zp is None else jnp.where(better, zp, best[2])
        return (jnp.where(better, err, best[0]), jnp.where(better, scale, best[1]), new_zp), None

    init = error(1.0)
    (_, scale, zp), _ = jax.lax.scan(step, init, jnp.asarray(MSE_GRID[:-1], jnp.float32))
    return scale, zp


def round_significand(x: jax.Array, bits: int) -> jax.Array:
    """``x`` rounded (half to even) to ``bits`` significand bits, the leading one included."""
    m, e = jnp.frexp(x)  # x = m * 2^e, 0.5 <= |m| < 1
    return jnp.ldexp(jnp.round(jnp.ldexp(m, bits)), e - bits)


def storable_scale(scale: jax.Array, zero_point: jax.Array | None, spec: Spec):
    """(scale, zero_point) as ``spec.scale_dtype`` stores them; unchanged when it is None.

    float16: symmetric scales are rounded to the nearest float16; asymmetric ones
    (at most 4 bits) to 7 significand bits, so (zp + 8) * scale -- 0..15 times
    the scale, GGUF Q4_1's block minimum -- is a float16 too.
    The zero point is recomputed on the new scale from the range's low end
    ``(qmin - zp) * old_scale``, which keeps 0.0 on the grid.
    """
    if spec.scale_dtype is None:
        return scale, zero_point
    precision = 11 if zero_point is None else 7
    new = round_significand(scale.astype(jnp.float32), precision).astype(jnp.float16).astype(jnp.float32)
    # Outside float16's range (0 or Inf): keep the float32 scale; an exporter's own check names that tile.
    new = jnp.where((new > 0) & jnp.isfinite(new), new, scale)
    if zero_point is None:
        return new, None
    qmin, qmax = int_range(spec.bits)
    lo = (qmin - zero_point) * scale
    return new, jnp.clip(jnp.round(qmin - lo / new), qmin, qmax)


def compute_scale(x: jax.Array, spec: Spec, tile: tuple[int, ...] | None = None):
    """(scale, zero_point or None) of ``x`` under ``spec``; shapes = scale shape."""
    return storable_scale(*_compute_scale(x, spec, tile), spec)


def weighted_mse_scale(x: jax.Array, spec: Spec, weight: jax.Array, tile: tuple[int, ...] | None = None):
    """(scale, zero_point) of ``x`` under ``spec`` with ``clip: mse`` searched on an error weighted by
    ``weight`` (broadcastable to ``x``) instead of the plain squared error."""
    tile = tile_for(spec, x.shape) if tile is None else tile
    return storable_scale(*_mse_scale(x, tile, spec.bits, spec.symmetric, weight), spec)


def _compute_scale(x: jax.Array, spec: Spec, tile: tuple[int, ...] | None = None):
    tile = tile_for(spec, x.shape) if tile is None else tile
    if x.size == 0:  # nothing to range over (reductions of empty arrays have no identity): unit grid
        shape = scale_shape(x.shape, tile)
        return jnp.ones(shape, jnp.float32), (None if spec.symmetric else jnp.zeros(shape, jnp.float32))
    kind, value = _parse_clip(spec.clip)
    if spec.grid == "log2":  # scale = the (clipped) absmax: the top magnitude is 1
        amax = _tile_percentile(x, tile, value) if kind == "percentile" else tile_reduce(x, tile, "absmax") * value
        return log2grid.scale_from_absmax(amax), None
    if spec.grid == "fp8":  # scale = the (clipped) absmax / 448: the largest value is the top float
        amax = _tile_percentile(x, tile, value) if kind == "percentile" else tile_reduce(x, tile, "absmax") * value
        return fp8grid.scale_from_absmax(amax), None
    if kind == "mse":
        return _mse_scale(x, tile, spec.bits, spec.symmetric)
    if kind == "percentile":
        if not spec.symmetric:
            raise ValueError("percentile clipping is defined on |x|; use it with symmetric=True")
        return scale_from_range(None, _tile_percentile(x, tile, value), spec.bits, True)
    lo, hi = _range(x, tile, spec.symmetric)
    if kind == "rms":
        return _rms_clipped(x, tile, lo, hi, value or gaussian_clip_gamma(spec.bits, spec.symmetric), spec)
    if kind == "ratio":
        lo = None if lo is None else lo * value
        hi = hi * value
    return scale_from_range(lo, hi, spec.bits, spec.symmetric)


def _rms_clipped(x, tile, lo, hi, gamma: float, spec: Spec):
    """(scale, zero_point) of the tile range cut to mean +- gamma * std (symmetric: |x| <= gamma * rms)."""
    n = tile_reduce(jnp.ones_like(x, jnp.float32), tile, "sum")
    second = tile_reduce(jnp.square(x.astype(jnp.float32)), tile, "sum") / n
    if spec.symmetric:
        return scale_from_range(None, jnp.minimum(hi, gamma * jnp.sqrt(second)), spec.bits, True)
    mean = tile_reduce(x, tile, "sum") / n
    std = jnp.sqrt(jnp.maximum(second - mean * mean, 0.0))
    return scale_from_range(jnp.maximum(lo, mean - gamma * std), jnp.minimum(hi, mean + gamma * std), spec.bits, False)


# --------------------------------------------------------------------------- quantize


def check_finite(x: jax.Array, nan_policy: str = "raise", what: str = "input") -> None:
    """Raise on NaN/Inf in a concrete ``x`` under ``nan_policy="raise"``.

    Traced values cannot be inspected; there the NaN scale of :func:`scale_from_range`
    makes the damage visible instead.
    """
    if nan_policy not in NAN_POLICIES:
        raise ValueError(f"nan_policy={nan_policy!r} is not one of {list(NAN_POLICIES)}")
    if nan_policy != "raise" or isinstance(x, jax.core.Tracer) or not jnp.issubdtype(x.dtype, jnp.inexact):
        return
    finite = jnp.isfinite(x)
    if bool(jnp.all(finite)):
        return
    bad = np.argwhere(~np.asarray(finite))
    first = tuple(int(i) for i in bad[0])
    raise ValueError(f"cannot quantize {what} of shape {tuple(x.shape)}: {len(bad)} non-finite value(s) "
                     f"(first {float(np.asarray(x)[first])} at index {first}); expected finite numbers "
                     "(pass nan_policy='propagate' to get NaN scales for those tiles instead)")


def quantize(
    x: jax.Array,
    spec: Spec,
    *,
    scale: jax.Array | None = None,
    zero_point: jax.Array | None = None,
    pack_axis: int | None = None,
    act_spec: Spec | None = None,
    act_scale: jax.Array | None = None,
    nan_policy: str = "raise",
) -> QArray:
    """Quantize ``x`` into a QArray; a given ``scale`` (and ``zero_point``) skips the range search.

    Sub-byte values are packed along ``pack_axis`` (default: the group/contraction
    axis for ``group`` specs, else axis 0). ``nan_policy``: ``raise`` (NaN/Inf in a
    concrete ``x`` is an error) or ``propagate`` (their tiles get NaN scales).
    """
    x = jnp.asarray(x)
    check_finite(x, nan_policy)
    tile = tile_for(spec, x.shape)
    if scale is not None:
        if spec.symmetric != (zero_point is None):
            raise ValueError("a given zero_point must accompany an asymmetric spec (and only then)")
        expected = scale_shape(x.shape, tile)
        if tuple(scale.shape) != expected:
            raise ValueError(f"scale has shape {tuple(scale.shape)}; expected {expected} for {spec.describe()} "
                             f"on {x.shape}")
    if pack_axis is None:
        pack_axis = (spec.axis if spec.axis is not None else spec.default_axis) if spec.granularity == "group" else 0
    pack_axis = pack_axis % max(x.ndim, 1)
    if scale is None:
        # Not compiled with the rest (see _quantize_on_grid): a zero point on a tie would move by one.
        scale, zero_point = compute_scale(x, spec, tile)
    args = (x, scale, zero_point, act_scale)
    kw = dict(spec=spec, tile=tile, pack_axis=pack_axis, act_spec=act_spec)
    if isinstance(x, jax.core.Tracer):  # inside the caller's trace: the same ops as quantize_dequantize
        return _quantize_on_grid(*args, exact_quotient=False, **kw)
    return _quantize_on_grid_jit(*args, exact_quotient=True, **kw)


def _quantize_on_grid(x, scale, zero_point, act_scale, *, spec, tile, pack_axis, act_spec,
                      exact_quotient: bool) -> QArray:
    """:func:`quantize` on a given grid, once its arguments are checked.

    ``exact_quotient``: expand the scale to ``x``'s shape behind a barrier. Compiled, XLA turns a
    division by a broadcast into a multiplication by its reciprocal, which moves a few codes by
    one from the true quotient that the op-by-op path always gave stored weights.
    """
    if exact_quotient:
        full = tuple(1 for _ in x.shape)
        s_full = jax.lax.optimization_barrier(expand_to(scale, x.shape, tile))
        zp_full = None if zero_point is None else expand_to(zero_point, x.shape, tile)
        q = quantize_values(x, s_full, zp_full, spec.bits, full, spec.grid)
    else:
        q = quantize_values(x, scale, zero_point, spec.bits, tile, spec.grid)
    stored = q.astype(jnp.int8) if x.ndim == 0 else pack(q, spec.bits, pack_axis)
    return QArray(
        qvalue=stored,
        scale=scale.astype(jnp.float32),
        zero_point=None if zero_point is None else zero_point.astype(jnp.int8),
        act_scale=act_scale,
        bits=spec.bits,
        shape=tuple(int(s) for s in x.shape),
        tile=tile,
        dtype=jnp.dtype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.dtype(jnp.float32),
        pack_axis=pack_axis,
        act_spec=act_spec,
        grid=spec.grid,
    )


# Called eagerly (a model's kernels one by one), each small op of the above would compile on its own
# for every new shape; compiled as one function, once per (shape, spec).
_quantize_on_grid_jit = jax.jit(_quantize_on_grid,
                                static_argnames=("spec", "tile", "pack_axis", "act_spec", "exact_quotient"))


def dequantize(q: QArray, dtype: Any = None) -> jax.Array:
    return q.dequantize(dtype)


def quantize_dequantize(x: jax.Array, spec: Spec) -> jax.Array:
    """Real quantize followed by dequantize (no packing round trip needed)."""
    tile = tile_for(spec, x.shape)
    scale, zp = compute_scale(x, spec, tile)
    q = quantize_values(x, scale, zp, spec.bits, tile, spec.grid)
    return _dequant_values(q, scale, zp, x.shape, tile, spec.grid, spec.bits).astype(x.dtype)


# --------------------------------------------------------------------------- fake quant (STE)


def _clip_bounds(scale, zero_point, bits, shape, tile, grid="uniform"):
    """Float range [lo, hi] that the grid covers, broadcast to ``shape``."""
    qmin, qmax = int_range(bits)
    s = expand_to(scale, shape, tile)
    if grid == "log2":  # magnitudes up to 1 x scale
        return -s, s
    if grid == "fp8":  # floats up to 448 x scale
        return -fp8grid.MAX * s, fp8grid.MAX * s
    if zero_point is None:
        return -qmax * s, qmax * s
    zp = expand_to(zero_point, shape, tile)
    return (qmin - zp) * s, (qmax - zp) * s


def fake_quant(x: jax.Array, spec: Spec) -> jax.Array:
    """Quantize-dequantize with a straight-through gradient.

    Forward: exactly :func:`quantize_dequantize`. Backward: the incoming
    gradient passes where ``x`` lies inside the grid's range and is zero where
    it was clipped (scales are treated as constants).
    """
    return _fake_quant(x, spec)


@jax.custom_vjp
def _ste(x, lo, hi, y):
    return y


def _ste_fwd(x, lo, hi, y):
    return y, (x >= lo) & (x <= hi)


def _ste_bwd(mask, g):
    return g * mask.astype(g.dtype), None, None, None


_ste.defvjp(_ste_fwd, _ste_bwd)


def _fake_quant(x, spec):
    tile = tile_for(spec, x.shape)
    xs = jax.lax.stop_gradient(x)
    scale, zp = compute_scale(xs, spec, tile)
    q = quantize_values(xs, scale, zp, spec.bits, tile, spec.grid)
    y = _dequant_values(q, scale, zp, x.shape, tile, spec.grid, spec.bits).astype(x.dtype)
    lo, hi = _clip_bounds(scale, zp, spec.bits, x.shape, tile, spec.grid)
    return _ste(x, jax.lax.stop_gradient(lo), jax.lax.stop_gradient(hi), y)
