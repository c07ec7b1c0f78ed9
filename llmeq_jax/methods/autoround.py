"""AutoRound / SignRound (Cheng et al., 2023): learned rounding and clip ranges, one decoder block at a time.

RTN rounds every weight to its nearest grid point and takes the grid from the
group's [min, max]. Neither choice looks at what the block computes. AutoRound
learns, per decoder block, on the calibration windows:

- ``V`` ``[in, out]`` in [-0.5, 0.5]: an offset added before rounding, so each
  weight may round up or down (``q = round(w / s + V) + z``);
- ``alpha``, ``beta`` ``[groups, out]`` in [``min_clip``, 1]: multipliers of the
  group's max and min, i.e. a learned per-group clip of the range.

The loss is the MSE between the block's output with fake-quantized kernels
(straight-through rounding) and the float block's output, both on the same
input: the hidden states of the already quantized blocks before it (the
block-by-block driver :func:`llmeq_jax.calibrate.calibrate`, ``sequential``).
The optimizer is signed gradient descent (``sign(grad)`` times a linearly
decaying learning rate, as in the paper: the update size is independent of the
gradient's scale, which varies by orders of magnitude between blocks), and the
parameters with the lowest loss seen are kept. ``V = 0, alpha = beta = 1`` is
exactly RTN, where training starts.

Cost per block: ``steps`` forward + backward passes of the block on ``batch``
sequences; the step is one jitted function (``jax.jit``) per block shape.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from llmeq_jax.core.qarray import int_range
from llmeq_jax.core.quantize import Spec, tile_for
from llmeq_jax.core.rules import RecipeError, get_path, set_path
from llmeq_jax.methods.blockwise import block_kernel_paths, option, options_from_args, quant_rule
from llmeq_jax.models.model import same_block_layer

@dataclasses.dataclass(frozen=True)
class AutoRoundOptions:
    """AutoRound's ``method_args``."""

    steps: int = option(200, (int,), lambda v: v >= 0, "a non-negative integer (0 = plain RTN)")
    lr: float | None = option(None, (float, type(None)), lambda v: v is None or v > 0,
                              "a positive number (default 1 / steps)")
    batch: int = option(1, (int,), lambda v: v >= 1, "a positive integer (sequences per step)")
    min_clip: float = option(0.5, (float,), lambda v: 0 < v <= 1, "a number in (0, 1]")
    seed: int = option(0, (int,), lambda v: v >= 0, "a non-negative integer")
    # Targets: the float *model*'s block outputs (the float block on the float model's hidden states,
    # carried block to block) instead of the float block's outputs on the quantized stream's inputs:
    # each block then also learns to undo the error the quantized blocks before it left.
    float_targets: bool = option(False, (bool,), lambda v: True, "true or false")
    # "mse": mean squared error of the block's outputs; "per_token": each token's error relative to
    # the RMS of its target (block_loss)
    loss: str = option("mse", (str,), lambda v: v in ("mse", "per_token"), '"mse" or "per_token"')


def parse_args(method_args: dict) -> AutoRoundOptions:
    return options_from_args(AutoRoundOptions, "autoround", method_args)


def sequential(opts: AutoRoundOptions) -> bool:
    return True  # each block trains on the hidden states of the quantized blocks before it


def wants(opts: AutoRoundOptions) -> tuple[str, ...]:
    return ("count",)  # nothing per linear: the block's inputs are what it trains on


def check_rule(path: str, rule) -> None:
    """AutoRound learns weight grids of groups (or whole columns) along the input dim; weights only."""
    spec = rule.weight
    if rule.act is not None:
        raise RecipeError(f"autoround: {path}: activation quantization is not supported (weight-only method); "
                          "remove the act spec")
    axis = spec.axis if spec.axis is not None else spec.default_axis
    if not ((spec.granularity == "group" and axis % 2 == 0) or (spec.granularity == "channel" and axis % 2 == 1)):
        raise RecipeError(f"autoround: {path}: needs groups along the input dim or per-output-channel scales, "
                          f"got {spec.describe()}")
    if spec.clip is not None:
        raise RecipeError(f"autoround: {path}: clip={spec.clip!r} is not supported (AutoRound learns its clip); "
                          "remove it")


# --------------------------------------------------------------------------- the quantizer with learned offsets


def _rows_per_group(spec: Spec, shape) -> int:
    return tile_for(spec, shape)[0]


def _grouped(w: jax.Array, g: int):
    """``w`` [in, out] -> (padded [G, g, out], valid mask [G, g, 1]); the last group may be shorter."""
    k, n = w.shape
    n_groups = -(-k // g)
    pad = n_groups * g - k
    wg = jnp.pad(w, ((0, pad), (0, 0))).reshape(n_groups, g, n)
    valid = (jnp.arange(n_groups * g) < k).reshape(n_groups, g, 1)
    return wg, valid


def _round_ste(x):
    return x + jax.lax.stop_gradient(jnp.round(x) - x)


def group_grid(w: jax.Array, alpha: jax.Array, beta: jax.Array, spec: Spec, ste: bool = True):
    """Scale and zero point [G, out] of the groups of ``w`` with their max x ``alpha`` and min x ``beta``.

    As :func:`llmeq_jax.core.quantize.scale_from_range`: the range always holds 0,
    so 0.0 stays exactly representable. Differentiable in ``alpha``/``beta``
    (the zero point's rounding is straight-through when ``ste``).
    """
    qmin, qmax = int_range(spec.bits)
    wg, valid = _grouped(w, _rows_per_group(spec, w.shape))
    tiny = jnp.finfo(jnp.float32).tiny
    if spec.symmetric:
        amax = jnp.max(jnp.where(valid, jnp.abs(wg), 0.0), axis=1) * alpha
        return jnp.maximum(amax / qmax, tiny), None
    hi = jnp.maximum(jnp.max(jnp.where(valid, wg, -jnp.inf), axis=1) * alpha, 0.0)
    lo = jnp.minimum(jnp.min(jnp.where(valid, wg, jnp.inf), axis=1) * beta, 0.0)
    scale = jnp.maximum((hi - lo) / (qmax - qmin), tiny)
    zp = qmin - lo / scale
    zp = _round_ste(zp) if ste else jnp.round(zp)
    return scale, jnp.clip(zp, qmin, qmax)


def quant_codes(w, v, alpha, beta, spec: Spec, ste: bool = True):
    """(integer codes [in, out] as floats, scale, zero point) of ``w`` with rounding offsets ``v``."""
    qmin, qmax = int_range(spec.bits)
    k, n = w.shape
    g = _rows_per_group(spec, w.shape)
    scale, zp = group_grid(w, alpha, beta, spec, ste)
    wg, _ = _grouped(w, g)
    vg, _ = _grouped(v, g)
    x = wg / scale[:, None, :] + vg
    q = _round_ste(x) if ste else jnp.round(x)
    if zp is None:
        q = jnp.clip(q, -qmax, qmax)
    else:
        q = jnp.clip(q + zp[:, None, :], qmin, qmax)
    return q.reshape(-1, n)[:k], scale, zp


def fake_quant_rounded(w, v, alpha, beta, spec: Spec):
    """Dequantized ``w`` on the learned grid, straight-through in ``w``'s rounding (gradients reach v, alpha, beta)."""
    k, n = w.shape
    g = _rows_per_group(spec, w.shape)
    q, scale, zp = quant_codes(w, v, alpha, beta, spec, ste=True)
    qg, _ = _grouped(q, g)
    deq = qg if zp is None else qg - zp[:, None, :]
    return (deq * scale[:, None, :]).reshape(-1, n)[:k].astype(w.dtype)


def init_params(w: jax.Array, spec: Spec) -> dict:
    """V = 0, alpha = beta = 1: exactly round-to-nearest on the full [min, max] range."""
    k, n = w.shape
    n_groups = -(-k // _rows_per_group(spec, w.shape))
    return {"v": jnp.zeros((k, n), jnp.float32), "alpha": jnp.ones((n_groups, n), jnp.float32),
            "beta": jnp.ones((n_groups, n), jnp.float32)}


def project(learned: dict, min_clip: float) -> dict:
    """Keep the learned parameters (per kernel) in their ranges after each step."""
    return {rel: _project_one(p, min_clip) for rel, p in learned.items()}


def _project_one(p: dict, min_clip: float) -> dict:
    return {"v": jnp.clip(p["v"], -0.5, 0.5), "alpha": jnp.clip(p["alpha"], min_clip, 1.0),
            "beta": jnp.clip(p["beta"], min_clip, 1.0)}


# --------------------------------------------------------------------------- one block


def _student_out(config, layer, block, kernels, learned, specs, hidden, positions):
    from llmeq_jax.models.model import apply_block

    for rel, w in kernels.items():
        p = learned[rel]
        block = set_path(block, rel, fake_quant_rounded(w, p["v"], p["alpha"], p["beta"], specs[rel]))
    return apply_block(config, block, hidden, positions, layer=layer)


def block_loss(config, layer, block, kernels, learned, specs, hidden, positions, target,
               per_token: bool = False) -> jax.Array:
    """MSE between the block with fake-quantized kernels and the float block's output ``target``.

    ``per_token``: each token's error relative to its target's RMS. The next block reads the
    residual stream through an RMS norm, so what matters is the error against the token's own
    scale; the plain MSE is ruled by the few tokens whose massive activations are hundreds of
    times larger than the rest (the attention-sink token of every window).
    """
    out = _student_out(config, layer, block, kernels, learned, specs, hidden, positions)
    err = out.astype(jnp.float32) - target.astype(jnp.float32)
    if per_token:
        t = target.astype(jnp.float32)
        err = err * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + 1e-12)
    return jnp.mean(err**2)


def optimizer(lr: float, steps: int) -> optax.GradientTransformation:
    """Signed gradient descent with a linearly decaying step (SignRound)."""
    return optax.chain(optax.scale_by_sign(), optax.scale_by_schedule(optax.linear_schedule(lr, 0.0, max(steps, 1))),
                       optax.scale(-1.0))


# Module-level jitted functions, keyed on (config, layer kind, specs): one compile serves every block of a
# model (the block, its kernels and the learned parameters are arguments, never baked-in constants).
@functools.partial(jax.jit, static_argnames=("config", "layer", "specs", "per_token"))
def _eval_loss(block, kernels, learned, hidden, positions, target, *, config, layer, specs, per_token):
    return block_loss(config, layer, block, kernels, learned, dict(specs), hidden, positions, target, per_token)


@functools.partial(jax.jit, static_argnames=("config", "layer", "specs", "lr", "steps", "min_clip", "per_token"))
def _step(block, kernels, learned, state, hidden, positions, target, *, config, layer, specs, lr, steps, min_clip,
          per_token):
    loss, grads = jax.value_and_grad(
        lambda l: block_loss(config, layer, block, kernels, l, dict(specs), hidden, positions, target,
                             per_token))(learned)
    updates, state = optimizer(lr, steps).update(grads, state, learned)
    return project(optax.apply_updates(learned, updates), min_clip), state, loss


@functools.partial(jax.jit, static_argnames=("config", "layer"))
def _float_block(block, hidden, positions, *, config, layer):
    from llmeq_jax.models.model import apply_block

    return apply_block(config, block, hidden, positions, layer=layer)


def float_outputs(config, layer: int, block: dict, inputs: list) -> list:
    """The float block's outputs on ``(hidden, positions)`` batches ``inputs``."""
    kind = same_block_layer(config, layer)
    return [_float_block(block, h, p, config=config, layer=kind) for h, p in inputs]


def train_block(config, layer: int, block: dict, specs: dict, inputs: list,
                opts: AutoRoundOptions, targets: list | None = None) -> tuple[dict, dict]:
    """Learn V, alpha, beta for the kernels ``specs`` names -> (learned params per kernel, info).

    ``inputs`` are ``(hidden, positions)`` batches; ``targets`` what the block should output on
    them (default: the float block's outputs on them). ``info`` holds the mean loss over all
    inputs before (RTN) and after training.
    """
    kernels = {r: get_path(block, r).astype(jnp.float32) for r in specs}
    learned = {r: init_params(w, specs[r]) for r, w in kernels.items()}
    kw = dict(config=config, layer=same_block_layer(config, layer), specs=tuple(sorted(specs.items())),
              per_token=opts.loss == "per_token")
    if targets is None:
        targets = float_outputs(config, layer, block, inputs)
    b = opts.batch
    seqs = [(h[j : j + b], p[j : j + b], t[j : j + b]) for (h, p), t in zip(inputs, targets)
            for j in range(0, h.shape[0], b)]

    def mean_loss(lrn):
        return float(np.mean([float(_eval_loss(block, kernels, lrn, h, p, t, **kw))
                              for (h, p), t in zip(inputs, targets)]))

    steps = opts.steps
    lr = float(opts.lr) if opts.lr is not None else 1.0 / max(steps, 1)
    state = optimizer(lr, steps).init(learned)
    before = mean_loss(learned)
    order = np.random.default_rng(opts.seed + layer).permutation(len(seqs))
    best, best_loss = learned, np.inf
    for i in range(steps):
        h, p, t = seqs[order[i % len(seqs)]]
        new, state, loss = _step(block, kernels, learned, state, h, p, t, lr=lr, steps=steps,
                                 min_clip=float(opts.min_clip), **kw)
        # ``loss`` is that of ``learned`` (before the update): keep the best parameters seen, as AutoRound does.
        if float(loss) < best_loss:
            best, best_loss = learned, float(loss)
        learned = new
    after = mean_loss(best) if steps else before
    if after > before:  # the minibatch-best can still lose on all windows: never do worse than RTN here
        best, after = {r: init_params(w, specs[r]) for r, w in kernels.items()}, before
    return best, {"loss_rtn": before, "loss_after": after}


def to_qarray(w: jax.Array, p: dict, spec: Spec):
    """The QArray of ``w`` on its learned grid with its learned rounding."""
    from llmeq_jax.methods.gptq import to_qarray as codes_to_qarray

    q, scale, zp = quant_codes(jnp.asarray(w, jnp.float32), p["v"], p["alpha"], p["beta"], spec, ste=False)
    if spec.granularity == "channel":  # one group spans all rows: scale [1, out]
        scale = scale.reshape(1, -1)
        zp = None if zp is None else zp.reshape(1, -1)
    return codes_to_qarray(np.asarray(q).astype(np.int8), np.asarray(scale), None if zp is None else np.asarray(zp),
                           spec, w.dtype)


def block_processor(config, recipe, opts: AutoRoundOptions, info: dict):
    info.setdefault("autoround", {})
    # float_targets: the float model's hidden states entering the next block. Block 0 starts from
    # the quantized stream's inputs (the two differ there only by the embedding table's own rounding).
    float_stream: list = []

    def process(layer, block, block_stats, inputs):
        del block_stats
        specs = {}
        for rel in block_kernel_paths(block):
            rule = quant_rule(recipe, layer, rel)
            if rule is None:
                continue
            check_rule(f"layers_{layer}/{rel}", rule)
            specs[rel] = rule.weight
        targets = None
        if opts.float_targets:
            targets = float_outputs(config, layer, block, float_stream or inputs)
            float_stream[:] = [(t, p) for t, (_, p) in zip(targets, inputs)]
        learned, res = train_block(config, layer, block, specs, inputs, opts, targets)
        info["autoround"][layer] = res
        for rel, spec in specs.items():
            block = set_path(block, rel, to_qarray(get_path(block, rel), learned[rel], spec))
        return block

    return process
