"""Text generation over a preallocated KV cache.

``prefill`` runs the (left-padded) prompt through the model once and fills the
cache; ``decode_step`` is one jitted token step with static shapes. ``generate``
runs prefill, then all decode steps inside one ``lax.fori_loop`` (no Python
dispatch per token, no recompilation per token).
Sampling: greedy, or temperature / top-k / top-p with an explicit seed.
"""

from __future__ import annotations

import functools
import math
import weakref

import jax
import jax.numpy as jnp

from llmeq_jax import decode_layout, subchannel
from llmeq_jax.models.config import ModelConfig
from llmeq_jax.models.model import forward_step, init_cache  # noqa: F401 (init_cache re-exported)


def _check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if not math.isfinite(temperature) or temperature <= 0:  # nan <= 0 is False: test finiteness first
        raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """``argmax(logits, -1)`` [B] as int32 (the first maximum; the first NaN where a row has one), as two
    plain reductions: the row max, then the first index holding it. XLA's CPU argmax is one variadic
    (value, index) reduce that took 2x as long: 3.4 ms of a 64 ms batch-32 SmolLM2 decode step."""
    top = jnp.max(logits, axis=-1, keepdims=True)  # NaN where the row has a NaN
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = (logits == top) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


def sample_logits(
    logits: jax.Array, key: jax.Array, *, greedy: bool, temperature: float, top_k: int, top_p: float
) -> jax.Array:
    """Next token ids [B] from float logits [B, V]."""
    if greedy:
        return greedy_tokens(logits)
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (the top token always stays).
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def activation_dtype(params):
    """The float dtype the model computes in: its token table's (float32, or bfloat16 for a bf16 model).
    Activations start as the table's rows and every norm gives back its input's dtype; quantized
    kernels keep it. (Not the norms' own: loaders keep norm scales in float32 in a bf16 model.)"""
    return jnp.dtype(params["embed"]["embedding"].dtype)


def cache_dtype_for(params):
    """The float KV cache :func:`generate` fills by default: the model's :func:`activation_dtype`, except
    float32 where the native CPU kernels run, whose decode attention reads float32 caches only (over a bf16
    cache XLA's attends: a bf16 SmolLM2-135M rtn-w4-g128 took 8.0 ms a token against 5.5 over a float32
    cache, 2-core EPYC). Attention returns the queries' dtype either way, so the activations stay bf16."""
    from llmeq_jax import native

    return jnp.dtype(jnp.float32) if native.enabled() else activation_dtype(params)


def kernel_state() -> tuple:
    """The kernel switches a trace depends on (Pallas interpret mode, Pallas kernels disabled,
    native CPU kernels enabled, the dispatch table read: ``dispatch_table.identity``, the kernels' launch
    settings overridden: ``pallas_kernels.settings``, the kernels not yet run on a GPU turned on:
    ``pallas_kernels.hardware_checked``, the decode products' weights read ahead: ``pallas_kernels.prefetch``).

    The jitted steps below take it as a static argument, so a step traced with kernels
    on is not reused inside ``pallas_kernels.config.disabled()`` or ``native.disabled()``
    (or the other way round), nor one traced under another dispatch table or other launch settings.
    """
    from llmeq_jax import dispatch_table, native
    from pallas_kernels import config as kernel_config, hardware_checked, prefetch, settings

    return (kernel_config.interpret_enabled(), kernel_config.is_disabled(), native.enabled(),
            dispatch_table.identity(), settings.current(), hardware_checked.named(), prefetch.current())


def _layout_state() -> tuple:
    """:func:`kernel_state` without the launch settings and the read-ahead: which kernels run (hence the decode
    layout: the unchecked kernels turned on too) does not depend on their tiles, so a sweep over settings keeps one
    copy of the layout."""
    return kernel_state()[:4] + kernel_state()[5:6]


PROMPT_ACTIVATION_BITS = (16, 8)


def _check_prompt_bits(bits) -> None:
    if bits not in PROMPT_ACTIVATION_BITS:
        raise ValueError(f"prompt_activation_bits must be one of {PROMPT_ACTIVATION_BITS}, got {bits!r}")


# (compiled with llmeq_jax.subchannel's XLA flag where that path may run: a prompt's int4 products)
@functools.partial(subchannel.prompt_jit, static_argnames=("config", "kernels", "activation_bits"),
                   donate_argnames=("cache",))
def prefill(config: ModelConfig, params, tokens, attention_mask, cache, kernels=None, activation_bits: int = 16):
    """Fill the cache with the prompt; returns (logits of the last prompt position [B, V], cache).

    ``kernels``: pass :func:`kernel_state` (only keys the compile cache). Weight-only products of many
    prompt positions run on the native integer panels where they exist (``native.integer_panels``), not the
    exact float ones a perplexity run takes: ``activation_bits`` 16, the decode steps' int16 activations; 8,
    int8 ones as llama.cpp takes a prompt's (1.2-1.6x the products' speed; SmolLM2 perplexity +0.3-0.5 %
    were every position computed so, docs/cpu-speed.md)."""
    from llmeq_jax import native

    _check_prompt_bits(activation_bits)
    with native.integer_panels(activation_bits=activation_bits):
        logits, cache = forward_step(config, params, tokens, attention_mask, cache, last_only=True)
    return logits[:, -1], cache


@functools.partial(jax.jit, static_argnames=("config", "kernels"), donate_argnames=("cache",))
def decode_step(config: ModelConfig, params, token, cache, kernels=None):
    """One token per row [B] -> (logits [B, V], cache). Shapes are static: compiled once.
    ``params``: :func:`decode_params` of the model's params puts quantized kernels in the layout the
    decode kernels read fastest (what :func:`generate`'s loop runs).

    ``kernels``: pass :func:`kernel_state` (only keys the compile cache)."""
    mask = jnp.ones((token.shape[0], 1), jnp.int32)
    logits, cache = forward_step(config, params, token[:, None], mask, cache)
    return logits[:, 0], cache


# The decode loop reads quantized kernels in another layout (decode_layout.for_decode). Made inside
# the loop's jit, that copy was remade on every generate call: 45-75 ms for SmolLM2-135M on a 2-core
# Xeon, the time of 6-9 batch-1 decode steps. generate makes it once, outside, and keeps it for the
# most recent params: one copy of their quantized kernels (release_decode_layout frees it).
_decode_layout_memo: dict = {}


def _ref(leaf):
    """A weak reference to ``leaf`` where it takes one, else a strong one (plain Python scalars)."""
    try:
        return weakref.ref(leaf)
    except TypeError:
        return lambda: leaf


@functools.partial(jax.jit, static_argnames=("rows", "kernels"))
def _laid_out_for_decode(params, rows: int, kernels):
    """``decode_layout.for_decode`` compiled (``kernels`` keys the trace like the loop's)."""
    return decode_layout.for_decode(params, rows=rows)


def _narrows_norm_scales(params, rows: int) -> bool:
    """Whether :func:`decode_params` stores the stacked norms' scales in the activations' dtype where exact
    (``decode_layout.narrow_norm_scales``): where a decode step may fold its norms into its products on a GPU."""
    from llmeq_jax.models import stacked
    from pallas_kernels import config as kernel_config, hardware_checked

    return (decode_layout.decode_target(rows) == "pallas" and kernel_config.on_gpu() and stacked.is_stacked(params)
            and hardware_checked.allowed("norm_fold"))


def decode_params(params, rows: int):
    """``params`` in the layout a decode loop of ``rows`` rows reads (``decode_layout.for_decode``),
    made once for the most recent params, batch size and kernel switches and reused while they last.
    Unchanged params where the loop reads the checkpoint's layout (float kernels, no native or Pallas
    decode kernels for this many rows), except that where the loop may fold its norms into its products on a
    GPU the stacked norms' scales are stored in the activations' dtype where exact
    (``decode_layout.narrow_norm_scales``), float models too."""
    from llmeq_jax.core.qarray import QArray

    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda a: isinstance(a, QArray))
    quantized = any(isinstance(a, QArray) for a in leaves)
    narrow = _narrows_norm_scales(params, rows)
    if decode_layout.decode_target(rows) is None or not (quantized or narrow):
        return params
    leaves = jax.tree_util.tree_leaves(params)
    key = (rows, _layout_state(), narrow, jax.tree_util.tree_structure(params), tuple(map(id, leaves)))
    held = _decode_layout_memo.get("params")
    if held is not None and held[0] == key and all(ref() is a for ref, a in zip(held[1], leaves)):
        return held[2]
    _decode_layout_memo.clear()  # the previous params' copy goes before this one is made
    laid_out = _laid_out_for_decode(params, rows=rows, kernels=_layout_state()) if quantized else params
    if decode_layout.decode_target(rows) == "native":  # host-side: which kernels' scales are int8 codes
        laid_out = decode_layout.split_rows(decode_layout.compact_scales(laid_out), rows)
    if narrow:  # host-side too: which scales are exact in the activations' dtype
        laid_out = decode_layout.narrow_norm_scales(laid_out, activation_dtype(params))
    _decode_layout_memo["params"] = (key, [_ref(a) for a in leaves], laid_out)
    # the copy goes with the params it was made from (the memo holds them weakly)
    first = next((a for a in leaves if isinstance(a, jax.Array)), None)
    if first is not None:
        weakref.finalize(first, _forget_decode_layout, key)
    return laid_out


def _forget_decode_layout(key) -> None:
    held = _decode_layout_memo.get("params")
    if held is not None and held[0] is key:
        _decode_layout_memo.clear()


def release_decode_layout() -> None:
    """Drop the decode layout :func:`generate` keeps for the most recent params."""
    _decode_layout_memo.clear()


@functools.partial(
    jax.jit,
    static_argnames=("config", "max_new_tokens", "greedy", "temperature", "top_k", "top_p", "kernels"),
)
def _decode_loop(config, params, first_logits, cache, key, steps, *, max_new_tokens, greedy, temperature, top_k,
                 top_p, kernels):
    """Tokens ``[B, max_new_tokens]``: the first sampled from ``first_logits``, then ``steps - 1`` decode
    steps (``steps`` is traced, <= max_new_tokens, later slots stay 0): one compiled loop serves any
    number of steps, which is how ``decode_seconds`` times the steps alone."""
    from llmeq_jax import native

    sample = functools.partial(sample_logits, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)
    b = first_logits.shape[0]
    # Quantized kernels in the decode kernels' layout; a no-op on params decode_params laid out already.
    params = decode_layout.for_decode(params, rows=b)
    key, sub = jax.random.split(key)
    out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(sample(first_logits, sub))

    def body(i, carry):
        out, cache, key = carry
        mask = jnp.ones((b, 1), jnp.int32)
        previous = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
        logits, cache = forward_step(config, params, previous, mask, cache)
        key, sub = jax.random.split(key)
        return out.at[:, i].set(sample(logits[:, 0], sub)), cache, key

    with native.integer_panels():  # batches past the row-major kernels' rows: int16 activations as below them
        out, cache, _ = jax.lax.fori_loop(1, steps, body, (out, cache, key))
    return out, cache


def generate(
    config: ModelConfig,
    params,
    prompt_tokens,
    max_new_tokens: int,
    *,
    attention_mask=None,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    cache_dtype=None,
    kv=None,
    return_cache: bool = False,
    prompt_activation_bits: int = 16,
):
    """New tokens [B, max_new_tokens] after left-padded ``prompt_tokens`` [B, T] (mask: 1 = real token).

    ``kv``: a :class:`llmeq_jax.kv.spec.KVQuantizer` for a quantized KV cache (None: float cache).
    ``cache_dtype``: the float cache's dtype (default :func:`cache_dtype_for`: bf16 for a bf16 model on a
    GPU, float32 on a CPU).
    ``return_cache``: return ``(tokens, cache)``, e.g. to carry online key ranges to the
    next request with :func:`llmeq_jax.kv.cache.track_key_ranges`.
    ``prompt_activation_bits``: 16 (default) or 8, the activations of the prompt's weight-only products on a
    VNNI CPU (:func:`prefill`): 8 trades a little accuracy for a faster first token.

    Generation does not stop at EOS: every row gets ``max_new_tokens`` tokens (static shapes).
    """
    prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
    if prompt_tokens.ndim != 2:
        raise ValueError(f"prompt_tokens must be [batch, length], got shape {prompt_tokens.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not greedy:
        _check_sampling(temperature, top_k, top_p)
    _check_prompt_bits(prompt_activation_bits)
    b, t = prompt_tokens.shape
    mask = jnp.ones((b, t), jnp.int32) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    if mask.shape != prompt_tokens.shape:
        raise ValueError(f"attention_mask shape {mask.shape} differs from prompt_tokens shape {prompt_tokens.shape}")
    cache = init_cache(config, b, t + max_new_tokens, cache_dtype or cache_dtype_for(params), kv=kv)
    kernels = kernel_state()
    laid_out = decode_params(params, b)
    first_logits, cache = prefill(config, laid_out if decode_layout.serves_prompts(laid_out) else params,
                                  prompt_tokens, mask, cache, kernels=kernels, activation_bits=prompt_activation_bits)
    out, cache = _decode_loop(
        config,
        laid_out,
        first_logits,
        cache,
        jax.random.key(seed),
        jnp.int32(max_new_tokens),
        max_new_tokens=max_new_tokens,
        greedy=greedy,
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        kernels=kernels,
    )
    return (out, cache) if return_cache else out


def decode_timing(config: ModelConfig, params, prompt_tokens, new_tokens: int, runs: int = 3,
                  kv=None) -> tuple[float, float]:
    """(warm seconds of ``new_tokens - 1`` greedy decode steps after ``prompt_tokens`` [B, T], seconds of the
    first call of the loop): the median over ``runs`` of time(loop of new_tokens - 1 steps) - time(loop of
    none), both on ONE compiled loop and one prefilled cache (what ``generate(new_tokens)`` -
    ``generate(1)`` measures, with one compilation instead of two and no prefill in the timed calls). The
    first call compiles the loop: minus a warm full loop, what compiling it took. The cache is float in
    :func:`cache_dtype_for`'s dtype, as :func:`generate` makes it, or quantized by ``kv`` (a
    :class:`llmeq_jax.kv.spec.KVQuantizer`, as ``generate(kv=...)``)."""
    import statistics
    import time

    prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
    b, t = prompt_tokens.shape
    kernels = kernel_state()
    cache = init_cache(config, b, t + new_tokens, cache_dtype_for(params), kv=kv)
    first_logits, cache = prefill(config, params, prompt_tokens, jnp.ones((b, t), jnp.int32), cache, kernels=kernels)
    loop = functools.partial(_decode_loop, config, decode_params(params, b), first_logits, cache, jax.random.key(0),
                             max_new_tokens=new_tokens, greedy=True, temperature=1.0, top_k=0, top_p=1.0,
                             kernels=kernels)

    def timed(steps: int) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(loop(jnp.int32(steps)))
        return time.perf_counter() - t0

    first = timed(new_tokens)  # compile + warm up
    diffs = [timed(new_tokens) - timed(1) for _ in range(runs)]
    return max(statistics.median(diffs), 1e-9), first


def decode_seconds(config: ModelConfig, params, prompt_tokens, new_tokens: int, runs: int = 3) -> float:
    """Warm seconds of ``new_tokens - 1`` greedy decode steps after ``prompt_tokens`` [B, T]
    (:func:`decode_timing`'s first value)."""
    return decode_timing(config, params, prompt_tokens, new_tokens, runs)[0]


__all__ = ["decode_params", "decode_seconds", "decode_step", "decode_timing", "generate", "greedy_tokens",
           "kernel_state", "prefill", "release_decode_layout", "sample_logits"]
