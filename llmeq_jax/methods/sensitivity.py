"""How much each linear layer's quantization costs: the tables the bit allocator solves over.

Two estimates of ``D[l][b]``, the calibration-loss increase when linear ``l`` alone
is quantized (RTN on the candidate grid, asymmetric by default) at ``b`` bits:

``proxy``     ``E[l][b] = sum_jn H_jj (Q_b(W) - W)_jn^2`` with ``H = X^T X`` of the layer's
              calibration inputs: the Hessian diagonal of the layer's output error times
              the measured weight-quantization noise (HAWQ-style trace x noise; the
              Hessian's diagonal is what an OBS/GPTQ-style second-order model weighs
              each input row with). One calibration pass; relative units.
``measured``  the real loss change: the float model's hidden state entering block ``i``
              is computed once, then for each linear of that block the block is rerun
              with only that kernel quantized and the *rest of the model from there on*
              (one compiled tail loop over stacked block weights, so one compile serves
              every start block). Measured at one width ``b0`` (the narrowest candidate,
              where the signal stands far above noise) and carried to the other widths by
              the proxy's ratio ``E[l][b] / E[l][b0]`` -- the second-order model says the
              loss change scales with the weighted noise energy.

``nll``       the calibration NLL's change when linear ``l`` alone moves from a *reference*
              width (the uniform model the budget is near, e.g. 4 bits g128) to candidate ``c``,
              to second order around that reference model: ``KL(ref || ref with l at c)``
              (the Gauss-Newton curvature term, tail reruns as above) plus the first-order term
              ``g . (Q_c(W) - Q_ref(W))`` with ``g`` the gradient of the calibration NLL at the
              reference model (one backward pass per batch of windows, so it can take many more
              tokens than the KL). Signed: a move can lower the NLL. Unlike the KL to the float
              model, it charges a layer what the calibration text's NLL pays for it, which is
              what perplexity measures (docs/seeds-methods.md, section 3).

All return ``{path: {bits: D}}``; the solvers in :mod:`llmeq_jax.methods.allocate` only
compare these numbers, so their unit does not matter.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.quantize import quantize_dequantize
from llmeq_jax.core.rules import get_path, set_path


# --------------------------------------------------------------------------- proxy


def hessian_diagonals(config, params: dict, windows: np.ndarray, progress: bool = False) -> dict[str, jax.Array]:
    """``{kernel path: diag(X^T X)}`` of every linear input in the decoder blocks (float model).

    Taken block by block inside calibration, so the full ``[in, in]`` Hessians never pile up.
    """
    from llmeq_jax.calibrate import calibrate

    diags: dict[str, jax.Array] = {}

    def keep_diag(layer, block, block_stats, inputs):
        for rel, s in block_stats.items():
            diags[f"layers_{layer}/{rel}"] = jnp.diagonal(s["hessian"])
        return block

    calibrate(config, params, windows, wants=("hessian",), process_block=keep_diag, keep=(), progress=progress,
              sequential=False)
    return diags


@functools.partial(jax.jit, static_argnames=("spec",))
def weighted_error(w: jax.Array, h_diag: jax.Array, *, spec) -> jax.Array:
    """``sum_jn h_j (Q(W) - W)_jn^2`` for an ``(in, out)`` kernel."""
    d = quantize_dequantize(w, spec) - w
    return jnp.sum(h_diag[:, None] * d * d)


def proxy_table(params: dict, diags: dict[str, jax.Array], paths: Sequence[str], candidates: Sequence[int],
                spec_for: Callable[[int], Any]) -> dict[str, dict[int, float]]:
    """``E[l][b]`` for every path and candidate width."""
    return {p: {b: float(weighted_error(get_path(params, p), diags[p], spec=spec_for(b))) for b in candidates}
            for p in paths}


# --------------------------------------------------------------------------- measured


def _stack_blocks(params: dict, n: int) -> Any:
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[params[f"layers_{i}"] for i in range(n)])


@functools.partial(jax.jit, static_argnames=("config",))
def _block_inputs(config, params, tokens):
    """Hidden states entering every block of the float model, ``[L + 1, B, T, d]`` (last: the final output)."""
    from llmeq_jax.models.model import apply_block, embed

    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    h = embed(config, params, tokens, positions)
    out = [h]
    for i in range(config.num_layers):
        h = apply_block(config, params[f"layers_{i}"], h, positions, layer=i)
        out.append(h)
    return jnp.stack(out)


@functools.partial(jax.jit, static_argnames=("config",))
def _tail_nll(config, params, stacked, first_block, h, tokens, start):
    """Mean next-token NLL when ``first_block`` replaces block ``start`` and blocks after it run as stored."""
    from llmeq_jax.evaluate import token_nll
    from llmeq_jax.models.model import apply_block, head

    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    h = apply_block(config, first_block, h, positions, layer=0)

    def body(i, h):
        bp = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stacked)
        return apply_block(config, bp, h, positions, layer=0)

    h = jax.lax.fori_loop(start + 1, config.num_layers, body, h)
    return jnp.mean(token_nll(head(config, params, h), tokens))


def measured_deltas(config, params: dict, windows: np.ndarray, paths: Sequence[str], spec, *,
                    progress: bool = False) -> dict[str, float]:
    """``{path: loss(only path quantized under spec) - loss(float)}`` on the calibration windows."""
    if config.sliding_window is not None:
        raise ValueError("measured sensitivities run every block through one compiled loop, which assumes "
                         "identical layers; this model has sliding-window layers: use --sensitivity proxy")
    tokens = jnp.asarray(windows)
    hs = _block_inputs(config, params, tokens)
    stacked = _stack_blocks(params, config.num_layers)
    base = float(_tail_nll(config, params, stacked, params["layers_0"], hs[0], tokens, 0))
    items = list(paths)
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="sensitivity", unit="linear", leave=False)
    out = {}
    for p in items:
        layer, _, rel = p.partition("/")
        i = int(layer.split("_")[1])
        block = params[layer]
        block_q = set_path(block, rel, quantize_dequantize(get_path(block, rel), spec))
        out[p] = float(_tail_nll(config, params, stacked, block_q, hs[i], tokens, i)) - base
    return out


@functools.partial(jax.jit, static_argnames=("spec",))
def qdq(w: jax.Array, *, spec) -> jax.Array:
    """``quantize_dequantize`` compiled once per (shape, spec)."""
    return quantize_dequantize(w, spec)


def _head_rows(config, params, ids) -> tuple[jax.Array, jax.Array | None]:
    """The output head's rows for token ids ``ids``: ``([len(ids), hidden], bias or None)``."""
    if config.tie_word_embeddings and "lm_head" not in params:
        return jnp.asarray(params["embed"]["embedding"])[ids], None
    lm = params["lm_head"]
    b = lm.get("bias")
    return jnp.asarray(lm["kernel"]).T[ids], (None if b is None else jnp.asarray(b)[ids])


@functools.partial(jax.jit, static_argnames=("config",))
def _subset_logp(config, params, rows, bias, h):
    """Log-probabilities over the vocabulary rows ``rows`` only (renormalised over them)."""
    from llmeq_jax.models.model import _norm_module

    hn = _norm_module(config).apply({"params": params["norm"]}, h).astype(jnp.float32)
    logits = jnp.einsum("btd,vd->btv", hn, rows.astype(jnp.float32))
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    return jax.nn.log_softmax(logits, axis=-1)


@functools.partial(jax.jit, static_argnames=("config",))
def _tail_kl(config, params, stacked, rows, bias, first_block, h, ref_p, ref_logp, start):
    """Mean over tokens of ``KL(float || this)`` when ``first_block`` replaces block ``start``."""
    from llmeq_jax.models.model import apply_block

    positions = jnp.broadcast_to(jnp.arange(h.shape[1]), h.shape[:2])
    h = apply_block(config, first_block, h, positions, layer=0)

    def body(i, h):
        bp = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stacked)
        return apply_block(config, bp, h, positions, layer=0)

    h = jax.lax.fori_loop(start + 1, config.num_layers, body, h)
    logp = _subset_logp(config, params, rows, bias, h)
    return jnp.mean(jnp.sum(ref_p * (ref_logp - logp), axis=-1))


def measured_kl(config, params: dict, windows: np.ndarray, paths: Sequence[str], specs: dict, *,
                reference: dict | None = None, top_k: int | None = 32, progress: bool = False) -> dict[str, dict]:
    """``{path: {key: mean KL(float || only path quantized under specs[key])}}`` in nats per token.

    The output distributions' KL divergence, not the change of the calibration NLL: it is
    never negative and its noise is far below the NLL change's (a 4-bit layer moves the NLL
    of a few hundred tokens by less than its sampling noise), while its expectation is the
    expected loss increase to first order. The float model's block inputs and output
    log-probabilities are computed once; each (linear, candidate) runs one compiled tail
    (its block with the quantize-dequantized kernel, then every later block), quantized
    inside a jit compiled once per (shape, spec).

    ``top_k``: the distributions are restricted to (and renormalised over) the union of
    every position's ``top_k`` most likely tokens under the float model -- SmolLM2's
    49k-row output head costs as much as eight of its blocks, and the tokens outside that
    set carry almost none of the probability. ``None``: the whole vocabulary (exact).

    ``reference``: the model the KL is measured against and whose other layers stay as they are
    (default: ``params`` itself); the candidate kernel is always quantized from ``params``.
    """
    if config.sliding_window is not None:
        raise ValueError("measured sensitivities run every block through one compiled loop, which assumes "
                         "identical layers; this model has sliding-window layers: use --sensitivity proxy")
    ref = params if reference is None else reference
    tokens = jnp.asarray(windows)
    hs = _block_inputs(config, ref, tokens)
    if top_k is None or top_k >= config.vocab_size:
        ids = np.arange(config.vocab_size)
    else:
        full = _subset_logp(config, ref, *_head_rows(config, ref, np.arange(config.vocab_size)), hs[-1])
        ids = np.unique(np.asarray(jax.lax.top_k(full, top_k)[1]))
        del full
    rows, bias = _head_rows(config, ref, ids)
    ref_logp = _subset_logp(config, ref, rows, bias, hs[-1])
    ref_p = jnp.exp(ref_logp)
    stacked = _stack_blocks(ref, config.num_layers)
    items = [(p, k) for p in paths for k in specs]
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="sensitivity", unit="run", leave=False)
    out: dict[str, dict] = {p: {} for p in paths}
    for p, k in items:
        layer, _, rel = p.partition("/")
        i = int(layer.split("_")[1])
        block_q = set_path(ref[layer], rel, qdq(get_path(params[layer], rel), spec=specs[k]))
        out[p][k] = float(_tail_kl(config, ref, stacked, rows, bias, block_q, hs[i], ref_p, ref_logp, i))
    return out


# --------------------------------------------------------------------------- nll: around a reference model


def reference_params(params: dict, paths: Sequence[str], spec) -> dict:
    """``params`` with every kernel in ``paths`` quantize-dequantized under ``spec``: the uniform reference model."""
    out = params
    for p in paths:
        out = set_path(out, p, qdq(get_path(params, p), spec=spec))
    return out


@functools.partial(jax.jit, static_argnames=("config",))
def _summed_nll_grad(config, params, tokens):
    """The gradient of the summed next-token NLL of ``tokens`` w.r.t. the decoder blocks' parameters."""
    from llmeq_jax.evaluate import token_nll
    from llmeq_jax.models.model import forward

    blocks = {k: v for k, v in params.items() if k.startswith("layers_")}

    def loss(b):
        return jnp.sum(token_nll(forward(config, {**params, **b}, tokens), tokens))

    return jax.grad(loss)(blocks)


def nll_gradient(config, params: dict, windows: np.ndarray, paths: Sequence[str], *, batch: int = 4,
                 progress: bool = False) -> dict[str, jax.Array]:
    """``{path: d mean-NLL / d kernel}`` at ``params``: the mean over every next-token prediction of ``windows``,
    accumulated ``batch`` windows at a time (one compiled backward pass per batch shape)."""
    starts = range(0, len(windows), batch)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="gradient", unit="batch", leave=False)
    total = {p: jnp.zeros_like(get_path(params, p)) for p in paths}
    for i in starts:
        g = _summed_nll_grad(config, params, jnp.asarray(windows[i:i + batch]))
        total = {p: total[p] + get_path(g, p) for p in paths}
    n = windows.shape[0] * (windows.shape[1] - 1)
    return {p: t / n for p, t in total.items()}


@jax.jit
def _first_order(g: jax.Array, w_c: jax.Array, w_ref: jax.Array) -> jax.Array:
    return jnp.sum(g * (w_c - w_ref))


def local_nll_table(config, params: dict, kl_windows: np.ndarray, grad_windows: np.ndarray, paths: Sequence[str],
                    specs: dict, reference, *, first_order: float = 0.5, top_k: int | None = 32,
                    progress: bool = False) -> dict[str, dict]:
    """``{path: {key: D}}``: the calibration NLL's change when ``path`` alone moves from ``specs[reference]``
    to ``specs[key]``, to second order around the model with every path at ``specs[reference]``.

    ``D = KL(ref || ref with path at key) + first_order * g . (Q_key(W) - Q_ref(W))``: the KL on
    ``kl_windows`` (:func:`measured_kl`), ``g`` the NLL gradient at the reference model on
    ``grad_windows``; ``D[reference] = 0``. ``first_order = 1`` is the NLL's own second-order model
    of the calibration text; smaller weights trust that text's first-order term less -- it is the
    part specific to the text (at 1, SmolLM2's allocation bought WikiText NLL with a loss on other text).
    """
    if reference not in specs:
        raise ValueError(f"the reference candidate {reference!r} is not among {list(specs)}")
    ref = reference_params(params, paths, specs[reference])
    others = {k: s for k, s in specs.items() if k != reference}
    kl = measured_kl(config, params, kl_windows, paths, others, reference=ref, top_k=top_k, progress=progress)
    grads = nll_gradient(config, ref, grad_windows, paths, progress=progress)
    out = {}
    for p in paths:
        w, w_ref = get_path(params, p), get_path(ref, p)
        row = {reference: 0.0}
        for k, spec in others.items():
            row[k] = kl[p][k] + first_order * float(_first_order(grads[p], qdq(w, spec=spec), w_ref))
        out[p] = row
    return out


def combine_table(measured: dict[str, dict], proxy: dict[str, dict], bits_of: Callable[[Any], int]
                  ) -> dict[str, dict]:
    """Measured values where there are some; every other candidate carried from a measured anchor.

    The anchor of an unmeasured candidate is the measured one of the same width if any (a
    group-size variant; of several, the one with the nearest proxy value), else the nearest narrower measured width, else the nearest wider:
    ``D[c] = D[anchor] * E[c] / E[anchor]`` with the proxy ``E`` (within one layer, whose
    downstream amplification is common to both, the second-order model says the loss change
    scales with the weighted noise energy). Non-positive measurements are floored at 1e-9.
    """
    out = {}
    for p, row in proxy.items():
        meas = {k: max(v, 1e-9) for k, v in measured.get(p, {}).items()}
        res = {}
        for c, e in row.items():
            if c in meas:
                res[c] = meas[c]
                continue
            b = bits_of(c)
            same = [k for k in meas if bits_of(k) == b]
            lower = sorted((k for k in meas if bits_of(k) < b), key=bits_of)
            higher = sorted((k for k in meas if bits_of(k) > b), key=bits_of)
            # of several same-width anchors, the one whose proxy value is closest (log scale): g64 from g128
            same.sort(key=lambda k: abs(math.log(max(row[k], 1e-300) / max(e, 1e-300))))
            a = same[0] if same else lower[-1] if lower else higher[0] if higher else None
            if a is None:
                res[c] = e
            else:
                res[c] = meas[a] * (e / row[a] if row[a] > 0 else 1.0)
        out[p] = res
    return out


def measured_table(deltas: dict[str, float], proxy: dict[str, dict[int, float]], b0: int) -> dict[str, dict[int, float]]:
    """Measured changes at ``b0`` carried to every width by the proxy's ratio; non-positive ones floored.

    A measured change at or below zero is noise (or a lucky rounding): it is floored at
    1e-6 of the largest change, so the layer still ranks by its proxy shape.
    """
    floor = 1e-6 * max(max(deltas.values()), 1e-12)
    out = {}
    for p, d in deltas.items():
        d0 = max(d, floor)
        e0 = proxy[p][b0]
        out[p] = {b: d0 * (e / e0 if e0 > 0 else 1.0) for b, e in proxy[p].items()}
    return out


def lagrange_coefficients(table: dict[str, dict[int, float]], weights: dict[str, int]) -> dict[str, float]:
    """Per-weight ``a * s^2`` of the model ``D(b) = n * a * s^2 * 2^(-2b)``: geometric mean of ``D(b) 4^b / n``."""
    out = {}
    for p, row in table.items():
        logs = [math.log(d) + 2 * b * math.log(2) - math.log(weights[p]) for b, d in row.items() if d > 0]
        out[p] = math.exp(sum(logs) / len(logs)) if logs else 1e-300
    return out


__all__ = ["combine_table", "hessian_diagonals", "local_nll_table", "measured_kl", "nll_gradient", "qdq",
           "lagrange_coefficients", "measured_deltas", "measured_table", "proxy_table", "reference_params",
           "weighted_error"]
