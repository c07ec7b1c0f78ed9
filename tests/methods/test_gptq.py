"""GPTQ against a straightforward NumPy implementation, and against RTN on the output error."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax.core.quantize import Spec, quantize
from llmeq_jax.core.rules import RecipeError
from llmeq_jax.methods.gptq import GPTQOptions, HessianWarning, gptq_quantize, inverse_cholesky, to_qarray
from llmeq_jax.methods.gptq import parse_args as gptq_parse_args


def numpy_gptq(w, h, bits, group, damp=0.01, act_order=False, symmetric=True):
    """Textbook GPTQ on an (in, out) kernel: one input row at a time, full update of all later rows.

    No blocks, no lazy batches: after quantizing row i, every later row j gets
    ``-U[i, j] / U[i, i] * (w_i - q_i)`` with U the upper Cholesky factor of H^-1.
    Group scales (symmetric absmax or asymmetric min/max) come from the
    current rows when a group starts, or, with act order, from the original
    kernel (static groups). Returns integer values in the original row order.
    """
    w = w.astype(np.float64).copy()
    k, n = w.shape
    h = h.astype(np.float64).copy()
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[dead] = 0
    h += np.eye(k) * damp * np.mean(np.diag(h))
    qmax = 2 ** (bits - 1) - 1
    qmin = -(2 ** (bits - 1))
    g = group or k

    def grid(rows):
        if symmetric:
            s = np.abs(rows).max(0) / qmax
            s[s == 0] = 1
            return s, None
        lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
        s = (hi - lo) / (qmax - qmin)
        s[s == 0] = 1
        return s, np.clip(np.round(qmin - lo / s), qmin, qmax)

    static = {gi: grid(w[gi * g : (gi + 1) * g]) for gi in range(-(-k // g))} if act_order else None
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    w, h = w[perm], h[np.ix_(perm, perm)]
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    q = np.zeros((k, n))
    for i in range(k):
        if act_order:
            s, z = static[perm[i] // g]
        elif i % g == 0:
            s, z = grid(w[i : i + g])
        if z is None:
            qi = np.clip(np.round(w[i] / s), -qmax, qmax)
            deq = qi * s
        else:
            qi = np.clip(np.round(w[i] / s) + z, qmin, qmax)
            deq = (qi - z) * s
        q[i] = qi
        err = (w[i] - deq) / u[i, i]
        w[i + 1 :] -= np.outer(u[i, i + 1 :], err)
    out = np.zeros_like(q)
    out[perm] = q
    return out.astype(np.int64)


def _layer(rng, k=96, n=24, t=400):
    # Correlated inputs with a few strong channels: the case GPTQ exists for.
    x = rng.normal(size=(t, k)) @ (np.eye(k) + 0.3 * rng.normal(size=(k, k))) * (1 + 4 * (rng.random(k) < 0.1))
    w = rng.normal(size=(k, n)) * 0.05
    return x.astype(np.float32), w.astype(np.float32), (x.T @ x).astype(np.float32)


def _agree(a, b):
    """Exact integer agreement, allowing a rare +-1 where float32 vs float64 rounding lands on a tie."""
    diff = np.abs(np.asarray(a, np.int64) - np.asarray(b, np.int64))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.005, f"{(diff > 0).sum()} of {diff.size} values differ"


@pytest.mark.parametrize(
    "bits, group, block, act_order, symmetric",
    [
        (4, 32, 64, False, True),     # groups inside blocks, dynamic group scales
        (3, 40, 16, False, True),     # group does not divide K=96; block rounded to whole groups
        (4, None, 32, False, True),   # per channel, several lazy blocks
        (4, 32, 32, True, True),      # act order -> static groups
        (4, 32, 64, False, False),    # asymmetric
    ],
)
def test_matches_numpy_reference(bits, group, block, act_order, symmetric):
    rng = np.random.default_rng(bits + (group or 0) + block)
    _, w, h = _layer(rng)
    spec = Spec(bits, "group", group_size=group, symmetric=symmetric) if group else Spec(
        bits, "channel", symmetric=symmetric)
    q, scale, zp, info = gptq_quantize(w, h, spec, GPTQOptions(block_size=block, act_order=act_order))
    ref = numpy_gptq(w, h, bits, group, act_order=act_order, symmetric=symmetric)
    _agree(q, ref)
    assert info["damp"] == 0.01
    # The QArray built from the result holds exactly these integers on that grid.
    qa = to_qarray(q, scale, zp, spec)
    np.testing.assert_array_equal(np.asarray(qa.values()), q)


@pytest.mark.parametrize("bits, group", [(4, 32), (3, 32), (4, None)])
def test_lower_output_error_than_rtn(bits, group):
    rng = np.random.default_rng(7)
    x, w, h = _layer(rng)
    spec = Spec(bits, "group", group_size=group) if group else Spec(bits, "channel")
    q, scale, zp, _ = gptq_quantize(w, h, spec)
    w_gptq = np.asarray(to_qarray(q, scale, zp, spec).dequantize())
    w_rtn = np.asarray(quantize(jnp.asarray(w), spec).dequantize())
    err_gptq = np.linalg.norm(x @ w - x @ w_gptq)
    err_rtn = np.linalg.norm(x @ w - x @ w_rtn)
    assert err_gptq < 0.9 * err_rtn


def test_dead_inputs_and_non_pd_hessian_report_the_damping():
    rng = np.random.default_rng(3)
    _, w, _ = _layer(rng, k=32, n=8)
    # Rank-deficient and slightly indefinite: Cholesky fails at 1% damping, a larger one fixes it.
    v = rng.normal(size=(32, 4))
    h = v @ v.T - 0.5 * np.eye(32) * np.mean(np.diag(v @ v.T))
    h[0, :] = h[:, 0] = 0  # an input that was always zero: its row is irrelevant and quantizes to 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q, *_, info = gptq_quantize(w, h, Spec(4, "channel"), path="layers_3/mlp/down_proj/kernel")
    assert info["damp"] > 0.01
    assert np.all(q[0] == 0) and np.any(q[1:] != 0)
    msgs = [str(c.message) for c in caught if issubclass(c.category, HessianWarning)]
    assert msgs and "layers_3/mlp/down_proj/kernel" in msgs[0] and f"damp={info['damp']:g}" in msgs[0]
    with pytest.raises(ValueError, match="not positive definite even with damping"):
        inverse_cholesky(np.array([[1.0, 10.0], [10.0, 1.0]]), 0.01, "layers_0/attn/q_proj/kernel", max_damp=0.5)


def test_bad_specs_and_args():
    w, h = np.ones((8, 4), np.float32), np.eye(8, dtype=np.float32)
    with pytest.raises(RecipeError, match="clip"):
        gptq_quantize(w, h, Spec(4, "channel", clip=0.9))  # only "mse" (a searched clip) is taken
    with pytest.raises(RecipeError, match="input dim"):
        gptq_quantize(w, h, Spec(4, "group", group_size=2, axis=1))
    with pytest.raises(RecipeError, match="unknown method_args"):
        gptq_parse_args({"dampening": 0.1})
    with pytest.raises(RecipeError, match="damp"):
        gptq_parse_args({"damp": -1.0})


@pytest.mark.parametrize("symmetric", [True, False])
def test_group_grid_mse_never_worse_than_the_full_range(symmetric):
    """GPTQ's per-group clip search on the current rows: the chosen grid's error is at most the full range's."""
    from llmeq_jax.methods.gptq import _group_grid, _row_grid

    rng = np.random.default_rng(5)
    w = rng.standard_t(df=3, size=(48, 16)).astype(np.float32)  # heavy tails: clipping pays off somewhere
    in_group = jnp.arange(48) < 40  # a group of 40 of the 48 rows

    def err(s, z):
        _, deq = _row_grid(s[None], None if z is None else z[None], jnp.asarray(w), 4)
        return np.sum(np.where(np.asarray(in_group)[:, None], (np.asarray(deq) - w) ** 2, 0.0), axis=0)

    full = err(*_group_grid(jnp.asarray(w), in_group, 4, symmetric, False))
    s, z = _group_grid(jnp.asarray(w), in_group, 4, symmetric, True)
    assert np.all(err(s, z) <= full * (1 + 1e-6))
    assert err(s, z).sum() < full.sum()
    if not symmetric:
        assert np.all((np.asarray(z) >= -8) & (np.asarray(z) <= 7))


@pytest.mark.parametrize("act_order", [False, True])
def test_asymmetric_mse_grid_beats_rtn_and_keeps_zero_points_in_range(act_order):
    rng = np.random.default_rng(11)
    x, w, h = _layer(rng)
    spec = Spec(4, "group", group_size=32, symmetric=False, clip="mse")
    q, scale, zp, _ = gptq_quantize(w, h, spec, GPTQOptions(act_order=act_order))
    assert zp is not None and np.all((zp >= -8) & (zp <= 7)) and np.all(zp == np.round(zp))
    assert q.min() >= -8 and q.max() <= 7
    qa = to_qarray(q, scale, zp, spec)
    np.testing.assert_array_equal(np.asarray(qa.values()), q)
    w_rtn = np.asarray(quantize(jnp.asarray(w), Spec(4, "group", group_size=32, symmetric=False)).dequantize())
    err_gptq = np.linalg.norm(x @ w - x @ np.asarray(qa.dequantize()))
    assert err_gptq < 0.9 * np.linalg.norm(x @ w - x @ w_rtn)


def test_upper_factor_of_the_inverse_matches_the_textbook_formula():
    from llmeq_jax.methods.gptq import _upper_factor_of_inverse

    rng = np.random.default_rng(2)
    x = rng.normal(size=(300, 40))
    h = x.T @ x
    u = _upper_factor_of_inverse(h)
    ref = np.linalg.cholesky(np.linalg.inv(h)).T
    np.testing.assert_allclose(u, ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max())
    assert np.array_equal(u, np.triu(u)) and np.all(np.diag(u) > 0)
    assert _upper_factor_of_inverse(np.array([[1.0, 10.0], [10.0, 1.0]])) is None  # not positive definite


@pytest.mark.parametrize("act_order", [False, True])
def test_siblings_of_one_input_solve_together_as_apart(act_order):
    """q/k/v (or gate/up) read one input: solved side by side they give the integers they give alone."""
    from llmeq_jax.methods.gptq import shared_input_groups

    rng = np.random.default_rng(4)
    _, w, h = _layer(rng, n=40)
    parts = [w[:, :24], w[:, 24:32], w[:, 32:]]
    spec = Spec(4, "group", group_size=32, symmetric=False)
    opts = GPTQOptions(act_order=act_order, block_size=32)
    alone = [gptq_quantize(p, h, spec, opts) for p in parts]
    together = gptq_quantize(np.concatenate(parts, axis=1), h, spec, opts)
    cuts = [24, 32]
    for i, (q, scale, zp, _) in enumerate(alone):
        np.testing.assert_array_equal(np.split(together[0], cuts, axis=1)[i], q)
        np.testing.assert_array_equal(np.split(together[1], cuts, axis=1)[i], scale)
        np.testing.assert_array_equal(np.split(together[2], cuts, axis=1)[i], zp)
    # Grouping: equal Hessians and specs go together; another input, another spec or a per-tensor scale do not.
    h2 = h + np.eye(len(h), dtype=h.dtype)
    hs = {"q": h, "k": h.copy(), "o": h2, "v": h.copy(), "t": h.copy()}
    specs = {"q": spec, "k": spec, "o": spec, "v": Spec(4, "group", group_size=64, symmetric=False),
             "t": Spec(8, "tensor")}
    assert shared_input_groups(list(hs), hs, specs) == [["q", "k"], ["o"], ["v"], ["t"]]


def test_hessian_weighted_mse_clip_keeps_the_rows_the_output_feels():
    """clip: mse with mse_weight: hessian searches each group's clip on H_ii-weighted errors: a row with a
    large input channel is no longer clipped to lower the other rows' error; uniform weights = plain MSE."""
    from llmeq_jax.core.quantize import compute_scale, weighted_mse_scale

    rng = np.random.default_rng(8)
    w = rng.standard_t(df=3, size=(64, 16)).astype(np.float32)
    w[5] = 4 * np.abs(w).max(axis=0)  # the largest weight of every column sits in row 5...
    hdiag = np.ones(64, np.float32)
    hdiag[5] = 1e4  # ...and row 5 carries a massive input channel
    spec = Spec(4, "group", group_size=32, symmetric=False, clip="mse")
    plain = compute_scale(jnp.asarray(w), spec)
    same = weighted_mse_scale(jnp.asarray(w), spec, jnp.ones((64, 1), jnp.float32))
    np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(same[0]))
    weighted = weighted_mse_scale(jnp.asarray(w), spec, jnp.asarray(hdiag)[:, None])

    def errors(s, z):
        qa = to_qarray(np.asarray(quantize(jnp.asarray(w), Spec(4, "group", group_size=32, symmetric=False),
                                           scale=s, zero_point=z).values()), np.asarray(s), np.asarray(z),
                       Spec(4, "group", group_size=32, symmetric=False))
        e = (np.asarray(qa.dequantize()) - w) ** 2
        return e[5].sum(), (e * hdiag[:, None]).sum()

    row5_plain, obj_plain = errors(*plain)
    row5_weighted, obj_weighted = errors(*weighted)
    assert row5_weighted < row5_plain and obj_weighted < obj_plain
    with pytest.raises(RecipeError, match="mse_weight"):
        gptq_parse_args({"mse_weight": "diag"})


def test_shrink_moves_the_hessian_toward_its_diagonal():
    """shrink: 1 leaves only H's diagonal: no error feedback between rows, i.e. round-to-nearest on the
    static grid; 0 is plain GPTQ; in between the result differs from both."""
    rng = np.random.default_rng(9)
    _, w, h = _layer(rng)
    spec = Spec(4, "group", group_size=32, symmetric=False)
    rtn = np.asarray(quantize(jnp.asarray(w), spec).values())
    full = gptq_quantize(w, h, spec, GPTQOptions(act_order=True, shrink=1.0))[0]
    np.testing.assert_array_equal(full, rtn)
    plain = gptq_quantize(w, h, spec, GPTQOptions(act_order=True))[0]
    np.testing.assert_array_equal(gptq_quantize(w, h, spec, GPTQOptions(act_order=True, shrink=0.0))[0], plain)
    some = gptq_quantize(w, h, spec, GPTQOptions(act_order=True, shrink=0.1))[0]
    assert np.any(some != plain) and np.any(some != rtn)
    with pytest.raises(RecipeError, match="shrink"):
        gptq_parse_args({"shrink": 1.5})
