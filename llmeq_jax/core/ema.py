"""Exponential moving average of activation ranges: the pure math of online activation scales.

One update per observation (a forward call's input to one linear):

    observed = max(absmax(x), eps)               (eps keeps an all-zero input from a zero scale)
    state'   = observed                           on the first observation
    state'   = alpha * state + (1 - alpha) * observed   afterwards
    scale    = state' / qmax                      (symmetric, qmax = 2^(bits-1) - 1)

The current observation enters *before* it is quantized, so a spike is partly
absorbed at once (weight 1 - alpha) and no value of the first call is clipped.
Across devices the observation is the ``pmax`` of the shards' absmax (an absmax
is a max: the collective that gives the unsharded value exactly), taken before
the update, so every device carries the same state.

Used by :mod:`llmeq_jax.online` (EMA scales inside the model's forward) and by
``distributed.online_quantize_synced`` (one sharded tracking step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# float32's smallest normal number: the floor of an observed range.
TINY = float(jnp.finfo(jnp.float32).tiny)
# A state holding EMPTY has seen nothing yet (a real state is >= eps > 0), so one jit-able
# array can stand for "no observation" without a Python None in the pytree.
EMPTY = 0.0


def check_alpha(alpha: float) -> float:
    """An EMA decay in [0, 1): 0 = the last observation only; 1 would never move."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) < 1.0:
        raise ValueError(f"ema={alpha!r} is not a decay in [0, 1) (0 = last call only, 0.9 = slow)")
    return float(alpha)


def absmax(x: jax.Array, per_channel: bool = False) -> jax.Array:
    """max |x| over all rows (per channel: over all but the last dim), float32."""
    xf = jnp.abs(x.astype(jnp.float32))
    return jnp.max(xf.reshape(-1, xf.shape[-1]), axis=0) if per_channel else jnp.max(xf)


def update(state: jax.Array | None, observed: jax.Array, alpha: float, eps: float = TINY) -> jax.Array:
    """The new EMA state; ``state`` None (or EMPTY entries) means nothing was observed yet."""
    observed = jnp.maximum(observed.astype(jnp.float32), eps)
    if state is None:
        return observed
    state = state.astype(jnp.float32)
    return jnp.where(state > EMPTY, alpha * state + (1.0 - alpha) * observed, observed)


def scale(state: jax.Array, bits: int = 8) -> jax.Array:
    """Symmetric quantization scale of a tracked range."""
    return state / (2 ** (bits - 1) - 1)
