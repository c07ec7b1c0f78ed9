"""Rotations (QuaRot / SpinQuant-style computational invariance): a recipe pre-step on the float params.

A recipe with ``rotate: {kind: hadamard, seed: 0, online_down_proj: true}`` has
its float params rewritten by :func:`rotate_params` before calibration and
quantization (``methods.quantize_model``). The rotated model computes the same
function (up to float rounding; ``tests/methods/test_rotate.py``) but its linear
inputs have no outlier channels, so per-tensor static int8 activations and
low-bit weights lose far less.

Llama family (RMSNorm, pre-norm). With ``Q`` orthogonal ``[d, d]``:

1. **Norm scales folded.** ``RMSNorm(x) * g @ W == RMSNorm(x) @ (diag(g) W)``:
   ``input_norm`` -> q/k/v, ``post_attn_norm`` -> gate/up, final ``norm`` ->
   the head; the norms' scales become 1.
2. **Residual stream rotated.** ``RMSNorm(x Q) == RMSNorm(x) Q`` once the norm
   has no scale (``||x Q|| = ||x||``), so the stream can carry ``x Q``: the
   embedding table becomes ``E Q``, every linear reading the stream ``Q^T W``
   (q/k/v, gate/up, the head), every linear writing it ``W Q`` (o_proj,
   down_proj, and o_proj's bias).
3. **Tied embeddings are untied.** The head of a tied model was ``E^T``; it
   becomes ``lm_head/kernel = Q^T diag(g) E^T`` (``[d, vocab]``) while the table
   is ``E Q``. ``models.head`` uses ``lm_head`` whenever the tree has one.
   This costs a second ``[d, vocab]`` matrix (the recipe's rule for
   ``lm_head`` decides its format).
4. **Online Hadamard before down_proj** (``online_down_proj: true``): the
   MLP's activation ``h = silu(gate) * up`` has massive outliers that no weight
   fold can absorb (the SiLU is in the way), so it is rotated at run time:
   ``h H`` with ``H = kron(H_a, H_b, ...)`` orthogonal, and down_proj's kernel
   becomes ``H^T W_d Q``. Where no Hadamard matrix of the intermediate size
   can be built (stories260K: 172) the online rotation is one random
   orthogonal matrix (a dense ``[n, n]`` matmul at run time). The model runs it as a ``down_rot`` submodule of the
   MLP (``models.llama.SwiGLU``: leaves ``mlp/down_rot/f_0, f_1, ...``, the
   Kronecker factors; absent -> no rotation), so down_proj's ``Linear`` and
   thus calibration, GPTQ's Hessian and the static activation scale see the
   rotated input.
5. **Per-head V/O rotation** (``rotate_vo: true``): each KV head's value
   features are rotated by a Hadamard ``[head_dim, head_dim]`` (v_proj's
   output columns), undone in o_proj's matching input rows; exact because
   attention mixes tokens, not features. Flattens o_proj's input.

The residual ``Q`` is ``diag(signs) H`` with random signs (``seed``) and ``H``
a normalized Hadamard matrix (``kind: hadamard``), built as a Kronecker product
of Sylvester (``2^k``) and Paley (``q + 1``, ``q`` a prime ``= 3 mod 4``)
Hadamard matrices: SmolLM2's 576 = 12 x 12 x 4, its 1536 = 12 x 128. Sizes with
no such factorization fail with a clear error; ``kind: random`` (a random
orthogonal matrix from the QR of a Gaussian) works for any size. Everything is
computed in float64 and stored as float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from llmeq_jax.core.rules import RecipeError

KINDS = ("hadamard", "random")
_KEYS = {"kind": str, "seed": int, "online_down_proj": bool, "rotate_vo": bool, "smooth_down": float}


@dataclasses.dataclass(frozen=True)
class RotateSpec:
    kind: str = "hadamard"
    seed: int = 0
    online_down_proj: bool = True
    rotate_vo: bool = False
    # SmoothQuant on down_proj's input *before* the rotation (0: off): s_j = max|h_j|^a / max|W_j|^(1-a)
    # from the float model's calibration absmax, folded into up_proj's columns and down_proj's rows; the
    # online Hadamard then spreads the already smoothed activation (methods.smooth_down_proj).
    smooth_down: float = 0.0


def parse_rotate(data: Any, source: str = "recipe") -> dict | None:
    """Validate a recipe's ``rotate:`` mapping -> a plain dict with defaults filled in (None stays None)."""
    if data is None:
        return None
    where = f"{source}: rotate"
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping with keys {sorted(_KEYS)}, got {data!r}")
    unknown = set(data) - set(_KEYS)
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_KEYS)}")
    out = dataclasses.asdict(RotateSpec())
    for k, v in data.items():
        t = _KEYS[k]
        if t is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, t) or (t is int and isinstance(v, bool)):
            raise RecipeError(f"{where}.{k} must be {'true or false' if t is bool else t.__name__}, got {v!r}")
        out[k] = v
    if out["kind"] not in KINDS:
        raise RecipeError(f"{where}.kind must be one of {list(KINDS)}, got {out['kind']!r}")
    if out["seed"] < 0:
        raise RecipeError(f"{where}.seed must be >= 0, got {out['seed']}")
    if not 0 <= out["smooth_down"] <= 1:
        raise RecipeError(f"{where}.smooth_down must be in [0, 1] (0: off), got {out['smooth_down']}")
    if out["smooth_down"] and not out["online_down_proj"]:
        raise RecipeError(f"{where}.smooth_down needs online_down_proj: true")
    return out


# --------------------------------------------------------------------------- Hadamard matrices


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, int(q ** 0.5) + 1))


@functools.lru_cache(maxsize=None)
def _paley(n: int) -> np.ndarray:
    """The +-1 Hadamard matrix of order ``n = q + 1`` (Paley I; ``q`` prime, ``q = 3 mod 4``)."""
    q = n - 1
    residues = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if a in residues else -1 for a in range(1, q)])
    jac = chi[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]  # Jacobsthal matrix Q[i, j] = chi(j - i)
    s = np.zeros((n, n))
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = jac
    return s + np.eye(n)


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard_factors(n: int) -> list[int] | None:
    """Orders of Hadamard matrices (Paley orders, then one power of two) whose Kronecker product has order ``n``."""
    if n >= 1 and n & (n - 1) == 0:
        return [n]
    for m in range(4, n + 1, 4):  # Paley orders q + 1 dividing n, smallest first
        if n % m == 0 and m & (m - 1) and _is_prime(m - 1) and (m - 1) % 4 == 3:
            rest = hadamard_factors(n // m)
            if rest is not None:
                return [m, *rest]
    return None


def hadamard_matrix(order: int) -> np.ndarray:
    """Orthogonal (normalized) Hadamard matrix of one factor order (a power of two or a Paley order)."""
    h = _sylvester(order) if order & (order - 1) == 0 else _paley(order)
    return h / np.sqrt(order)


def kron_factors(n: int, what: str) -> list[np.ndarray]:
    """The orthogonal Kronecker factors of a normalized Hadamard matrix of order ``n`` (float64)."""
    orders = hadamard_factors(n)
    if orders is None:
        raise RecipeError(f"rotate: no Hadamard matrix of order {n} ({what}) can be built as a Kronecker product "
                          "of Sylvester and Paley matrices; use rotate.kind: random")
    return [hadamard_matrix(m) for m in orders]


def kron(factors: list[np.ndarray]) -> np.ndarray:
    out = np.ones((1, 1))
    for f in factors:
        out = np.kron(out, f)
    return out


def online_factors(n: int, seed: int) -> list[np.ndarray]:
    """Kronecker factors of the online rotation before down_proj: a Hadamard matrix where one of order ``n``
    can be built (cheap at run time: one small matmul per factor), else one random orthogonal ``[n, n]``."""
    if hadamard_factors(n) is not None:
        return kron_factors(n, "intermediate size")
    q, r = np.linalg.qr(np.random.default_rng(seed + 1).standard_normal((n, n)))
    return [q * np.sign(np.diag(r))[None, :]]


def residual_rotation(n: int, spec: dict) -> np.ndarray:
    """The residual stream's orthogonal ``Q [n, n]`` (float64): ``diag(random signs) H``, or a random orthogonal."""
    rng = np.random.default_rng(spec["seed"])
    if spec["kind"] == "random":
        q, r = np.linalg.qr(rng.standard_normal((n, n)))
        return q * np.sign(np.diag(r))[None, :]
    signs = rng.choice([-1.0, 1.0], size=n)
    return signs[:, None] * kron(kron_factors(n, "hidden size"))


# --------------------------------------------------------------------------- the rewrite


def _f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def rotate_params(config, params: dict, spec: dict) -> dict:
    """The float params of ``config``'s model rotated under ``spec`` (see the module doc); same function."""
    if config.family == "gpt2":
        raise RecipeError("rotate: works on RMSNorm (llama-family) models; gpt2's LayerNorm subtracts the mean, "
                          "which does not commute with a rotation of the residual stream")
    leaves = jax.tree_util.tree_leaves(params)
    if any(not hasattr(leaf, "dtype") or not np.issubdtype(np.asarray(leaf).dtype, np.floating) for leaf in leaves):
        raise RecipeError("rotate: needs a float model (rotate before quantizing, not a quantized checkpoint)")
    d = config.hidden_size
    q = residual_rotation(d, spec)
    qt = q.T
    out: dict = {k: v for k, v in params.items()}
    table = _f64(params["embed"]["embedding"])
    out["embed"] = {**params["embed"], "embedding": (table @ q).astype(np.float32)}
    online = online_factors(config.intermediate_size, spec["seed"]) if spec["online_down_proj"] else None
    h_on = kron(online) if online is not None else None
    hd = config.head_dim
    h_head = kron(kron_factors(hd, "head dim")) if spec["rotate_vo"] else None
    for i in range(config.num_layers):
        b = params[f"layers_{i}"]
        attn, mlp = dict(b["attn"]), dict(b["mlp"])
        g = _f64(b["input_norm"]["scale"])
        for n in ("q_proj", "k_proj", "v_proj"):
            attn[n] = {**attn[n], "kernel": qt @ (g[:, None] * _f64(attn[n]["kernel"]))}
        wo = _f64(attn["o_proj"]["kernel"])
        if h_head is not None:  # each KV head's v columns by H, each query head's o_proj rows by H^T
            wv = attn["v_proj"]["kernel"].reshape(d, config.num_kv_heads, hd)
            attn["v_proj"]["kernel"] = np.einsum("dkh,hj->dkj", wv, h_head).reshape(d, -1)
            if "bias" in attn["v_proj"]:
                bv = _f64(attn["v_proj"]["bias"]).reshape(config.num_kv_heads, hd)
                attn["v_proj"]["bias"] = (bv @ h_head).reshape(-1)
            wo3 = wo.reshape(config.num_heads, hd, -1)
            wo = np.einsum("ij,kjd->kid", h_head.T, wo3).reshape(config.num_heads * hd, -1)
        attn["o_proj"] = {**attn["o_proj"], "kernel": wo @ q}
        if "bias" in attn["o_proj"]:
            attn["o_proj"]["bias"] = _f64(attn["o_proj"]["bias"]) @ q
        g = _f64(b["post_attn_norm"]["scale"])
        for n in ("gate_proj", "up_proj"):
            mlp[n] = {**mlp[n], "kernel": qt @ (g[:, None] * _f64(mlp[n]["kernel"]))}
        wd = _f64(mlp["down_proj"]["kernel"])
        if h_on is not None:
            wd = h_on.T @ wd
            mlp["down_rot"] = {f"f_{j}": f.astype(np.float32) for j, f in enumerate(online)}
        mlp["down_proj"] = {**mlp["down_proj"], "kernel": wd @ q}
        nb = dict(b)
        nb["input_norm"] = {**b["input_norm"], "scale": np.ones((d,), np.float32)}
        nb["post_attn_norm"] = {**b["post_attn_norm"], "scale": np.ones((d,), np.float32)}
        nb["attn"], nb["mlp"] = attn, mlp
        out[f"layers_{i}"] = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), nb)
    g = _f64(params["norm"]["scale"])
    head = table.T if "lm_head" not in params else _f64(params["lm_head"]["kernel"])
    out["lm_head"] = {"kernel": (qt @ (g[:, None] * head)).astype(np.float32)}
    out["norm"] = {**params["norm"], "scale": np.ones((d,), np.float32)}
    return jax.tree_util.tree_map(jax.numpy.asarray, out)
