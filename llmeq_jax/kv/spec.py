"""KV-cache quantization settings (SimQuant / KVQuant-style): the spec, calibrated key ranges, the quantizer.

The bottom of :mod:`llmeq_jax.kv`: the grid math is in :mod:`llmeq_jax.kv.grid`, the caches in
:mod:`llmeq_jax.kv.cache`, key-range calibration (it runs the model) in :mod:`llmeq_jax.calibrate`.

What is quantized and how (Hooper et al., 2024, "KVQuant"):

* **keys per channel**: one range per (layer, kv head, head dim) shared by all
  tokens. Key activations have a few channels with large magnitude; a
  per-token grid would spend its levels on those channels and crush the rest.
  The range must be known when a token arrives, so it is calibrated offline
  (static, :func:`llmeq_jax.calibrate.calibrate_key_ranges`) and stored with the recipe. Keys can
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
  ``r = ema * running + (1 - ema) * prompt``, and :func:`llmeq_jax.kv.cache.track_key_ranges`
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
ranges keep them (a prompt's range is too narrow already; see :mod:`llmeq_jax.kv.cache`).

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

KV_BITS = (2, 4, 8)


KEY_GRANULARITIES = ("channel", "token")


KEY_RANGES = ("static", "online")


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
                "calibrate.calibrate_key_ranges, use key_range='online' or key_granularity='token'"
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
