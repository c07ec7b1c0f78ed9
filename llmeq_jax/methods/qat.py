"""Quantization-aware training: fine-tune the float weights through fake quantization (STE), then quantize.

Every kernel a recipe rule quantizes is replaced in the forward pass by
``core.quantize.fake_quant(w, rule.weight)``: the forward sees exactly the
round-to-nearest grid the final checkpoint will hold; the backward passes the
gradient straight through where ``w`` lies inside the grid's range (zero where it
was clipped). Scales are recomputed from the current weights each step (they
follow the weights; no learned scales). The optimizer is optax AdamW with global
norm clipping. Each decoder block is rematerialized (``jax.checkpoint``): its
activations and fake-quantized weights are recomputed in the backward pass
instead of stored, so memory holds one block's activations at a time.

After ``steps`` steps the trained float tree goes through the recipe's method
(RTN or a calibrated one) like any float model. The loss is the next-token NLL of the
training text, or (``distill=True``) the KL divergence to the float model's predictions.
Learned scales (LSQ) start from a quantized model instead: :mod:`llmeq_jax.methods.distill`
(``llmeq qat --learn-scales``).

Training state (params, optimizer state, step, data position) is written every
``save_every`` steps to ``state_dir/qat_state.pkl`` (atomic rename) and picked up
again by ``resume=True``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.quantize import fake_quant
from llmeq_jax.core.rules import Recipe, is_quantizable, is_table, path_str

STATE_FILE = "qat_state.pkl"


@dataclasses.dataclass(frozen=True)
class QATOptions:
    steps: int = 100
    lr: float = 1e-5
    weight_decay: float = 0.0
    batch_size: int = 4
    clip_norm: float = 1.0
    save_every: int = 50

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.save_every < 1:
            raise ValueError(f"QAT needs steps, batch_size and save_every >= 1, got {self}")
        if not (self.lr > 0 and np.isfinite(self.lr)):
            raise ValueError(f"QAT learning rate must be finite and > 0, got {self.lr!r}")


def fake_quant_tree(tree: Any, recipe: Recipe, prefix: str = "") -> Any:
    """``tree`` with every kernel its first matching rule quantizes replaced by its fake-quantized value.

    The embedding table is left float here (it is looked up, not multiplied; the final
    quantization still applies its rule).
    """

    def visit(key_path, leaf):
        path = prefix + path_str(key_path)
        if not is_quantizable(path, leaf) or is_table(path):
            return leaf
        rule = recipe.rule_for(path)
        if rule is None or rule.skip:
            return leaf
        return fake_quant(leaf, rule.weight)

    return jax.tree_util.tree_map_with_path(visit, tree)


def qat_loss(params: dict, tokens: jax.Array, *, config, recipe: Recipe, teacher: dict | None = None) -> jax.Array:
    """Mean next-token NLL of the fake-quantized model; blocks rematerialized one at a time.

    With ``teacher`` (float params): the mean KL divergence from the teacher's next-token
    distribution instead (distillation: the model is asked to stay the float model, not to fit the text).
    """
    from llmeq_jax.evaluate import token_nll
    from llmeq_jax.methods.distill import kl_to_teacher
    from llmeq_jax.models.model import apply_block, embed, forward, head

    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    h = embed(config, params, tokens, positions)
    for i in range(config.num_layers):
        def block(bp, h, i=i):
            return apply_block(config, fake_quant_tree(bp, recipe, f"layers_{i}/"), h, positions, layer=i)

        h = jax.checkpoint(block)(params[f"layers_{i}"], h)
    top = {k: v for k, v in params.items() if not k.startswith("layers_")}
    logits = head(config, fake_quant_tree(top, recipe), h)
    if teacher is not None:
        return kl_to_teacher(logits, jax.lax.stop_gradient(forward(config, teacher, tokens)))
    return jnp.mean(token_nll(logits, tokens))


def make_optimizer(opts: QATOptions):
    import optax

    return optax.chain(optax.clip_by_global_norm(opts.clip_norm), optax.adamw(opts.lr, weight_decay=opts.weight_decay))


@functools.partial(jax.jit, static_argnames=("config", "rules", "opt"), donate_argnames=("params", "opt_state"))
def _step(params, opt_state, tokens, teacher, *, config, rules, opt):
    import optax

    recipe = Recipe(rules=rules)  # the rules (hashable) key the compile cache; method_args do not matter here
    loss, grads = jax.value_and_grad(functools.partial(qat_loss, config=config, recipe=recipe,
                                                       teacher=teacher))(params, tokens)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _save_state(state_dir: Path, state: dict) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / (STATE_FILE + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(jax.device_get(state), f)
    os.replace(tmp, state_dir / STATE_FILE)  # a killed save never leaves a half-written state


def load_state(state_dir: Path) -> dict | None:
    path = Path(state_dir) / STATE_FILE
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def train(config, params: dict, recipe: Recipe, windows: np.ndarray, opts: QATOptions, *,
          state_dir: str | Path | None = None, resume: bool = False, progress: bool = False,
          distill: bool = False) -> tuple[dict, list]:
    """QAT for ``opts.steps`` steps over ``windows`` (cycled in order) -> (trained float params, losses).

    ``distill``: the loss is the KL divergence to the starting (float) model instead of the NLL."""
    if len(windows) < opts.batch_size:
        raise ValueError(f"QAT has {len(windows)} training windows, fewer than one batch of {opts.batch_size}")
    opt = make_optimizer(opts)
    params = jax.tree_util.tree_map(jnp.array, params)  # own copies: the step donates its buffers
    teacher = jax.tree_util.tree_map(jnp.array, params) if distill else None
    opt_state, start, losses = opt.init(params), 0, []
    if resume and state_dir is not None:
        saved = load_state(Path(state_dir))
        if saved is not None:
            params = jax.tree_util.tree_map(jnp.asarray, saved["params"])
            opt_state = jax.tree_util.tree_map(jnp.asarray, saved["opt_state"])
            start, losses = int(saved["step"]), list(saved["losses"])
    n_batches = len(windows) // opts.batch_size
    steps = range(start, opts.steps)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=opts.steps, initial=start, desc="qat", unit="step")
    for step in steps:
        b = step % n_batches
        toks = jnp.asarray(windows[b * opts.batch_size:(b + 1) * opts.batch_size])
        params, opt_state, loss = _step(params, opt_state, toks, teacher, config=config, rules=recipe.rules, opt=opt)
        losses.append(float(loss))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if state_dir is not None and ((step + 1) % opts.save_every == 0 or step + 1 == opts.steps):
            _save_state(Path(state_dir), {"params": params, "opt_state": opt_state, "step": step + 1,
                                          "losses": losses})
    if bar is not None:
        bar.close()
    return params, losses


__all__ = ["QATOptions", "fake_quant_tree", "load_state", "qat_loss", "train"]
