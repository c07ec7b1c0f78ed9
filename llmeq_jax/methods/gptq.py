"""GPTQ (Frantar et al., 2022): quantize a kernel input row by input row, pushing each row's error onto the rest.

Our kernels are ``(in, out)`` and used as ``x @ W``, so GPTQ's "columns" (the
input features the Hessian ``H = X^T X`` is indexed by) are the *rows* of our
kernel. For each row ``i`` in order: quantize it, and spread its rounding
error over the rows not yet quantized through the upper Cholesky factor
``U`` of ``H^-1`` (``H^-1 = U^T U``)::

    err_i = (w_i - q_i) / U_ii ;   w_j -= U_ij * err_i   for j > i

Rows are processed in blocks of ``block_size``; within a block the update is
applied row by row, and the rows after the block get the whole block's error
at once ("lazy batch update"), which is the same arithmetic in a
cache-friendly order. The whole kernel is one jitted call (a ``fori_loop``
over blocks around a ``fori_loop`` over rows): one compile per kernel shape,
not one per block.

Scales: per-channel / per-tensor from the full kernel before any update;
groups (``group_size`` rows along the input dim, the last one may be shorter)
from the *current* (already error-updated) rows when the group's first row is
reached, unless ``static_groups`` (all group scales from the original kernel).
``act_order`` visits rows by decreasing Hessian diagonal; because a QArray's
groups are contiguous input ranges, act order with groups needs static
groups and turns them on.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.qarray import QArray, int_range
from llmeq_jax.core.quantize import (MSE_GRID, Spec, compute_scale, quantize, scale_from_range, tile_for,
                                     weighted_mse_scale)
from llmeq_jax.core.rules import RecipeError
from llmeq_jax.methods.blockwise import block_kernel_paths, option, options_from_args, quant_rule


class HessianWarning(UserWarning):
    """The Hessian needed more damping than asked for (the message names the layer and the damping)."""


@dataclasses.dataclass(frozen=True)
class GPTQOptions:
    """GPTQ's ``method_args``."""

    damp: float = option(0.01, (int, float), lambda v: v > 0,
                         "a number in (0, max_damp]")  # fraction of the mean Hessian diagonal added to the diagonal
    block_size: int = option(128, (int,), lambda v: v > 0, "a positive integer")
    act_order: bool = option(False, (bool,), lambda v: True, "true or false")
    static_groups: bool = option(False, (bool,), lambda v: True, "true or false")
    # H <- (1 - shrink) H + shrink diag(H): less weight on the input correlations that 16 calibration
    # windows estimate poorly (the feedback GPTQ fits to them); 0 = off
    shrink: float = option(0.0, (int, float), lambda v: 0 <= v <= 1, "a number in [0, 1]")
    # clip: mse with static groups: "hessian" weighs each row's error by H's diagonal, "none" does not
    mse_weight: str = option("hessian", (str,), lambda v: v in ("none", "hessian"), '"none" or "hessian"')
    # give up (error) when even this much damping does not make H positive definite
    max_damp: float = option(10.0, (int, float), lambda v: v > 0, "a positive number")

    def __post_init__(self):
        if not self.damp <= self.max_damp:
            raise RecipeError(f"gptq: method_args.damp must be a number in (0, {self.max_damp}], got {self.damp!r}")


def check_spec(path: str, spec: Spec) -> None:
    """GPTQ quantizes rows of an (in, out) kernel: groups must run along the input dim; clip: none or "mse"."""
    if spec.clip not in (None, "mse"):
        raise RecipeError(f"gptq: {path}: clip={spec.clip!r} is not supported; GPTQ takes no clip or clip: mse "
                          "(the per-group range shrink with the lowest reconstruction error)")
    if spec.scale_dtype is not None:
        # Its group scales come from the error-corrected rows inside the solver, not from compute_scale.
        raise RecipeError(f"gptq: {path}: scale_dtype={spec.scale_dtype!r} is not supported (GPTQ computes its "
                          "group scales during error feedback); remove it")
    if spec.granularity == "token":
        raise RecipeError(f"gptq: {path}: 'token' granularity is for activations, not weights")
    axis = spec.axis if spec.axis is not None else spec.default_axis
    if spec.granularity == "group" and axis % 2 != 0:
        raise RecipeError(f"gptq: {path}: groups must run along the input dim (axis 0), got axis {spec.axis}")
    if spec.granularity == "channel" and axis % 2 != 1:
        raise RecipeError(f"gptq: {path}: per-channel scales must be per output channel (axis -1 or 1)")


# --------------------------------------------------------------------------- Hessian


def inverse_cholesky(hessian: np.ndarray, damp: float, path: str, max_damp: float = 10.0,
                     dead: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1`` in float64, and the damping used.

    A Hessian that is not positive definite at ``damp`` is retried with 10x the
    damping until ``max_damp``; the damping that worked is reported as a
    :class:`HessianWarning` naming ``path``.
    """
    h = np.array(hessian, np.float64)
    diag = np.diag(h).copy()
    if dead is None:
        dead = diag == 0
    h[dead, dead] = 1.0  # inputs that were always zero: any row value is irrelevant; keep H invertible
    mean_diag = float(np.mean(np.diag(h)))
    if not np.isfinite(mean_diag) or mean_diag <= 0:
        raise ValueError(f"gptq: Hessian of {path} has a non-finite or non-positive diagonal (mean {mean_diag}); "
                         "the calibration activations are broken")
    tried = damp
    while True:
        upper = _upper_factor_of_inverse(h + np.eye(len(h)) * tried * mean_diag)
        if upper is not None:
            break
        if tried * 10 > max_damp:
            raise ValueError(f"gptq: Hessian of {path} is not positive definite even with damping {tried:g} x mean "
                             f"diagonal; the layer's calibration inputs are degenerate")
        tried *= 10
    if tried != damp:
        warnings.warn(f"gptq: Hessian of {path} is not positive definite with damp={damp:g}; "
                      f"damp={tried:g} (x mean diagonal) fixed it", HessianWarning, stacklevel=2)
    return upper, tried


def _upper_factor_of_inverse(h: np.ndarray) -> np.ndarray | None:
    """Upper triangular ``U`` with ``U^T U = h^-1`` (float64), or None when ``h`` is not positive definite.

    With ``J`` the order reversal and ``J h J = L L^T`` (Cholesky), ``h^-1 = (J L^-1 J)^T (J L^-1 J)``
    and ``J L^-1 J`` is upper triangular with a positive diagonal: one Cholesky and one triangular
    inverse, instead of inverting ``h`` and factoring the inverse again.
    """
    from scipy.linalg import lapack

    lower, info = lapack.dpotrf(h[::-1, ::-1], lower=1, clean=1)
    if info != 0:
        return None
    inv, info = lapack.dtrtri(lower, lower=1)
    if info != 0 or not np.all(np.isfinite(inv)):
        return None
    return np.ascontiguousarray(inv[::-1, ::-1])


# --------------------------------------------------------------------------- the algorithm


def _row_grid(scale_rows: jax.Array, zp_rows: jax.Array | None, w: jax.Array, bits: int):
    qmin, qmax = int_range(bits)
    q = jnp.round(w / scale_rows)
    if zp_rows is None:
        q = jnp.clip(q, -qmax, qmax)
        return q, q * scale_rows
    q = jnp.clip(q + zp_rows, qmin, qmax)
    return q, (q - zp_rows) * scale_rows


def _group_grid(w1, in_group, bits: int, symmetric: bool, mse: bool):
    """Scale (and zero point) of the rows ``in_group`` of ``w1`` [b, out], per output column.

    ``mse``: the range shrunk by the ratio of ``MSE_GRID`` with the lowest squared
    reconstruction error of those rows (the rows are GPTQ's current, error-updated
    values, so the clip follows the updates), else the full range.
    """
    masked = jnp.where(in_group[:, None], w1, 0.0)
    lo = None if symmetric else jnp.min(masked, axis=0)
    hi = jnp.max(jnp.abs(masked), axis=0) if symmetric else jnp.max(masked, axis=0)
    if not mse:
        return scale_from_range(lo, hi, bits, symmetric)

    def err(ratio):
        s, z = scale_from_range(None if lo is None else lo * ratio, hi * ratio, bits, symmetric)
        _, deq = _row_grid(s[None], None if z is None else z[None], w1, bits)
        return jnp.sum(jnp.where(in_group[:, None], (deq - w1) ** 2, 0.0), axis=0), s, z

    ratios = jnp.asarray(MSE_GRID, jnp.float32)
    errs, ss, zs = jax.vmap(err)(ratios)  # [R, out]
    best = jnp.argmin(errs, axis=0)
    pick = lambda a: jnp.take_along_axis(a, best[None], axis=0)[0]
    return pick(ss), (None if zs is None else pick(zs))


def _block(w1, u1, scale, zp, group_start, *, bits, symmetric, group, fixed, mse=False):
    """Quantize rows of one block. w1 [b, out], u1 [b, b] (upper factor, this block).

    ``fixed``: ``scale``/``zp`` are per row already ([b, out]); else ``group``
    rows share a scale computed from the current rows when a group starts
    (``group_start`` = index of the block's first row in the kernel).
    Returns integer values [b, out], the scales used per row, and the errors.
    """
    b = w1.shape[0]
    rows = jnp.arange(b)

    def body(i, carry):
        w1, q1, err1, cur_s, cur_z, s_rows, z_rows = carry
        if not fixed:
            # A group starts here: its scale from the current values of its rows inside this block.
            starts = (group_start + i) % group == 0
            in_group = (rows >= i) & (rows < i + group)
            new_s, new_z = jax.lax.cond(starts, lambda: _group_grid(w1, in_group, bits, symmetric, mse),
                                        lambda: (cur_s, None if symmetric else cur_z))
            cur_s = jnp.where(starts, new_s, cur_s)
            if not symmetric:
                cur_z = jnp.where(starts, new_z, cur_z)
            s_i, z_i = cur_s, (None if symmetric else cur_z)
        else:
            s_i, z_i = scale[i], (None if symmetric else zp[i])
        w = w1[i]
        q, deq = _row_grid(s_i, z_i, w, bits)
        err = (w - deq) / u1[i, i]
        later = (rows > i).astype(w1.dtype)
        w1 = w1 - (u1[i] * later)[:, None] * err[None, :]
        q1 = q1.at[i].set(q)
        err1 = err1.at[i].set(err)
        s_rows = s_rows.at[i].set(s_i)
        if not symmetric:
            z_rows = z_rows.at[i].set(z_i)
        return w1, q1, err1, cur_s, cur_z, s_rows, z_rows

    out = w1.shape[1]
    init_s = jnp.ones((out,), jnp.float32) if scale is None or not fixed else scale[0]
    init_z = jnp.zeros((out,), jnp.float32)
    z_rows = jnp.zeros_like(w1)
    carry = (w1, jnp.zeros_like(w1), jnp.zeros_like(w1), init_s, init_z, jnp.zeros_like(w1), z_rows)
    _, q1, err1, _, _, s_rows, z_rows = jax.lax.fori_loop(0, b, body, carry)
    return q1, err1, s_rows, (None if symmetric else z_rows)


@functools.partial(jax.jit, static_argnames=("bits", "symmetric", "group", "fixed", "mse", "block_size"))
def _solve(w, upper, row_scale, row_zp, *, bits, symmetric, group, fixed, mse, block_size):
    """All blocks of one kernel in one compiled loop -> (integer values, scale per row, zero point per row).

    ``w`` [k, out] and ``upper`` [k, k] are in the visiting order. The rows are padded to whole
    blocks with zero weights and an identity factor: a padded row quantizes to 0 with no error,
    so it changes nothing (it also leaves every group's range as it was: 0 is always in range).
    """
    k, n = w.shape
    bs = block_size
    kp = -(-k // bs) * bs
    pad = kp - k
    w = jnp.pad(w, ((0, pad), (0, 0)))
    u = jnp.pad(upper, ((0, pad), (0, pad))) + jnp.diag((jnp.arange(kp) >= k).astype(upper.dtype))
    if fixed:
        row_scale = jnp.pad(row_scale, ((0, pad), (0, 0)), constant_values=1.0)
        row_zp = None if row_zp is None else jnp.pad(row_zp, ((0, pad), (0, 0)))
    all_rows = jnp.arange(kp)

    def one_block(j, carry):
        w, q, s, z = carry
        i1 = j * bs
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, i1, bs, axis=0)
        u1 = jax.lax.dynamic_slice(u, (i1, i1), (bs, bs))
        sb = take(row_scale) if fixed else None
        zb = take(row_zp) if fixed and row_zp is not None else None
        q1, err1, s1, z1 = _block(take(w), u1, sb, zb, i1, bits=bits, symmetric=symmetric, group=group,
                                  fixed=fixed, mse=mse)
        # Lazy batch update: the rows after this block get the whole block's error at once.
        push = take(u).T @ err1  # [kp, out]
        w = w - jnp.where((all_rows >= i1 + bs)[:, None], push, 0.0)
        put = lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v, i1, axis=0)
        return w, put(q, q1), put(s, s1), (z if z1 is None else put(z, z1))

    zeros = jnp.zeros_like(w)
    _, q, s, z = jax.lax.fori_loop(0, kp // bs, one_block, (w, zeros, zeros, zeros))
    return q[:k], s[:k], z[:k]


def gptq_quantize(w: jax.Array, hessian: jax.Array, spec: Spec, opts: GPTQOptions = GPTQOptions(), *,
                  path: str = "kernel") -> tuple[np.ndarray, np.ndarray, np.ndarray | None, dict]:
    """GPTQ on one ``(in, out)`` kernel -> (int values [in, out], scale, zero_point, info).

    ``scale``/``zero_point`` have the shape :func:`quantize` gives for ``spec``
    (so the result fits a QArray); ``info`` holds the damping used.
    """
    check_spec(path, spec)
    w = np.array(w, np.float32)
    k, n = w.shape
    h = np.asarray(hessian, np.float64)
    if h.shape != (k, k):
        raise ValueError(f"gptq: {path}: Hessian shape {h.shape} does not match the kernel's input dim {k}")
    if opts.shrink:
        h = (1 - opts.shrink) * h + opts.shrink * np.diag(np.diag(h))
    dead = np.diag(h) == 0
    w[dead] = 0.0
    tile = tile_for(spec, (k, n))
    grouped = spec.granularity == "group"
    g = tile[0] if grouped else k
    static = (not grouped) or opts.static_groups or opts.act_order
    if static:
        # Scales from the original kernel, one per (row tile, out tile), expanded to one per row.
        if spec.clip == "mse" and opts.mse_weight == "hessian":
            # Rows weighted by how much the output feels them (H's diagonal): the clip no longer
            # sacrifices the rows of the large input channels to lower everybody else's error.
            row_weight = jnp.asarray(np.diag(h), jnp.float32)[:, None]
            scale, zp = _jit_weighted_mse_scale(jnp.asarray(w), spec, row_weight, tile)
        else:
            scale, zp = _jit_compute_scale(jnp.asarray(w), spec, tile)
        scale, zp = np.asarray(scale), None if zp is None else np.asarray(zp, np.float32)
        row_scale = _per_row(scale, tile, (k, n))
        row_zp = None if zp is None else _per_row(zp, tile, (k, n))
    perm = np.argsort(-np.diag(h), kind="stable") if opts.act_order else np.arange(k)
    upper, used = inverse_cholesky(h[np.ix_(perm, perm)], opts.damp, path, opts.max_damp, dead[perm])
    upper = upper.astype(np.float32)
    # With groups and dynamic scales, a block must hold whole groups (its rows are updated in place);
    # no block needs to be longer than the kernel (rounded up to whole groups).
    bs = opts.block_size if static else g * max(1, round(opts.block_size / g))
    bs = min(bs, k if static else -(-k // g) * g)
    q, s_rows, z_rows = _solve(jnp.asarray(w[perm]), jnp.asarray(upper),
                               jnp.asarray(row_scale[perm]) if static else None,
                               jnp.asarray(row_zp[perm]) if static and row_zp is not None else None,
                               bits=spec.bits, symmetric=spec.symmetric, group=g, fixed=static,
                               mse=spec.clip == "mse", block_size=bs)
    inv = np.argsort(perm)
    q = np.asarray(q)[inv]
    if static:
        return q.astype(np.int8), scale, zp, {"damp": used}
    s_rows = np.asarray(s_rows)
    z_rows = None if spec.symmetric else np.asarray(z_rows)
    # Dynamic groups: one scale per group = the scale of its first row.
    starts = np.arange(0, k, g)
    scale = s_rows[starts].reshape(len(starts), n // tile[1], tile[1])[:, :, 0]
    zp = None if z_rows is None else z_rows[starts].reshape(len(starts), n // tile[1], tile[1])[:, :, 0]
    return q.astype(np.int8), scale, zp, {"damp": used}


def _per_row(a: np.ndarray, tile, shape) -> np.ndarray:
    return np.repeat(np.repeat(a, tile[0], axis=0)[: shape[0]], tile[1], axis=1)[:, : shape[1]]


# Jitted once per (shape, spec): called eagerly, every small op of these compiles on its own for each
# new kernel shape, which cost more than GPTQ's solve on a 135M model.
_jit_compute_scale = jax.jit(compute_scale, static_argnames=("spec", "tile"))
_jit_weighted_mse_scale = jax.jit(weighted_mse_scale, static_argnames=("spec", "tile"))


@functools.partial(jax.jit, static_argnames=("spec", "dtype", "act_spec"))
def _codes_to_qarray(q, scale_rows, zp_rows, scale, zp, act_scale, *, spec, dtype, act_spec):
    deq = q.astype(jnp.float32) if zp_rows is None else q.astype(jnp.float32) - zp_rows
    return quantize((deq * scale_rows).astype(dtype), spec, scale=scale, zero_point=zp, act_spec=act_spec,
                    act_scale=act_scale)


def to_qarray(q: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, spec: Spec, dtype=jnp.float32,
              act_spec: Spec | None = None, act_scale: jax.Array | None = None) -> QArray:
    """A QArray holding exactly the integer values ``q`` on the grid ``scale``/``zp``."""
    tile = tile_for(spec, q.shape)
    return _codes_to_qarray(jnp.asarray(q), jnp.asarray(_per_row(scale, tile, q.shape), jnp.float32),
                            None if zp is None else jnp.asarray(_per_row(zp, tile, q.shape), jnp.float32),
                            jnp.asarray(scale, jnp.float32), None if zp is None else jnp.asarray(zp, jnp.float32),
                            act_scale, spec=spec, dtype=jnp.dtype(dtype), act_spec=act_spec)


# --------------------------------------------------------------------------- as a calibrated method


def parse_args(method_args: dict) -> GPTQOptions:
    return options_from_args(GPTQOptions, "gptq", method_args)


def sequential(opts: GPTQOptions) -> bool:
    return True  # each block's Hessians come from the already quantized blocks before it


def wants(opts: GPTQOptions) -> tuple[str, ...]:
    return ("hessian", "absmax")


def shared_input_groups(rels: list[str], hessians: dict, specs: dict) -> list[list[str]]:
    """``rels`` split into groups that GPTQ can solve as one kernel (their columns side by side).

    GPTQ treats every output column alone, given the Hessian of the input: kernels that read the
    same input (q/k/v, gate/up; their Hessians are equal) with the same per-column or per-group
    spec give the same integers solved together as apart, with one factorization and one
    compiled solve instead of two or three.
    """
    groups: list[list[str]] = []
    for rel in rels:
        for g in groups:
            first = g[0]
            if (specs[rel] == specs[first] and specs[rel].granularity != "tensor"
                    and hessians[rel].shape == hessians[first].shape
                    and np.array_equal(np.asarray(hessians[rel]), np.asarray(hessians[first]))):
                g.append(rel)
                break
        else:
            groups.append([rel])
    return groups


def block_processor(config, recipe, opts: GPTQOptions, info: dict):
    """process_block for calibrate: GPTQ on every kernel its rule quantizes, Hessians from this block's inputs."""
    from llmeq_jax.core.rules import static_act_scale
    from llmeq_jax.core.rules import get_path, set_path

    info.setdefault("damp", {})

    def process(layer, block, block_stats, inputs):
        del inputs
        rules = {rel: quant_rule(recipe, layer, rel) for rel in block_kernel_paths(block)}
        rules = {rel: r for rel, r in rules.items() if r is not None}
        hessians = {rel: block_stats[rel]["hessian"] for rel in rules}
        for group in shared_input_groups(list(rules), hessians, {rel: r.weight for rel, r in rules.items()}):
            ws = [get_path(block, rel) for rel in group]
            names = ", ".join(f"layers_{layer}/{rel}" for rel in group)
            spec = rules[group[0]].weight
            q, scale, zp, res = gptq_quantize(jnp.concatenate(ws, axis=1) if len(ws) > 1 else ws[0],
                                              hessians[group[0]], spec, opts, path=names)
            cuts = np.cumsum([w.shape[1] for w in ws])[:-1]
            parts = zip(np.split(q, cuts, axis=1), np.split(scale, cuts, axis=1),
                        [None] * len(ws) if zp is None else np.split(zp, cuts, axis=1))
            for rel, w, (q_i, s_i, z_i) in zip(group, ws, parts):
                rule, full = rules[rel], f"layers_{layer}/{rel}"
                act_scale = (static_act_scale(full, {full: block_stats[rel]}, rule.act_clip, rule.act)
                             if rule.act_static else None)
                block = set_path(block, rel, to_qarray(q_i, s_i, z_i, rule.weight, w.dtype, rule.act, act_scale))
                if res["damp"] != opts.damp:
                    info["damp"][full] = res["damp"]
        return block

    return process
