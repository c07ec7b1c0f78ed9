"""Fine-tune a quantized model against its float model: learned scales (LSQ) and latent weights, KL loss.

Where :mod:`llmeq_jax.methods.qat` trains the *float* weights and quantizes afterwards, this
starts from a model some method (GPTQ, AWQ, RTN, ...) has already quantized and keeps its
grid: every weight-only uniform QArray kernel becomes

    w_hat = (clip(round(w / s) + z, qmin, qmax) - z) * s,    s = s0 * exp(d)

with a latent float ``w`` (starting at the dequantized weight, so step 0 is exactly the
quantized model), the method's scale ``s0`` and integer zero point ``z`` (kept), and a
learned log-multiplier ``d`` per scale (starting at 0). ``round`` passes its gradient
straight through (STE); through ``s`` the gradient is LSQ's (``round(w/s) - w/s`` inside
the grid, the clipped end's code outside). ``learn="scales"`` trains only ``d`` -- about
one parameter per group of weights, too few to memorise a text (EfficientQAT's end-to-end
step); ``"both"`` also moves ``w``, so codes can flip.

The loss is the KL divergence from the float model's next-token distribution to the
quantized one's (``loss="kl"``; teacher logits computed in the same step, no gradient),
which asks the quantized model to behave like the float model rather than to fit the
training text (``loss="nll"``, what :mod:`qat` does): fine-tuning on WikiText then
does not turn into adapting to WikiText.

Embedding tables, log2 grids and kernels with quantized activations stay as they are
(dequantized constants during training). Each decoder block is rematerialized.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.qarray import QArray, expand_to, int_range, is_qarray, pack
from llmeq_jax.core.rules import is_table, path_str
from llmeq_jax.methods.blockwise import option, parse_section

LEARN = ("scales", "both")
LOSSES = ("kl", "nll")
# What the fine-tuning trains on: windows of the calibration text, sequences sampled from the float
# model, or the two alternating (see `training_data`).
DATA = ("calibration", "sampled", "mixed")


@dataclasses.dataclass(frozen=True)
class DistillOptions:
    """A recipe's ``finetune:`` mapping (the step after the method; ``llmeq distill`` flags)."""

    steps: int = option(100, (int,), lambda v: v >= 1, "a positive integer")
    learn: str = option("scales", (str,), lambda v: v in LEARN, f"one of {list(LEARN)}")
    loss: str = option("kl", (str,), lambda v: v in LOSSES, f"one of {list(LOSSES)}")
    scale_lr: float = option(1e-3, (float,), lambda v: 0 < v < float("inf"), "a positive number")
    weight_lr: float = option(1e-5, (float,), lambda v: 0 < v < float("inf"), "a positive number")
    batch_size: int = option(2, (int,), lambda v: v >= 1, "a positive integer")
    # Tokens per training window. `llmeq` trains on steps x batch_size fresh windows of the calibration
    # text (methods.quantize_model without them: the calibration windows cut to this length).
    seq_len: int = option(256, (int,), lambda v: v >= 2, "an integer >= 2")
    clip_norm: float = option(1.0, (float,), lambda v: 0 < v < float("inf"), "a positive number")
    data: str = option("calibration", (str,), lambda v: v in DATA, f"one of {list(DATA)}")
    # Seed of the sampled sequences (data: sampled / mixed): the same recipe gives the same model.
    sample_seed: int = option(0, (int,), lambda v: v >= 0, "an integer >= 0")


def parse_finetune(data: Any, source: str = "recipe") -> dict | None:
    """Validate a recipe's ``finetune:`` mapping -> a plain dict with every option (None stays None)."""
    if isinstance(data, dict):  # YAML reads 1 as an int; a learning rate or norm written so is still a number
        data = {k: float(v) if isinstance(v, int) and not isinstance(v, bool) and k.endswith(("_lr", "_norm"))
                else v for k, v in data.items()}
    return parse_section(DistillOptions, data, source, "finetune")


def training_windows(windows: np.ndarray, seq_len: int) -> np.ndarray:
    """Calibration windows [N, T] cut into [N * T / seq_len, seq_len] (unchanged when seq_len does not divide T)."""
    n, t = windows.shape
    return windows.reshape(n * t // seq_len, seq_len) if t % seq_len == 0 else windows


def training_data(opts: DistillOptions, calibration: np.ndarray, sample) -> np.ndarray:
    """The windows :func:`train` cycles through for ``opts.data``: ``calibration`` itself, ``sample(n)``
    (n sampled windows, ``steps x batch_size`` of them), or the two alternating window by window
    (calibration first), ``steps x batch_size`` in all. Sampled text keeps the fine-tuning from fitting
    the calibration text's domain; mixing keeps part of what that domain gives."""
    n = opts.steps * opts.batch_size
    if opts.data == "calibration":
        return calibration
    if opts.data == "sampled":
        return sample(n)
    if calibration.shape[1] != opts.seq_len:
        raise ValueError(f"finetune data 'mixed' needs calibration windows of seq_len {opts.seq_len} tokens, "
                         f"got {calibration.shape[1]}")
    sampled = sample(n // 2)
    calib = calibration[np.arange(n - n // 2) % len(calibration)]
    out = np.empty((n, opts.seq_len), calibration.dtype)
    out[0::2], out[1::2] = calib, sampled
    return out


def learnable(path: str, leaf: Any) -> bool:
    """A kernel whose grid this module can train: uniform, weight-only, not an embedding table."""
    return (is_qarray(leaf) and leaf.grid == "uniform" and leaf.act_spec is None and leaf.ndim >= 2
            and not is_table(path))


def _paths(tree: Any) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_qarray)
    return [(path_str(p), leaf) for p, leaf in flat]


def init_trainable(qparams: Any) -> dict:
    """``{path: {"w": latent weight, "d": log scale multiplier}}`` for every learnable kernel."""
    return {path: {"w": leaf.dequantize(jnp.float32), "d": jnp.zeros_like(leaf.scale, jnp.float32)}
            for path, leaf in _paths(qparams) if learnable(path, leaf)}


def _round_ste(x: jax.Array) -> jax.Array:
    return x + jax.lax.stop_gradient(jnp.round(x) - x)


def grid_codes(q: QArray, w: jax.Array, scale: jax.Array, ste: bool) -> jax.Array:
    """Codes of ``w`` on ``q``'s grid with ``scale`` (zero point ``q``'s), as float, clipped to the range."""
    qmin, qmax = int_range(q.bits)
    x = w / expand_to(scale, q.shape, q.tile)
    r = _round_ste(x) if ste else jnp.round(x)
    if q.zero_point is None:
        return jnp.clip(r, -qmax, qmax)
    return jnp.clip(r + expand_to(q.zero_point.astype(jnp.float32), q.shape, q.tile), qmin, qmax)


def fake_quant_learned(q: QArray, w: jax.Array, d: jax.Array) -> jax.Array:
    """``w`` on ``q``'s grid with the scale ``q.scale * exp(d)``; STE through the rounding."""
    scale = q.scale.astype(jnp.float32) * jnp.exp(d)
    codes = grid_codes(q, w, scale, ste=True)
    if q.zero_point is not None:
        codes = codes - expand_to(q.zero_point.astype(jnp.float32), q.shape, q.tile)
    return (codes * expand_to(scale, q.shape, q.tile)).astype(q.dtype)


def student_tree(qtree: Any, trainable: dict, prefix: str = "") -> Any:
    """``qtree`` as float arrays: learnable kernels fake-quantized from ``trainable``, other QArrays dequantized."""

    def visit(key_path, leaf):
        path = prefix + path_str(key_path)
        if path in trainable:
            return fake_quant_learned(leaf, trainable[path]["w"], trainable[path]["d"])
        return leaf.dequantize() if is_qarray(leaf) else leaf

    return jax.tree_util.tree_map_with_path(visit, qtree, is_leaf=is_qarray)


def _block_trainable(trainable: dict, prefix: str) -> dict:
    return {k: v for k, v in trainable.items() if k.startswith(prefix)}


def student_logits(trainable: dict, qparams: dict, tokens: jax.Array, *, config) -> jax.Array:
    """Logits of the quantized model under ``trainable``; one decoder block rematerialized at a time."""
    from llmeq_jax.models.model import apply_block, embed, head

    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    top = {k: v for k, v in qparams.items() if not k.startswith("layers_")}
    top_float = student_tree(top, trainable)
    h = embed(config, top_float, tokens, positions)
    for i in range(config.num_layers):
        prefix = f"layers_{i}/"

        def block(tr, bq, h, i=i, prefix=prefix):
            return apply_block(config, student_tree(bq, tr, prefix), h, positions, layer=i)

        h = jax.checkpoint(block)(_block_trainable(trainable, prefix), qparams[f"layers_{i}"], h)
    return head(config, top_float, h)


def kl_to_teacher(student: jax.Array, teacher: jax.Array) -> jax.Array:
    """Mean over positions of KL(teacher || student) of next-token distributions (logits [B, T, V])."""
    log_t = jax.nn.log_softmax(teacher.astype(jnp.float32), axis=-1)
    log_s = jax.nn.log_softmax(student.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1))


def loss_fn(trainable, qparams, teacher_params, tokens, *, config, loss: str) -> jax.Array:
    from llmeq_jax.evaluate import token_nll
    from llmeq_jax.models.model import forward

    logits = student_logits(trainable, qparams, tokens, config=config)
    if loss == "nll":
        return jnp.mean(token_nll(logits, tokens))
    teacher = jax.lax.stop_gradient(forward(config, teacher_params, tokens))
    return kl_to_teacher(logits, teacher)


def make_optimizer(opts: DistillOptions, trainable: dict):
    import optax

    labels = {k: {"w": "w" if opts.learn == "both" else "frozen", "d": "d"} for k in trainable}
    inner = optax.multi_transform({"w": optax.adam(opts.weight_lr), "d": optax.adam(opts.scale_lr),
                                   "frozen": optax.set_to_zero()}, labels)
    return optax.chain(optax.clip_by_global_norm(opts.clip_norm), inner)


@functools.partial(jax.jit, static_argnames=("config", "loss", "opt"), donate_argnames=("trainable", "opt_state"))
def _step(trainable, opt_state, qparams, teacher_params, tokens, *, config, loss, opt):
    import optax

    value, grads = jax.value_and_grad(loss_fn)(trainable, qparams, teacher_params, tokens, config=config, loss=loss)
    updates, opt_state = opt.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, value


def finalize(qparams: Any, trainable: dict) -> Any:
    """``qparams`` with each learnable kernel re-encoded from its trained ``w`` and scale (same layout)."""

    def visit(key_path, leaf):
        path = path_str(key_path)
        if path not in trainable:
            return leaf
        t = trainable[path]
        scale = leaf.scale.astype(jnp.float32) * jnp.exp(t["d"])
        codes = grid_codes(leaf, t["w"], scale, ste=False).astype(jnp.int8)
        stored = pack(codes, leaf.bits, leaf.pack_axis)
        return dataclasses.replace(leaf, qvalue=stored, scale=scale.astype(leaf.scale.dtype))

    return jax.tree_util.tree_map_with_path(visit, qparams, is_leaf=is_qarray)


def train(config, qparams: dict, teacher_params: dict, windows: np.ndarray, opts: DistillOptions, *,
          progress: bool = False) -> tuple[dict, list, int]:
    """Fine-tune ``qparams`` against ``teacher_params`` on ``windows`` (cycled in order).

    Returns (quantized params in the same layout, losses, number of learned kernels)."""
    if len(windows) < opts.batch_size:
        raise ValueError(f"distillation has {len(windows)} training windows, fewer than one batch of "
                         f"{opts.batch_size}")
    trainable = init_trainable(qparams)
    if not trainable:
        raise ValueError("the quantized model has no kernel with a uniform weight-only grid to fine-tune")
    opt = make_optimizer(opts, trainable)
    opt_state, losses = opt.init(trainable), []
    n_batches = len(windows) // opts.batch_size
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=opts.steps, desc=f"distill ({opts.learn}, {opts.loss})", unit="step")
    for step in range(opts.steps):
        b = step % n_batches
        toks = jnp.asarray(windows[b * opts.batch_size:(b + 1) * opts.batch_size])
        trainable, opt_state, value = _step(trainable, opt_state, qparams, teacher_params, toks, config=config,
                                            loss=opts.loss, opt=opt)
        losses.append(float(value))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    if bar is not None:
        bar.close()
    return finalize(qparams, trainable), losses, len(trainable)


__all__ = ["DistillOptions", "fake_quant_learned", "finalize", "init_trainable", "kl_to_teacher", "learnable",
           "student_logits", "train", "training_data"]
