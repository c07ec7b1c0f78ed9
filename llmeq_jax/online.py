"""Online activation scales: a per-tensor EMA of each linear input's absmax, carried as state.

A recipe rule asks for it with ``act_ema`` (the decay) beside a per-tensor int8 act spec::

    - pattern: ".*/kernel"
      weight: {bits: 8, granularity: channel}
      act: {bits: 8, granularity: tensor}
      act_ema: 0.9

Static scales are fixed by calibration, dynamic ones recomputed on every call;
online scales sit between: no calibration pass, one scale per tensor (cheap
integer kernels), and a range that follows the data slowly. The state is a dict
``{kernel path: tracked absmax}`` threaded through :func:`forward` (one update per
forward call, :mod:`llmeq_jax.core.ema`), so perplexity and generation carry it
from batch to batch and token to token.

How the model is reached without knowing about it: the forward runs under
``flax.linen.intercept_methods`` (as calibration does). The interceptor notes which
decoder block it is in, and for every ``Linear`` whose path is tracked it computes
the input's absmax (``pmax``-ed over ``axis_name`` inside ``shard_map``), updates the
state and calls ``ops.linear`` with that scale as the weight's static activation
scale. Other linears run unchanged. A checkpoint stores only the recipe's decays;
evaluation and generation start from an empty state (the first call's own absmax).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax import ops
from llmeq_jax.core import ema
from llmeq_jax.core.qarray import QArray, is_qarray
from llmeq_jax.core.rules import path_str

State = dict[str, jax.Array]


def decays(params: Any, recipe: Any) -> dict[str, float]:
    """``{kernel path: decay}`` for every quantized kernel whose rule has ``act_ema``.

    ``recipe`` is a Recipe or its dict form (as stored in a checkpoint); None gives {}.
    """
    if recipe is None:
        return {}
    if isinstance(recipe, dict):
        from llmeq_jax.core.rules import recipe_from_dict

        recipe = recipe_from_dict(recipe)
    out = {}
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_qarray):
        path = path_str(key_path)
        rule = recipe.rule_for(path)
        if isinstance(leaf, QArray) and leaf.act_spec is not None and rule is not None and rule.act_ema is not None:
            out[path] = float(rule.act_ema)
    return out


def init_state(alphas: dict[str, float]) -> State:
    """Nothing observed yet: every tracked path holds ``ema.EMPTY``."""
    return {p: jnp.float32(ema.EMPTY) for p in alphas}


def _block_layer(module: nn.Module) -> int | None:
    """The index of a decoder block module (its ``layer`` field), else None."""
    from llmeq_jax.models.gpt2 import GPT2Block
    from llmeq_jax.models.llama import LlamaBlock

    return module.layer if isinstance(module, (GPT2Block, LlamaBlock)) else None


def _linear_path(module: nn.Module, layer: int | None) -> str:
    inner = "/".join(module.scope.path)
    return "/".join(p for p in (f"layers_{layer}" if layer is not None else "", inner, "kernel") if p)


def run_tracked(fn, state: State, alphas: dict[str, float], axis_name: Any = None):
    """Call ``fn()`` (a model forward) with EMA activation scales on the tracked linears -> (result, new state)."""
    from llmeq_jax.models.layers import Linear

    new = dict(state)
    where: list[int | None] = [None]

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        layer = _block_layer(context.module)
        if layer is not None:  # entering a block: linears below it live under layers_<i>
            where[0] = layer
            try:
                return next_fun(*args, **kwargs)
            finally:
                where[0] = None
        if not isinstance(context.module, Linear):
            return next_fun(*args, **kwargs)
        path = _linear_path(context.module, where[0])
        if path not in alphas:
            return next_fun(*args, **kwargs)
        x = args[0]
        observed = ema.absmax(x)
        if axis_name is not None:  # data-parallel shards: every device must track the same range
            observed = jax.lax.pmax(observed, axis_name)
        new[path] = ema.update(new[path], observed, alphas[path])
        w = context.module.get_variable("params", "kernel")
        w = dataclasses.replace(w, act_scale=ema.scale(new[path], w.act_spec.bits).reshape(()))
        bias = context.module.get_variable("params", "bias") if context.module.use_bias else None
        return ops.linear(x, w, bias, residual=kwargs.get("residual"))

    with nn.intercept_methods(interceptor):
        out = fn()
    missing = [p for p in alphas if new[p] is state[p]]
    if missing:
        raise ValueError(f"online activation scales: the forward never reached {missing[:3]}; expected every "
                         "tracked kernel path to be a Linear inside the model")
    return out, new


# --------------------------------------------------------------------------- forward, perplexity, generation


@functools.partial(jax.jit, static_argnames=("config", "alphas_items"))
def _forward(config, params, tokens, state, *, alphas_items):
    from llmeq_jax.models import forward

    return run_tracked(lambda: forward(config, params, tokens), state, dict(alphas_items))


def forward(config, params, tokens, state: State, alphas: dict[str, float]):
    """Logits ``[B, T, V]`` and the updated state (one EMA update per tracked linear)."""
    return _forward(config, params, tokens, state, alphas_items=tuple(sorted(alphas.items())))


def perplexity(config, params, windows: np.ndarray, alphas: dict[str, float], batch_size: int = 4,
               progress: bool = False) -> dict:
    """DESIGN §6 perplexity with the state carried from batch to batch (in window order).

    The last batch is padded with copies of its last window, which leaves every absmax
    (and so the state) as the real windows alone would make it.
    """
    from llmeq_jax.evaluate import padded_batches, perplexity_summary, token_nll

    state = init_state(alphas)
    total = 0.0
    for chunk, real in padded_batches(windows, batch_size, progress, "perplexity (online act)"):
        toks = jnp.asarray(chunk)
        logits, state = forward(config, params, toks, state, alphas)
        total += float(np.sum(np.asarray(jnp.sum(token_nll(logits, toks), axis=-1))[:real], dtype=np.float64))
    return {**perplexity_summary(total, windows), "state": {p: float(v) for p, v in state.items()}}


@functools.partial(jax.jit, static_argnames=("config", "alphas_items"))
def _step(config, params, tokens, mask, cache, state, *, alphas_items):
    from llmeq_jax.models.model import forward_step

    (logits, cache), state = run_tracked(lambda: forward_step(config, params, tokens, mask, cache), state,
                                         dict(alphas_items))
    return logits[:, -1], cache, state


def generate(config, params, prompt_tokens, max_new_tokens: int, alphas: dict[str, float],
             state: State | None = None):
    """Greedy tokens ``[B, max_new_tokens]`` and the final state; prefill and every decode step update it.

    Pass the returned state back in to carry the ranges over to the next request.
    """
    from llmeq_jax.models import init_cache

    prompt = jnp.asarray(prompt_tokens, jnp.int32)
    b, t = prompt.shape
    state = init_state(alphas) if state is None else state
    items = tuple(sorted(alphas.items()))
    cache = init_cache(config, b, t + max_new_tokens)
    logits, cache, state = _step(config, params, prompt, jnp.ones((b, t), jnp.int32), cache, state,
                                 alphas_items=items)
    out = []
    for _ in range(max_new_tokens):
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out.append(tok)
        if len(out) == max_new_tokens:
            break
        logits, cache, state = _step(config, params, tok[:, None], jnp.ones((b, 1), jnp.int32), cache, state,
                                     alphas_items=items)
    return jnp.stack(out, axis=1), state


__all__ = ["decays", "forward", "generate", "init_state", "perplexity", "run_tracked"]
