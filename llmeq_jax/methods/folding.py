"""Per-input-channel scale folding: where a block lets ``x @ W`` become ``(x / s) @ (s W)`` exactly.

SmoothQuant and AWQ both move a per-channel factor ``s`` between a linear's
input and its kernel rows. The factor has to be absorbed by the op that
*produces* the input, so the served model has no extra multiply. A
:class:`ScaleGroup` names that producer and the linears that consume its
output (they share one ``s``):

llama family
  ``input_norm`` (RMSNorm scale)         -> q_proj, k_proj, v_proj
  ``post_attn_norm``                      -> gate_proj, up_proj
  ``v_proj`` output columns               -> o_proj (per KV head, see below)
  ``up_proj`` output columns              -> down_proj (silu(gate) * up is linear in up)
gpt2
  ``ln_1`` (LayerNorm scale and bias)     -> qkv_proj
  ``ln_2``                                -> fc_in
  the v third of ``qkv_proj``             -> o_proj

``fc_out`` (after GELU) has no exact producer and is never scaled.

GQA: o_proj input channel ``j`` belongs to query head ``j // head_dim``, which
reads KV head ``(j // head_dim) // (heads / kv_heads)``; it is the v_proj output
column ``kv * head_dim + j % head_dim``. Scaling that v column by ``1/s``
scales *every* o_proj input channel that reads it, so the o_proj factor must
be shared by the query heads of one group: ``s`` lives on the v columns and
is gathered to the o_proj rows (:func:`consumer_index`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.rules import get_path, set_path


@dataclasses.dataclass(frozen=True)
class ScaleGroup:
    """``producer`` (a norm, or a linear whose output columns are scaled) feeds ``consumers`` (block paths)."""

    producer: str
    kind: str  # "norm" | "linear"
    consumers: tuple[str, ...]
    # For kind "linear": which output columns of the producer kernel (None: all).
    columns: tuple[int, int] | None = None


def scale_groups(config) -> tuple[ScaleGroup, ...]:
    """The exact folds of one decoder block of ``config``'s family."""
    if config.family == "gpt2":
        d = config.hidden_size
        return (
            ScaleGroup("ln_1", "norm", ("attn/qkv_proj",)),
            ScaleGroup("attn/qkv_proj", "linear", ("attn/o_proj",), columns=(2 * d, 3 * d)),
            ScaleGroup("ln_2", "norm", ("mlp/fc_in",)),
        )
    return (
        ScaleGroup("input_norm", "norm", ("attn/q_proj", "attn/k_proj", "attn/v_proj")),
        ScaleGroup("attn/v_proj", "linear", ("attn/o_proj",)),
        ScaleGroup("post_attn_norm", "norm", ("mlp/gate_proj", "mlp/up_proj")),
        ScaleGroup("mlp/up_proj", "linear", ("mlp/down_proj",)),
    )


def block_groups(config, block: dict) -> tuple[ScaleGroup, ...]:
    """:func:`scale_groups` that are exact for this block: a rotated block (``mlp/down_rot``, methods/rotate.py)
    rotates down_proj's input at run time, so a per-channel factor on up_proj's columns no longer reaches
    down_proj's rows one to one; that fold is left out."""
    groups = scale_groups(config)
    if "down_rot" in block.get("mlp", {}):
        groups = tuple(g for g in groups if g.consumers != ("mlp/down_proj",))
    return groups


def consumer_index(config, group: ScaleGroup) -> np.ndarray | None:
    """For the v -> o fold, the producer column each consumer input channel reads (None: one to one)."""
    if group.consumers != ("attn/o_proj",) or config.family == "gpt2":
        return None
    hd, rep = config.head_dim, config.num_heads // config.num_kv_heads
    j = np.arange(config.num_heads * hd)
    return ((j // hd) // rep) * hd + j % hd


def reduce_to_scales(config, group: ScaleGroup, per_input: jnp.ndarray, op: str) -> jnp.ndarray:
    """Reduce a per-consumer-input-channel statistic to one value per factor (``op``: max | mean)."""
    idx = consumer_index(config, group)
    if idx is None:
        return per_input
    n = config.num_kv_heads * config.head_dim
    if op == "max":
        return jnp.zeros((n,), per_input.dtype).at[idx].max(per_input)
    total = jnp.zeros((n,), per_input.dtype).at[idx].add(per_input)
    return total / np.bincount(idx, minlength=n)


def expand_scales(config, group: ScaleGroup, s: jnp.ndarray) -> jnp.ndarray:
    """Factors per consumer input channel (gathers KV-column factors to o_proj rows under GQA)."""
    idx = consumer_index(config, group)
    return s if idx is None else s[idx]


def fold(config, block: dict, group: ScaleGroup, s: jnp.ndarray) -> dict:
    """Divide the producer's output by ``s`` and multiply the consumers' kernel rows by it.

    The block computes the same function afterwards (up to float rounding).
    ``s`` has one entry per factor (as :func:`reduce_to_scales` returns them); it must be positive.
    """
    s = jnp.asarray(s, jnp.float32)
    if group.kind == "norm":
        for leaf in ("scale", "bias"):
            if leaf in block[group.producer]:
                block = set_path(block, f"{group.producer}/{leaf}", get_path(block, f"{group.producer}/{leaf}") / s)
    else:
        lo, hi = group.columns or (0, get_path(block, f"{group.producer}/kernel").shape[1])
        for leaf in ("kernel", "bias"):
            path = f"{group.producer}/{leaf}"
            if leaf in get_path(block, group.producer):
                w = get_path(block, path)
                block = set_path(block, path, w.at[..., lo:hi].set(w[..., lo:hi] / s))
    rows = expand_scales(config, group, s)
    for c in group.consumers:
        path = f"{c}/kernel"
        block = set_path(block, path, get_path(block, path) * rows[:, None])
    return block


def group_weight_absmax(block: dict, group: ScaleGroup) -> jnp.ndarray:
    """max |W| per input row over all consumer kernels of the group."""
    return jnp.max(jnp.stack([jnp.max(jnp.abs(get_path(block, f"{c}/kernel")), axis=1) for c in group.consumers]), axis=0)

