"""ZeroQuant (Yao et al., 2022): group-wise weights, per-token dynamic activations, layer-by-layer distillation.

The quantization itself is the recipe (e.g. int8 weights in groups of 128
along the input dim + ``act: {bits: 8, granularity: token}``). With
``lkd_steps > 0``, each decoder block is first trained on its own (LKD): the
student is the block with fake-quantized weights (``core.quantize.fake_quant``,
straight-through gradients) and fake-quantized linear inputs (per token, as
W8A8 will do), the teacher is the float block; both see the same input (the
hidden states of the already quantized blocks before it) and the loss is the
MSE between their outputs. Only linear kernels are trained (optax adam). The
trained kernels are then really quantized.

Activation fake-quant goes through ``flax.linen.intercept_methods`` on each
``Linear`` call of the block (explicit, scoped to the training step; nothing
is patched).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from llmeq_jax.core.quantize import Spec, fake_quant
from llmeq_jax.core.rules import get_path, set_path
from llmeq_jax.methods.blockwise import block_kernel_paths, option, options_from_args, quant_rule, rtn_block

@dataclasses.dataclass(frozen=True)
class ZeroQuantOptions:
    """ZeroQuant's ``method_args``: layer-wise knowledge distillation (LKD) when ``lkd_steps > 0``."""

    lkd_steps: int = option(0, (int,), lambda v: v >= 0, "a non-negative integer (0 = no distillation)")
    lkd_lr: float = option(1e-5, (float,), lambda v: v > 0, "a positive number")
    lkd_batch: int = option(1, (int,), lambda v: v >= 1, "a positive integer (sequences per step)")

TOKEN_ACT = Spec(8, "token")


def parse_args(method_args: dict) -> ZeroQuantOptions:
    return options_from_args(ZeroQuantOptions, "zeroquant", method_args)


def sequential(opts: ZeroQuantOptions) -> bool:
    return opts.lkd_steps > 0  # LKD trains each block on the quantized model's hidden states


def wants(opts: ZeroQuantOptions) -> tuple[str, ...]:
    return ("absmax",)


def _student_block(config, layer, block, kernels, specs, act_rules, hidden, positions):
    """The block with fake-quantized kernels (and linear inputs where the rule quantizes activations)."""
    from llmeq_jax.models.layers import Linear
    from llmeq_jax.models.model import apply_block

    specs = dict(specs)
    for rel, w in kernels.items():
        block = set_path(block, rel, fake_quant(w, specs[rel]))

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name == "__call__" and isinstance(context.module, Linear):
            rel = "/".join(context.module.scope.path) + "/kernel"
            if rel in act_rules:
                args = (fake_quant(args[0], TOKEN_ACT),) + tuple(args[1:])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        return apply_block(config, block, hidden, positions, layer=layer)


def block_mse(config, layer, block, kernels, specs, act_rules, hidden, positions, target) -> jax.Array:
    out = _student_block(config, layer, block, kernels, specs, act_rules, hidden, positions)
    return jnp.mean((out - target) ** 2)


LKD_CHECKPOINTS = 8  # how often (evenly over the steps) LKD measures its kernels to keep the best


def distill_block(config, layer: int, block: dict, recipe, inputs: list, steps: int, lr: float, batch: int,
                  ) -> tuple[dict, dict]:
    """LKD for one float block -> (block with trained float kernels, {"mse_before", "mse_after"}).

    ``inputs`` are ``(hidden, positions)`` batches; the float block's outputs on
    them are the targets. The block returned has the kernels that gave the lowest MSE on the first batch at
    ``LKD_CHECKPOINTS`` checkpoints (the untrained kernels included); the reported MSEs are on that batch,
    before and of the kernels returned.
    """
    from llmeq_jax.models.model import apply_block

    rels = [r for r in block_kernel_paths(block) if quant_rule(recipe, layer, r) is not None]
    specs = {r: quant_rule(recipe, layer, r).weight for r in rels}
    act_rules = frozenset(r for r in rels if quant_rule(recipe, layer, r).act is not None)
    kernels = {r: get_path(block, r) for r in rels}
    targets = [jax.jit(apply_block, static_argnums=0, static_argnames="layer")(config, block, h, p, layer=layer)
               for h, p in inputs]
    # Sequences for the minibatches: every row of every input batch.
    seqs = [(h[j : j + batch], p[j : j + batch], t[j : j + batch]) for (h, p), t in zip(inputs, targets)
            for j in range(0, h.shape[0], batch)]

    mse = jax.jit(functools.partial(block_mse, config, layer), static_argnums=(2, 3))
    frozen_specs = tuple(sorted(specs.items()))

    def first_batch_mse(k):
        (h, p), t = inputs[0], targets[0]
        return float(mse(block, k, frozen_specs, act_rules, h, p, t))

    opt = optax.adam(lr)
    state = opt.init(kernels)

    @jax.jit
    def step(k, state, h, p, t):
        loss, grads = jax.value_and_grad(
            lambda kk: block_mse(config, layer, block, kk, frozen_specs, act_rules, h, p, t))(k)
        updates, state = opt.update(grads, state, k)
        return optax.apply_updates(k, updates), state, loss

    # Adam on fake-quantized weights does not descend steadily (a code that flips back and forth moves the loss
    # by more than a step's gain), so the last iterate can be worse than an earlier one, even than the start:
    # checkpoints along the way keep the best kernels seen, the untrained ones included.
    best, best_mse = kernels, first_batch_mse(kernels)
    before, every = best_mse, max(1, steps // LKD_CHECKPOINTS)
    for i in range(steps):
        h, p, t = seqs[i % len(seqs)]
        kernels, state, _ = step(kernels, state, h, p, t)
        if (i + 1) % every == 0 or i + 1 == steps:
            now = first_batch_mse(kernels)
            if now < best_mse:
                best, best_mse = kernels, now
    for r, w in best.items():
        block = set_path(block, r, w)
    return block, {"mse_before": before, "mse_after": best_mse}


def block_processor(config, recipe, opts: ZeroQuantOptions, info: dict):
    info.setdefault("lkd", {})

    def process(layer, block, block_stats, inputs):
        if opts.lkd_steps > 0:
            block, mses = distill_block(config, layer, block, recipe, inputs, opts.lkd_steps, opts.lkd_lr,
                                        opts.lkd_batch)
            info["lkd"][layer] = mses
        return rtn_block(block, layer, recipe, block_stats)

    return process
