"""Softmax attention over cached keys/values (grouped-query layout), in float32.

* :func:`dot_product_attention`: one key/value set (the models' prefill without a cache).
* :func:`layer_attention`: one layer of a stacked float cache (decode, prefill into a cache).
* :func:`split_attention`: one softmax over several key/value sets (the quantized cache's
  dequantized store, float sinks, float window), each with its own mask.
* :func:`merge_attention`: combine two partial results by their log-sum-exp (the Pallas
  decode kernel's store part with the float parts).

A prompt's attention on a GPU (:func:`flash_ok`) goes to cuDNN's flash attention (:func:`attention_flash`,
what ``jax.nn.dot_product_attention(implementation="cudnn")`` runs): XLA's formulation writes the whole float32
score matrix and reads it three times (a Llama-2-7B layer at 2048 positions: 512 MB of scores, ~2.5 GB of traffic).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from llmeq_jax import dispatch_table, native, ops
from pallas_kernels import config as kernel_config
from pallas_kernels import hardware_checked

# Masked attention scores: a large finite value, so a row with no visible key
# (a left-padding query) gives a uniform softmax instead of NaN.
MASKED = -1e30


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention.

    q [B, T, H, D]; k, v [B, KV, S, D]; mask [B, T, S] -> [B, T, H, D].
    Scores and softmax in float32.
    """
    if native_attention_ok(q, k, v):
        return native.decode_attention(q, k, v, mask, masked=MASKED, reference=attention_xla)
    out = attention_flash(q, k, v, mask) if flash_ok(q, k) else None
    return out if out is not None else attention_xla(q, k, v, mask)


def layer_attention(q: jax.Array, k: jax.Array, v: jax.Array, layer, mask: jax.Array) -> jax.Array:
    """:func:`dot_product_attention` over one layer of stacked caches k, v [L, B, KV, S, D] (``layer``
    an int or a traced scalar): the native kernel reads the layer in place; XLA's path slices it."""
    if native_attention_ok(q, k, v):
        return native.decode_attention(q, k, v, mask, masked=MASKED, reference=attention_xla, layer=layer)
    out = attention_flash(q, k[layer], v[layer], mask) if flash_ok(q, k) else None
    if out is not None:
        return out
    if sums_read_in_place(q, k):
        return attention_sums(q, k[layer], v[layer], mask)
    return attention_xla(q, k[layer], v[layer], mask)


# Query rows per KV head (T x the group) up to which a GPU's grouped-query decode attention is written as sums.
SUMS_MAX_ROWS = 16


def sums_read_in_place(q: jax.Array, k: jax.Array) -> bool:
    """Whether one layer of a stacked cache is attended by :func:`attention_sums`: on a GPU, for a few query
    rows per KV head, several of them (grouped-query attention). There XLA runs :func:`attention_xla`'s dots
    as GEMM fusions, which take whole operands: it copied the layer's keys and values out of the stacked
    cache before them every decode step (``scripts/gpu_aot.py``, Llama-3-8B shapes: 2 x 4 MiB a layer at 2048
    slots, 2 x 64 MiB at 32K). Sums are reductions, which XLA fuses with the slice: the layer is read in
    place, as it always was with one query head per KV head (those dots already became reductions)."""
    t, h = q.shape[1:3]
    group = h // k.shape[-3]
    return kernel_config.target_backend() == "gpu" and group > 1 and t * group <= SUMS_MAX_ROWS


def attention_sums(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """:func:`attention_xla` with the two products as multiplies and sums over D and S (float32)."""
    b, t, h, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, t, kv, h // kv, 1, d).astype(jnp.float32)
    scores = jnp.sum(qg * k[:, None, :, None].astype(jnp.float32), axis=-1) / math.sqrt(d)  # [B, T, KV, G, S]
    scores = jnp.where(mask[:, :, None, None, :], scores, MASKED)
    # The barrier keeps the softmax out of the values' sum: given both, XLA may make one Triton fusion of them, which
    # cannot take the layer's values in place from the stacked cache, so it copied them out first. Deviceless
    # compiles of Llama-3-8B's decode, 2048 slots: 4 MiB a layer and token at batch 1 on an A100 or an L40, 64 MiB
    # at batch 16 there and on an H100; none with the barrier, and no more launches.
    probs = jax.lax.optimization_barrier(jax.nn.softmax(scores, axis=-1))
    out = jnp.sum(probs[..., None] * v[:, None, :, None].astype(jnp.float32), axis=-2)  # [B, T, KV, G, D]
    return out.astype(v.dtype).reshape(b, t, h, d)


# Query positions from which a GPU's prompt takes cuDNN's flash attention where no dispatch table measured it.
FLASH_MIN_ROWS = 128
FLASH_DTYPES = (jnp.bfloat16, jnp.float16)  # cuDNN's flash attention takes half-precision operands only
FLASH_MAX_HEAD_DIM = 128  # 256 on Hopper and later; 128 everywhere cuDNN runs it
FLASH_KEY_MULTIPLE = 64  # keys padded (masked out) to a multiple of this: the mask's bias rows aligned
# LLMEQ_PROMPT_ATTENTION=xla keeps every prompt on XLA's attention (a GPU whose cuDNN fails to compile the call).
PROMPT_ATTENTION_ENV = "LLMEQ_PROMPT_ATTENTION"
PROMPT_ATTENTION_CHOICES = ("cudnn", "xla")


def flash_ok(q: jax.Array, k: jax.Array) -> bool:
    """Whether a GPU's attention of these queries goes to :func:`attention_flash`: a prompt's worth of query
    positions (the active or shipped dispatch table's ``prompt_attention`` entry where it measured one, else
    :data:`FLASH_MIN_ROWS` once cuDNN's call passed its gpu cases on a GPU: ``pallas_kernels.hardware_checked``, not
    yet), half-precision queries and keys of one dtype, a head dim cuDNN takes, kernels not turned off
    (``pallas_kernels.config.disabled``: XLA everywhere) and ``LLMEQ_PROMPT_ATTENTION`` not "xla"."""
    b, t, _, d = q.shape
    if not kernel_config.on_gpu() or kernel_config.is_disabled() or b * t == 0 or prompt_attention() == "xla":
        return False
    if q.dtype not in FLASH_DTYPES or k.dtype != q.dtype or d % 8 or d > FLASH_MAX_HEAD_DIM:
        return False
    key = dispatch_table.Key(kernel_config.target_device().device_kind, "prompt_attention", 16, None, d,
                             dispatch_table.row_bucket(k.shape[-2]), dispatch_table.row_bucket(t), q.dtype.name)
    measured = dispatch_table.choice(key)
    unmeasured = measured is None and t >= FLASH_MIN_ROWS and hardware_checked.allowed("cudnn_attention")
    return measured == "pallas" or unmeasured


def prompt_attention() -> str:
    """The ``LLMEQ_PROMPT_ATTENTION`` setting: "cudnn" (the default: :func:`flash_ok` decides) or "xla"."""
    choice = os.environ.get(PROMPT_ATTENTION_ENV, "cudnn")
    if choice not in PROMPT_ATTENTION_CHOICES:
        raise ValueError(f"{PROMPT_ATTENTION_ENV}={choice!r}: expected one of {', '.join(PROMPT_ATTENTION_CHOICES)}")
    return choice


def attention_flash(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array | None:
    """:func:`attention_xla` as cuDNN's flash attention: blocks of scores in on-chip memory with an online softmax
    (float32), never the whole [T, S] matrix; the mask enters as an additive bias, so any mask works (causal,
    padding, sliding window). None where cuDNN is not there or refused the call while tracing (a shape it does
    not take): the caller takes XLA's path.

    q [B, T, H, D]; k, v [B, KV, S, D] (the caches' layout); mask [B, T, S]. cuDNN reads all three head-major
    ("BNTH"): given keys as [B, S, KV, D] (``jax.nn.dot_product_attention``'s only layout), XLA laid out the whole
    stacked cache slot-major inside a prompt's layer loop, transposing every layer's keys and values into it
    before the loop and back after (``scripts/gpu_aot.py --prefill``: 2 x 2 GB for a Llama-2-7B at 2048 slots).
    Only JAX's own cuDNN module takes that layout, hence the private import."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention
    except ImportError:  # a JAX without it: XLA's path
        return None
    pad = -k.shape[2] % FLASH_KEY_MULTIPLE
    if pad:  # masked-out keys to a whole number of cuDNN's key tiles: the bias rows 16-byte aligned whatever S is
        k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (k, v))
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad)))
    try:
        out = cudnn_attention(jnp.swapaxes(q, 1, 2), k, v, mask=mask[:, None], scale=1.0 / math.sqrt(q.shape[-1]),
                              qkv_layout="BNTH")
    except (NotImplementedError, RuntimeError):  # cuDNN's own refusals at trace time (none in this jaxlib, ...)
        return None
    return jnp.swapaxes(out, 1, 2)


def native_attention_ok(q, k, v) -> bool:
    """Float32 attention on CPU goes to the native kernel: decode-sized (one call instead of XLA's
    two small dot fusions and softmax ops, whose launch overhead dominated a decode step) and
    prefill-sized (blocked, online softmax, masked-out key blocks skipped: XLA materialized and
    copied the [T, S] scores)."""
    b, t = q.shape[:2]
    decode = 0 < b * t <= ops.NATIVE_MAX_ROWS["attention"]
    # The blocked prefill path is AVX2 code; without it the kernel's scalar loop would lose to XLA.
    prefill = t >= native.PREFILL_ATTENTION_MIN_POSITIONS and native.simd()
    if not (decode or prefill):
        return False
    if any(a.dtype != jnp.float32 for a in (q, k, v)) or kernel_config.target_backend() != "cpu":
        return False
    return native.enabled()


def attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """:func:`dot_product_attention` in XLA ops (also the native kernel's reference and backward pass)."""
    b, t, h, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    scores = jnp.where(mask[:, None, None, :, :], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v)
    return out.reshape(b, t, h, d)


def merge_attention(a, b):
    """Softmax attention over two key sets from each one's (out [..., D], lse [...]): the union's (out, lse)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = jnp.logaddexp(lse_a, lse_b)
    w_a, w_b = jnp.exp(lse_a - lse)[..., None], jnp.exp(lse_b - lse)[..., None]
    return out_a.astype(jnp.float32) * w_a + out_b.astype(jnp.float32) * w_b, lse


def split_attention(q: jax.Array, parts, *, with_lse: bool = False):
    """One softmax over several key/value sets: ``parts`` = [(k [B,KV,S_i,D], v, mask [B,T,S_i]), ...].

    Grouped-query layout as :func:`dot_product_attention`; scores and softmax in float32.
    ``with_lse``: also return the log-sum-exp of the scores ``[B, T, H]`` (see :func:`merge_attention`).
    """
    b, t, h, d = q.shape
    kv = parts[0][0].shape[1]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = [
        jnp.where(m[:, None, None], jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
                  / math.sqrt(d), MASKED)
        for k, _, m in parts
    ]
    scores = jnp.concatenate(scores, axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    out, start = 0.0, 0
    for k, v, _ in parts:
        p = probs[..., start : start + k.shape[2]].astype(v.dtype)
        out = out + jnp.einsum("bkgts,bksd->btkgd", p, v)
        start += k.shape[2]
    out = out.reshape(b, t, h, d)
    if not with_lse:
        return out
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, KV, G, T]
    return out, jnp.moveaxis(lse, 3, 1).reshape(b, t, h)
