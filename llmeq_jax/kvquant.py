"""KV-cache quantization math (SimQuant / KVQuant-style): specs, quantize, dequantize.

What is quantized and how (Hooper et al., 2024, "KVQuant"):

* **keys per channel**: one range per (layer, kv head, head dim) shared by all
  tokens. Key activations have a few channels with large magnitude; a
  per-token grid would spend its levels on those channels and crush the rest.
  The range must be known when a token arrives, so it is calibrated offline
  (static, :func:`calibrate_key_ranges`) and stored with the recipe. Keys can
  be quantized *before* RoPE (``pre_rope``): the rotation mixes channel pairs
  with position-dependent angles and smears the per-channel structure; the
  cache then rotates after dequantization (positions are known per slot).
* **values per token**: one range per (token, kv head) over the head dim,
  computed when the token arrives.
* **online key ranges** (``key_range="online"``): no calibration pass. Each
  row's per-channel range is taken from its prompt (the first write to the
  cache) and then frozen, so every stored code keeps one grid; later keys
  outside it clip (or, with ``outlier_frac``, go to the sparse part, which is
  what KVQuant's dense-and-sparse scheme is for). With ``ema`` > 0 the range is
  blended with a running range carried across requests,
  ``r = ema * running + (1 - ema) * prompt``, and :func:`track_key_ranges`
  makes the result the next running range (the runtime adaptation of an EMA
  observer). A range that changed while a sequence is cached would invalidate
  the codes already stored, which is why it adapts between requests, not
  within one. Evaluation feeds each window as a ``prompt_tokens`` prompt plus
  the rest, so it sees the ranges generation would.
* **per-token keys** (``key_granularity="token"``) exist for comparison.

Grid: asymmetric min/max, ``x ~ lo + q * scale`` with unsigned ``q`` in
``[0, 2^bits - 1]`` (stored as signed two's complement and packed with
:func:`llmeq_jax.core.qarray.pack` along the head dim: 2 int4 or 4 int2 per
byte). ``lo`` is the zero point in float form (KVQuant/KIVI keep the min);
an integer zero point would force 0 into every range and waste levels on
channels that never cross zero. Per-token scales and mins are stored as
float16 and the quantizer uses the rounded values, so dequantization is the
exact inverse of what was stored.

Attention sinks (``sink_tokens``, default 4): the first tokens of a sequence
draw a large share of the attention mass whatever they are (StreamingLLM found
four initial tokens enough; KVQuant keeps the first one in fp16). Their keys
also sit outside the other tokens' per-channel band: on SmolLM2-135M the first
token's pre-RoPE key lies outside the 1 % band in ~7 of 64 channels, the others
in < 1. With ``sink_tokens=N`` the tokens at positions ``0 .. N-1`` are attended
from a float copy and left out of the calibrated key ranges, so the grid is
spent on the tokens that are quantized. ``sink_tokens=0`` turns it off. Online
ranges keep them (a prompt's range is too narrow already; see ``kvcache``).

Dense-and-sparse outliers (``outlier_frac``): per stored vector (one token of
one head, ``head_dim`` entries) the ``ceil(frac * head_dim)`` entries that lie
furthest outside the grid are kept in float16 with their index (uint8) and
excluded from the range; the dequantized vector gets them back exactly.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.qarray import int_range, pack, unpack

KV_BITS = (2, 4, 8)
KEY_GRANULARITIES = ("channel", "token")
KEY_RANGES = ("static", "online")
SCALE_DTYPE = jnp.float16  # per-token scales/mins and outlier values
SHORTHANDS = ("fp", "float", "none", "int8", "int4", "int2", "kv8", "kv4", "kv2")


class KVSpecError(ValueError):
    """A KV quantization setting that cannot be honoured."""


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """How the K/V cache is quantized (static: hashable, part of compiled code).

    bits:            2, 4 or 8 (keys and values).
    key_granularity: ``channel`` (KVQuant, needs calibrated key ranges) or ``token``.
    pre_rope:        quantize keys before RoPE and rotate after dequantization.
    window:          the most recent ``window`` tokens are attended in float
                     (at query position t: keys/values t-window+1 .. t).
    sink_tokens:     the first ``sink_tokens`` positions of each row are attended in
                     float and left out of calibrated key ranges (attention sinks; 0 = none).
    outlier_frac:    fraction of each stored vector kept in float (0 = none).
    key_range:       per-channel key ranges ``static`` (calibrated offline) or
                     ``online`` (from each row's prompt, see the module docstring).
    ema:             online: weight of the running range carried across requests (0 = prompt only).
    prompt_tokens:   online: tokens of each evaluation window that act as the prompt.
    calib_windows, calib_seq_len: how many calibration windows of how many
                     tokens the static key ranges are taken from.
    """

    bits: int = 8
    key_granularity: str = "channel"
    pre_rope: bool = True
    window: int = 0
    outlier_frac: float = 0.0
    sink_tokens: int = 4
    key_range: str = "static"
    ema: float = 0.0
    prompt_tokens: int = 64
    calib_windows: int = 8
    calib_seq_len: int = 512

    def __post_init__(self):
        if isinstance(self.bits, bool) or self.bits not in KV_BITS:
            raise KVSpecError(f"KV cache bits={self.bits!r} is not supported; expected one of {list(KV_BITS)}")
        if self.key_granularity not in KEY_GRANULARITIES:
            raise KVSpecError(
                f"key_granularity={self.key_granularity!r} is not one of {list(KEY_GRANULARITIES)}"
            )
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
            raise KVSpecError(f"window={self.window!r} must be an integer >= 0 (tokens kept in float)")
        if not isinstance(self.sink_tokens, int) or isinstance(self.sink_tokens, bool) or self.sink_tokens < 0:
            raise KVSpecError(f"sink_tokens={self.sink_tokens!r} must be an integer >= 0 (first tokens kept in float)")
        if not 0.0 <= float(self.outlier_frac) < 0.5:
            raise KVSpecError(f"outlier_frac={self.outlier_frac!r} must be in [0, 0.5)")
        if self.key_range not in KEY_RANGES:
            raise KVSpecError(f"key_range={self.key_range!r} is not one of {list(KEY_RANGES)}")
        if self.key_range == "online" and self.key_granularity != "channel":
            raise KVSpecError("key_range='online' is for per-channel keys; per-token keys take each token's own range")
        if isinstance(self.ema, bool) or not isinstance(self.ema, (int, float)) or not 0.0 <= self.ema < 1.0:
            raise KVSpecError(f"ema={self.ema!r} must be a number in [0, 1) (weight of the running key range)")
        if not isinstance(self.prompt_tokens, int) or isinstance(self.prompt_tokens, bool) or self.prompt_tokens < 1:
            raise KVSpecError(f"prompt_tokens={self.prompt_tokens!r} must be an integer >= 1")
        if self.calib_windows < 1 or self.calib_seq_len < 2:
            raise KVSpecError("calib_windows must be >= 1 and calib_seq_len >= 2")

    @property
    def per_channel_keys(self) -> bool:
        return self.key_granularity == "channel"

    @property
    def online_keys(self) -> bool:
        return self.per_channel_keys and self.key_range == "online"

    @property
    def needs_key_ranges(self) -> bool:
        """Static per-channel keys: ranges must be calibrated before the cache exists."""
        return self.per_channel_keys and self.key_range == "static"

    def n_outliers(self, head_dim: int) -> int:
        return math.ceil(self.outlier_frac * head_dim) if self.outlier_frac > 0 else 0

    def describe(self) -> str:
        keys = f"keys per-{self.key_granularity}" + (" pre-RoPE" if self.pre_rope else " post-RoPE")
        if self.online_keys:
            keys += f" online (prompt {self.prompt_tokens}" + (f", ema {self.ema:g})" if self.ema else ")")
        extra = f", {self.window}-token float window" if self.window else ""
        extra += f", {self.outlier_frac:.2%} outliers" if self.outlier_frac else ""
        extra += f", first {self.sink_tokens} token(s) in float" if self.sink_tokens else ""
        return f"KV int{self.bits}: {keys}, values per-token{extra}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SPEC_KEYS = {f.name for f in dataclasses.fields(KVSpec)}


def spec_from(value: Any) -> KVSpec | None:
    """A KVSpec from a shorthand (``int8|int4|int2|kv4|fp``), a recipe's ``kv:`` mapping, or a KVSpec.

    ``None``/``fp`` -> None (float cache). A mapping may also hold ``key_ranges``
    (calibrated, see :func:`key_ranges_from_dict`); those are not part of the spec.
    """
    if value is None or isinstance(value, KVSpec):
        return value
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("fp", "float", "none"):
            return None
        m = re.fullmatch(r"(?:int|kv)(\d+)", v)
        if m:  # int8 / kv4 / ...: unsupported widths get the bits error
            return KVSpec(bits=int(m.group(1)))
        raise KVSpecError(f"KV setting {value!r} is not understood; expected one of {list(SHORTHANDS)} or a mapping")
    if isinstance(value, dict):
        unknown = set(value) - _SPEC_KEYS - {"key_ranges"}
        if unknown:
            raise KVSpecError(f"unknown key(s) {sorted(unknown)} in kv mapping; expected some of {sorted(_SPEC_KEYS)}")
        if "bits" not in value:
            raise KVSpecError("kv mapping needs 'bits' (2, 4 or 8)")
        return KVSpec(**{k: v for k, v in value.items() if k in _SPEC_KEYS})
    raise KVSpecError(f"KV setting must be a string or a mapping, got {type(value).__name__}")


# --------------------------------------------------------------------------- static key ranges


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyRanges:
    """Calibrated per-channel key range, ``lo``/``hi`` of shape ``[layers, kv_heads, head_dim]``."""

    lo: jax.Array
    hi: jax.Array

    def check(self, num_layers: int, kv_heads: int, head_dim: int) -> None:
        want = (num_layers, kv_heads, head_dim)
        for name, a in (("lo", self.lo), ("hi", self.hi)):
            if tuple(a.shape) != want:
                raise KVSpecError(
                    f"KV key ranges ({name}) have shape {tuple(a.shape)}; the model needs "
                    f"[layers, kv_heads, head_dim] = {list(want)} (were they calibrated on another model?)"
                )

    def to_dict(self) -> dict:
        return {"lo": np.asarray(self.lo, np.float32).tolist(), "hi": np.asarray(self.hi, np.float32).tolist()}


def key_ranges_from_dict(d: Any) -> KeyRanges:
    if not isinstance(d, dict) or set(d) != {"lo", "hi"}:
        raise KVSpecError("kv key_ranges must be a mapping with 'lo' and 'hi' ([layers][kv_heads][head_dim] lists)")
    lo, hi = (jnp.asarray(np.asarray(d[k], np.float32)) for k in ("lo", "hi"))
    if lo.ndim != 3 or lo.shape != hi.shape:
        raise KVSpecError(f"kv key_ranges lo/hi must both be [layers, kv_heads, head_dim]; got {lo.shape}, {hi.shape}")
    return KeyRanges(lo, hi)


def key_ranges_from_keys(keys: jax.Array, outlier_frac: float = 0.0, sink_tokens: int = 0) -> KeyRanges:
    """Per-channel range of calibration keys ``[layers, N, kv_heads, S, head_dim]`` (N rows, S tokens).

    With outliers, the range is the central ``1 - outlier_frac`` quantile band:
    the entries beyond it are the ones the sparse part keeps in float. The first
    ``sink_tokens`` tokens of each row are left out (the cache keeps them in float).
    """
    if sink_tokens >= keys.shape[3]:
        raise KVSpecError(f"sink_tokens={sink_tokens} leaves no calibration token of the {keys.shape[3]} per window")
    keys = keys[:, :, :, sink_tokens:]
    # Layers play the role of rows: every calibration token of a layer counts.
    k = jnp.moveaxis(keys, 2, 1).reshape(keys.shape[0], keys.shape[2], -1, keys.shape[-1])
    lo, hi = observed_key_ranges(k, jnp.ones((k.shape[0], k.shape[2]), bool), outlier_frac)
    return KeyRanges(lo.astype(jnp.float32), hi.astype(jnp.float32))


def observed_key_ranges(keys: jax.Array, valid: jax.Array, outlier_frac: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """Per-row, per-channel range of ``keys`` ``[B, KV, T, D]`` over the tokens where ``valid`` ``[B, T]``.

    -> ``(lo, hi)`` each ``[B, KV, D]``. With outliers, the central ``1 - outlier_frac``
    band (as :func:`key_ranges_from_keys`); a row without valid tokens gets ``[0, 0]``.
    """
    k = keys.astype(jnp.float32)
    ok = valid[:, None, :, None]
    if outlier_frac > 0:
        masked = jnp.where(ok, k, jnp.nan)
        lo = jnp.nanquantile(masked, outlier_frac / 2, axis=2)
        hi = jnp.nanquantile(masked, 1 - outlier_frac / 2, axis=2)
    else:
        lo = jnp.min(jnp.where(ok, k, jnp.inf), axis=2)
        hi = jnp.max(jnp.where(ok, k, -jnp.inf), axis=2)
    lo, hi = jnp.nan_to_num(lo, posinf=0.0, neginf=0.0), jnp.nan_to_num(hi, posinf=0.0, neginf=0.0)
    return lo, jnp.maximum(hi, lo)


def track_key_ranges(kv: "KVQuantizer", cache) -> "KVQuantizer":
    """The quantizer with its running key range set to the ranges an online cache used (mean over rows).

    Those already are ``ema * running + (1 - ema) * prompt``, so calling this after every
    request keeps an exponential moving average of the prompts' key ranges.
    """
    if not kv.spec.online_keys:
        raise KVSpecError("track_key_ranges is for key_range='online' caches")
    return KVQuantizer(KeyRanges(jnp.mean(cache.k_lo, axis=1), jnp.mean(cache.k_hi, axis=1)), kv.spec)


# --------------------------------------------------------------------------- RoPE on cache layout


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate ``x`` ``[B, H, S, D]`` by ``positions`` ``[B, S]`` (rotate-half layout, as the models)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None]  # [B, 1, S, D]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


# --------------------------------------------------------------------------- grid


def grid_from_range(lo: jax.Array, hi: jax.Array, bits: int, dtype=jnp.float32):
    """(scale, lo) of the asymmetric grid over [lo, hi], rounded to the storage ``dtype``."""
    levels = 2**bits - 1
    # Round lo down and the scale up to the storage dtype, so the stored grid
    # still covers [lo, hi] and the error bound stays scale / 2.
    # The barriers make the rounding real under jit: XLA on GPU may otherwise keep a
    # float32 value where the program asks for float16 (excess precision), and codes
    # computed with the unrounded grid would not invert exactly with the stored one.
    lo = lo.astype(jnp.float32)
    lo_s = _materialized(lo.astype(dtype))
    lo_s = _materialized(jnp.where(lo_s.astype(jnp.float32) > lo, jnp.nextafter(lo_s, jnp.asarray(-jnp.inf, dtype)), lo_s))
    span = hi.astype(jnp.float32) - lo_s.astype(jnp.float32)
    scale = jnp.maximum(jnp.where(span > 0, span / levels, 1.0), jnp.finfo(jnp.float16).tiny)
    scale_s = _materialized(scale.astype(dtype))
    scale_s = jnp.where(scale_s.astype(jnp.float32) < scale, jnp.nextafter(scale_s, jnp.asarray(jnp.inf, dtype)), scale_s)
    return _materialized(scale_s), lo_s


def _materialized(x: jax.Array) -> jax.Array:
    """``x`` exactly as its dtype holds it (no-op for float32; see :func:`grid_from_range`)."""
    return x if x.dtype == jnp.float32 else jax.lax.optimization_barrier(x)


def quantize_grid(x: jax.Array, scale: jax.Array, lo: jax.Array, bits: int) -> jax.Array:
    """Unsigned codes ``[0, 2^bits-1]`` shifted into the signed storage range (int8, not packed)."""
    qmin, _ = int_range(bits)
    u = jnp.clip(jnp.round((x.astype(jnp.float32) - lo.astype(jnp.float32)) / scale.astype(jnp.float32)), 0, 2**bits - 1)
    return (u + qmin).astype(jnp.int8)


def dequantize_grid(q: jax.Array, scale: jax.Array, lo: jax.Array, bits: int) -> jax.Array:
    qmin, _ = int_range(bits)
    return (q.astype(jnp.float32) - qmin) * scale.astype(jnp.float32) + lo.astype(jnp.float32)


def outlier_indices(x: jax.Array, lo: jax.Array, hi: jax.Array, n: int) -> jax.Array:
    """Indices ``[..., n]`` of the ``n`` entries of each vector (last axis) furthest outside [lo, hi].

    Distance is measured in units of the range, from its centre, so inside-range
    entries rank by how close they are to the edges (the largest magnitudes).
    """
    centre, half = (hi + lo) / 2, jnp.maximum((hi - lo) / 2, 1e-12)
    score = jnp.abs(x.astype(jnp.float32) - centre) / half
    return jax.lax.top_k(score, n)[1]


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, idx, axis=-1)


def _scatter(x: jax.Array, idx: jax.Array, vals: jax.Array) -> jax.Array:
    """``x`` with ``x[..., idx[..., j]] = vals[..., j]`` (n is small: a loop of selects)."""
    lanes = jnp.arange(x.shape[-1])
    for j in range(idx.shape[-1]):
        x = jnp.where(lanes == idx[..., j : j + 1], vals[..., j : j + 1].astype(x.dtype), x)
    return x


# --------------------------------------------------------------------------- stored form


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """Quantized vectors ``[..., D]`` (keys or values of some tokens).

    q: packed codes (uint8 for 2/4 bits, int8 for 8 bits), last axis D / per-byte.
    scale, lo: ``[..., 1]`` float16 per token, or None when the grid is per channel (held elsewhere).
    out_idx (uint8), out_val (float16): ``[..., n]`` sparse outliers, or None.
    """

    q: jax.Array
    scale: jax.Array | None
    lo: jax.Array | None
    out_idx: jax.Array | None
    out_val: jax.Array | None


def quantize_per_token(x: jax.Array, bits: int, n_out: int) -> QuantizedKV:
    """Each vector (last axis) on its own min/max grid; the ``n_out`` largest magnitudes kept in float."""
    xf = x.astype(jnp.float32)
    idx = val = None
    inside = xf
    if n_out:
        idx = jax.lax.top_k(jnp.abs(xf), n_out)[1]
        val = _take(xf, idx).astype(SCALE_DTYPE)
        # Range over the remaining (dense) entries: outliers are replaced by a dense entry's value.
        fill = _take(xf, jnp.argmin(jnp.abs(xf), axis=-1, keepdims=True))
        inside = _scatter(xf, idx, jnp.broadcast_to(fill, idx.shape))
    scale, lo = grid_from_range(jnp.min(inside, -1, keepdims=True), jnp.max(inside, -1, keepdims=True), bits, SCALE_DTYPE)
    q = pack(quantize_grid(xf, scale, lo, bits), bits, -1)
    return QuantizedKV(q, scale, lo, None if idx is None else idx.astype(jnp.uint8), val)


def quantize_per_channel(x: jax.Array, scale: jax.Array, lo: jax.Array, hi: jax.Array, bits: int, n_out: int) -> QuantizedKV:
    """Vectors on a given per-channel grid (``scale``, ``lo``, ``hi`` broadcast against ``x``)."""
    xf = x.astype(jnp.float32)
    idx = val = None
    if n_out:
        idx = outlier_indices(xf, lo, hi, n_out)
        val = _take(xf, idx).astype(SCALE_DTYPE)
    q = pack(quantize_grid(xf, scale, lo, bits), bits, -1)
    return QuantizedKV(q, None, None, None if idx is None else idx.astype(jnp.uint8), val)


def dequantize(stored: QuantizedKV, bits: int, head_dim: int, scale=None, lo=None) -> jax.Array:
    """Float32 vectors ``[..., D]``; per-channel grids pass ``scale``/``lo`` (broadcastable)."""
    scale = stored.scale if scale is None else scale
    lo = stored.lo if lo is None else lo
    x = dequantize_grid(unpack(stored.q, bits, -1, head_dim), scale, lo, bits)
    if stored.out_idx is not None:
        x = _scatter(x, stored.out_idx.astype(jnp.int32), stored.out_val.astype(jnp.float32))
    return x


def quantize_dequantize_values(v: jax.Array, bits: int, n_out: int = 0) -> jax.Array:
    """What the cache returns for values ``[..., D]`` (per token)."""
    return dequantize(quantize_per_token(v, bits, n_out), bits, v.shape[-1])


def quantize_dequantize_keys_per_channel(k: jax.Array, lo: jax.Array, hi: jax.Array, bits: int, n_out: int = 0):
    """What the cache returns for keys ``[..., D]`` on a per-channel range ``lo``/``hi`` (broadcastable)."""
    scale, lo_s = grid_from_range(lo, hi, bits)
    return dequantize(quantize_per_channel(k, scale, lo_s, hi, bits, n_out), bits, k.shape[-1], scale, lo_s)


# --------------------------------------------------------------------------- setting


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVQuantizer:
    """A KV spec plus its calibrated key ranges: everything a quantized cache is built from."""

    key_ranges: KeyRanges | None
    spec: KVSpec = dataclasses.field(metadata=dict(static=True), default=KVSpec())

    def __post_init__(self):
        if self.spec.needs_key_ranges and self.key_ranges is None:
            raise KVSpecError(
                "per-channel keys need calibrated key ranges (static scales); calibrate them with "
                "kvquant.calibrate_key_ranges, use key_range='online' or key_granularity='token'"
            )

    def check(self, num_layers: int, kv_heads: int, head_dim: int) -> None:
        if self.key_ranges is not None:
            self.key_ranges.check(num_layers, kv_heads, head_dim)
        if self.spec.n_outliers(head_dim) > 255 or head_dim > 256:
            raise KVSpecError(f"outlier indices are stored as uint8: head_dim {head_dim} must be <= 256")

    def to_dict(self) -> dict:
        """The recipe's ``kv:`` mapping (spec fields + calibrated ``key_ranges``)."""
        out = self.spec.to_dict()
        if self.key_ranges is not None:
            out["key_ranges"] = self.key_ranges.to_dict()
        return out


def quantizer_from_dict(d: dict) -> KVQuantizer:
    """The inverse of :meth:`KVQuantizer.to_dict` (a recipe or checkpoint ``kv:`` mapping)."""
    spec = spec_from(d)
    ranges = key_ranges_from_dict(d["key_ranges"]) if d.get("key_ranges") is not None else None
    return KVQuantizer(ranges, spec)


# --------------------------------------------------------------------------- calibration


def collect_keys(config, params, windows: np.ndarray, *, pre_rope: bool, batch_size: int = 4) -> jax.Array:
    """Keys of every layer for calibration token ``windows`` [N, S]: ``[layers, N, kv_heads, S, head_dim]``.

    They are read from a float cache after a prefill (post-RoPE); pre-RoPE keys
    are recovered by rotating back by each token's position.
    """
    from llmeq_jax.models import model as model_lib

    windows = np.asarray(windows, np.int32)
    n, s = windows.shape

    @jax.jit
    def keys_of(tokens):
        cache = model_lib.init_cache(config, tokens.shape[0], s)
        _, cache = model_lib.forward_step(config, params, tokens, jnp.ones(tokens.shape, jnp.int32), cache)
        return cache.k

    out = []
    for start in range(0, n, batch_size):
        k = keys_of(jnp.asarray(windows[start : start + batch_size]))
        if pre_rope and config.family != "gpt2":
            inv = jnp.asarray(model_lib.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling))
            back = -jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (k.shape[1], s))
            k = jax.vmap(lambda kl: rope(kl, back, inv))(k)
        out.append(k)
    return jnp.concatenate(out, axis=1)


def calibrate_key_ranges(config, params, windows: np.ndarray, spec: KVSpec, batch_size: int = 4) -> KeyRanges:
    """Static per-channel key ranges of ``spec`` (pre- or post-RoPE) from calibration ``windows``."""
    keys = collect_keys(config, params, windows, pre_rope=spec.pre_rope, batch_size=batch_size)
    return key_ranges_from_keys(keys, spec.outlier_frac, spec.sink_tokens)


def make_quantizer(spec: KVSpec | None, config=None, params=None, windows: np.ndarray | None = None) -> KVQuantizer | None:
    """A ready KVQuantizer: calibrates key ranges from ``windows`` when the spec needs them
    (online keys start without a running range)."""
    if spec is None:
        return None
    if not spec.needs_key_ranges:
        return KVQuantizer(None, spec)
    if windows is None:
        raise KVSpecError("per-channel keys need calibration windows to compute static key ranges")
    return KVQuantizer(calibrate_key_ranges(config, params, windows, spec), spec)
