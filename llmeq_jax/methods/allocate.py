"""Per-layer bit-width allocation under a byte budget -> a recipe with one exact rule per linear.

Three steps, each a small pure function:

1. **Cost** of every candidate width per linear: the bytes its QArray really
   stores (packed values + float32 scales + zero points), from ``jax.eval_shape``
   of :func:`~llmeq_jax.core.quantize.quantize` -- so 3-bit values (eight per three
   bytes) cost 3/4 of 4-bit ones, while 5-7-bit values, which take int8 slots, cost
   what 8-bit ones cost, and the allocator sees it.
2. **Sensitivity** ``D[l][b]``: the calibration-loss increase when linear ``l``
   alone is quantized at ``b`` bits (:mod:`llmeq_jax.methods.sensitivity`):
   ``measured`` (real forward passes), ``proxy`` (Hessian diagonal x weight
   quantization noise) or ``nll`` (the calibration NLL's change of each linear's move
   from a uniform reference width, to second order: signed, what perplexity follows).
3. **Allocation** under the budget, two solvers:

   ``lagrange``  the high-rate rule: with ``D_l(b) ~ a_l * s_l^2 * 2^(-2b)`` per weight,
                 minimising ``sum D + lambda * bits`` gives ``b* = 1/2 log2(a_l s_l^2 / lambda)``
                 (reverse water-filling; e.g. Gersho & Gray, *Vector Quantization and
                 Signal Compression*, ch. 8). Each ``b*`` is rounded to the nearest
                 candidate; ``lambda`` is bisected (in log space) to the largest total
                 that fits the budget.
   ``greedy``    a multiple-choice knapsack by marginal gains: start every linear at its
                 cheapest width, repeatedly take the upgrade with the largest loss
                 decrease per extra byte that still fits, stop when none fits.

The budget is the bytes of the allocated linears (the decoder blocks' kernels);
``--budget-bits B`` means ``B * weights / 8`` bytes, so 4.25 is the size of
uniform int4 with groups of 128 and float32 scales.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax.core.qarray import SUPPORTED_BITS
from llmeq_jax.core.quantize import Spec, quantize
from llmeq_jax.core.rules import Recipe, Rule, is_quantizable, path_str

SOLVERS = ("greedy", "lagrange")


class AllocationError(ValueError):
    """A budget or candidate set that cannot give an allocation, with the reason."""


# --------------------------------------------------------------------------- layers and costs


def block_kernels(params: Any) -> dict[str, tuple[int, ...]]:
    """``{path: shape}`` of the linear kernels inside decoder blocks (``layers_<i>/.../kernel``), in tree order."""
    out = {}
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(params):
        path = path_str(key_path)
        if path.startswith("layers_") and is_quantizable(path, leaf):
            out[path] = tuple(int(s) for s in leaf.shape)
    if not out:
        raise AllocationError("the model has no linear kernels inside decoder blocks (layers_<i>/.../kernel)")
    return out


def candidate_bits(key) -> int:
    """The value width of a candidate key (``4``, ``"4g64"``, ``"4c"``)."""
    return key if isinstance(key, int) else int(re.match(r"\d+", key).group())


def candidate_spec(bits, group_size: int | None, symmetric: bool = False) -> Spec:
    """The spec a candidate stands for: RTN grid, groups along the input dim (or per channel).

    ``bits`` is a candidate key: an int (that width at ``group_size``), ``"BgG"`` (``B`` bits
    in groups of ``G``) or ``"Bc"`` (``B`` bits, one scale per output channel) -- group-size
    variants give the solver byte steps finer than whole widths.
    Asymmetric by default, like the ready 4-bit recipes: a symmetric 2-bit grid is the
    ternary ``{-s, 0, s}`` (3 levels), the asymmetric one has 4 levels on the group's
    ``[min, max]`` -- on SmolLM2 the difference between a usable narrow layer and a collapse.
    """
    if not isinstance(bits, int):
        m = re.fullmatch(r"(\d+)(?:g(\d+)|(c))", bits)
        bits, group_size = int(m.group(1)), (None if m.group(3) else int(m.group(2)))
    if group_size is None:
        return Spec(bits, "channel", symmetric=symmetric)
    return Spec(bits, "group", group_size=group_size, symmetric=symmetric)


def spec_bytes(shape: tuple[int, ...], spec: Spec) -> int:
    """Bytes a QArray of ``shape`` under ``spec`` stores (values, scales, zero points), computed without data."""
    q = jax.eval_shape(lambda w: quantize(w, spec), jax.ShapeDtypeStruct(shape, jnp.float32))
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(q))


def cost_table(shapes: dict[str, tuple[int, ...]], candidates: Sequence[int],
               group_size: int | None, symmetric: bool = False) -> dict[str, dict[int, int]]:
    """``{path: {bits: bytes}}`` (shapes repeat across blocks: computed once per distinct shape)."""
    memo: dict[tuple, int] = {}
    out = {}
    for path, shape in shapes.items():
        row = {}
        for b in candidates:
            key = (shape, b)
            if key not in memo:
                memo[key] = spec_bytes(shape, candidate_spec(b, group_size, symmetric))
            row[b] = memo[key]
        out[path] = row
    return out


def _candidate_key(token):
    """``"4"`` -> 4; ``"4g64"`` / ``"4c"`` stay strings (normalised); anything else -> None."""
    token = str(token).strip()
    m = re.fullmatch(r"(\d+)(?:g(\d+)|(c))?", token)
    if m is None or (m.group(2) is not None and int(m.group(2)) <= 0):
        return None
    if m.group(2) is None and m.group(3) is None:
        return int(m.group(1))
    return f"{int(m.group(1))}" + ("c" if m.group(3) else f"g{int(m.group(2))}")


def candidate_order(key) -> tuple:
    """Sort key: width, then coarser groups first (per channel, then larger groups)."""
    if isinstance(key, int):
        return (key, 1, 0)
    spec = candidate_spec(key, None)
    return (spec.bits, 0, 0) if spec.group_size is None else (spec.bits, 2, -spec.group_size)


def parse_candidates(text) -> tuple:
    """``"2,3,4,8"`` -> (2, 3, 4, 8); ``"2,4g256,4,4g64,8"`` adds group-size variants.

    An int key means that width at ``--group-size``; ``"BgG"`` B bits in groups of G;
    ``"Bc"`` B bits per output channel. Each width supported, at least two, no repeats.
    """
    tokens = text.split(",") if isinstance(text, str) else list(text)
    keys = [_candidate_key(t) for t in tokens]
    if any(k is None for k in keys):
        raise AllocationError(f"--candidates {text!r} is not a comma-separated list of widths (e.g. 2,3,4,8 or "
                              "2,4g256,4,4g64,8: B bits at --group-size, BgG in groups of G, Bc per channel)")
    bad = [k for k in keys if candidate_bits(k) not in SUPPORTED_BITS]
    if bad or len(keys) < 2 or len(set(keys)) != len(keys):
        raise AllocationError(f"--candidates {text!r}: expected at least two distinct candidates, widths from "
                              f"{list(SUPPORTED_BITS)}")
    return tuple(sorted(keys, key=candidate_order))


def budget_bytes(shapes: dict[str, tuple[int, ...]], budget_bits: float | None, budget_mb: float | None) -> int:
    """The byte budget of the allocated linears from exactly one of ``budget_bits`` / ``budget_mb``."""
    if (budget_bits is None) == (budget_mb is None):
        raise AllocationError("give exactly one of --budget-bits (average bits per weight, scales included) "
                              "or --budget-mb (megabytes, 1e6 bytes, of the allocated linears)")
    if budget_bits is not None:
        if not (math.isfinite(budget_bits) and budget_bits > 0):
            raise AllocationError(f"--budget-bits {budget_bits!r}: expected a finite number > 0")
        return int(math.floor(budget_bits * sum(math.prod(s) for s in shapes.values()) / 8))
    if not (math.isfinite(budget_mb) and budget_mb > 0):
        raise AllocationError(f"--budget-mb {budget_mb!r}: expected a finite number > 0")
    return int(math.floor(budget_mb * 1e6))


# --------------------------------------------------------------------------- guards


def edge_paths(paths: Sequence[str], num_layers: int) -> list[str]:
    """The linears of the first and last decoder blocks (``layers_0``, ``layers_<L-1>``)."""
    edges = {"layers_0", f"layers_{num_layers - 1}"}
    return [p for p in paths if p.split("/", 1)[0] in edges]


def restrict(cost: dict[str, dict[int, int]], table: dict[str, dict[int, float]], *, edges: Sequence[str] = (),
             edge_min_bits: int | None = None, max_delta: float | None = None) -> dict[str, dict[int, int]]:
    """The cost table with the widths no allocation may pick removed (the widest width always stays).

    Two guards against a catastrophic layout, which a knapsack trading one layer's
    collapse for several small gains would otherwise pick:

    * ``edge_min_bits``: the first and last blocks' linears (the ones every token's
      residual stream passes through first and last) never go below this width;
    * ``max_delta``: a width whose own estimated loss increase (``table``, in nats
      when measured) exceeds this is off the table for that linear.
    """
    edges = set(edges)
    out = {}
    for p, row in cost.items():
        widest = max(row, key=lambda b: (row[b], candidate_order(b)))
        keep = {b: c for b, c in row.items()
                if b == widest or ((edge_min_bits is None or p not in edges or candidate_bits(b) >= edge_min_bits)
                                   and (max_delta is None or table[p][b] <= max_delta))}
        out[p] = keep
    return out


# --------------------------------------------------------------------------- solvers


def _frontier(cost: dict[int, int], dist: dict[int, float]) -> list[int]:
    """Candidates not dominated by another (as cheap or cheaper and no worse), cheapest first."""
    order = sorted(cost, key=lambda b: (cost[b], dist[b], tuple(-x for x in candidate_order(b))))
    keep: list[int] = []
    for b in order:
        if not keep or dist[b] < dist[keep[-1]]:
            if keep and cost[b] == cost[keep[-1]]:
                keep[-1] = b
            else:
                keep.append(b)
    return keep


def _check_floor(cost, budget):
    floor = sum(min(c.values()) for c in cost.values())
    if floor > budget:
        raise AllocationError(f"budget of {budget} bytes is below the smallest allocation ({floor} bytes, every "
                              "linear at its cheapest candidate); raise the budget or add a narrower candidate")


def greedy(cost: dict[str, dict[int, int]], dist: dict[str, dict[int, float]], budget: int) -> dict[str, int]:
    """Marginal-gain knapsack: upgrades by largest loss decrease per extra byte, while they fit."""
    _check_floor(cost, budget)
    front = {p: _frontier(cost[p], dist[p]) for p in cost}
    choice = {p: f[0] for p, f in front.items()}
    used = sum(cost[p][b] for p, b in choice.items())
    while True:
        best, best_gain = None, -math.inf
        for p, f in front.items():
            cur = choice[p]
            for b in f[f.index(cur) + 1:]:  # any wider width, not only the next: skips a concave step
                extra = cost[p][b] - cost[p][cur]
                if used + extra > budget:
                    continue
                gain = (dist[p][cur] - dist[p][b]) / extra
                if gain > best_gain:
                    best, best_gain = (p, b), gain
        if best is None:
            return choice
        p, b = best
        used += cost[p][b] - cost[p][choice[p]]
        choice[p] = b


def lagrange(cost: dict[str, dict[int, int]], coef: dict[str, float], budget: int,
             iterations: int = 200) -> tuple[dict[str, int], float]:
    """``b* = 1/2 log2(coef / lambda)`` rounded to the nearest candidate; lambda bisected to fit the budget.

    ``coef[l]`` is ``a_l * s_l^2`` per weight (sensitivity x noise scale). Returns the
    allocation with the most bytes within the budget and its lambda.
    """
    _check_floor(cost, budget)

    def assign(log_lam: float) -> dict[str, int]:
        out = {}
        for p, c in cost.items():
            target = 0.5 * (math.log2(max(coef[p], 1e-300)) - log_lam)
            # a width that stores no fewer bytes than a wider one (5-7 bits in int8 slots) is never worth it
            cands = [x for x in sorted(c, key=candidate_order)
                     if not any(candidate_bits(y) > candidate_bits(x) and c[y] <= c[x] for y in c)]
            # nearest width; ties to the narrower one (cheaper), then cheapest among equal widths
            b = min(cands, key=lambda x: (abs(candidate_bits(x) - target), candidate_bits(x), c[x]))
            out[p] = b
        return out

    def total(a):
        return sum(cost[p][b] for p, b in a.items())

    lo, hi = -400.0, 400.0  # log2(lambda): lo -> widest everywhere, hi -> narrowest
    best = assign(hi)
    if total(best) > budget:  # rounding can land above the floor: take the cheapest candidates
        best = {p: min(c, key=lambda b: (c[b], candidate_order(b))) for p, c in cost.items()}
        return best, math.inf
    if total(assign(lo)) <= budget:
        return assign(lo), 2.0 ** lo
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        a = assign(mid)
        if total(a) <= budget:
            hi, best = mid, a
        else:
            lo = mid
    return best, 2.0 ** hi


# --------------------------------------------------------------------------- recipe


def method_settings(method: str) -> tuple[dict, Any]:
    """``(method_args, clip)`` of the shipped ``{method}-w4-g128`` recipe (e.g. GPTQ's act order, damping,
    shrinkage and Hessian-weighted clip search), so an allocated recipe quantizes each width the way the
    ready recipes do; ``({}, None)`` for a method without one (rtn)."""
    from importlib import resources

    from llmeq_jax.core.rules import load_recipe

    ready = resources.files("llmeq_jax") / "configs" / f"{method}-w4-g128.yaml"
    if not ready.is_file():
        return {}, None
    with resources.as_file(ready) as f:
        recipe = load_recipe(f)
    kernel = recipe.rule_for("layers_0/mlp/down_proj/kernel")
    return dict(recipe.method_args), (kernel.weight.clip if kernel.weight is not None else None)


# The quantizable leaves outside the decoder blocks, which an allocation leaves to its base recipe's rules.
OUTSIDE_BLOCKS = ("embed/embedding", "lm_head/kernel")


def base_settings(base: Recipe) -> dict:
    """What an allocation built on a ready recipe takes from it -> ``allocation_recipe`` keyword arguments.

    Its method and ``method_args``, its ``rotate`` pre-step, sampled ``calibration`` and ``finetune``
    post-step, the ``clip`` of its block-linear rule, and the rules it applies to the embedding table and the head (as exact-path rules,
    so they cannot catch a block linear): e.g. ``--base quarot-gptq-w3-g128-distill`` gives an allocation
    that is rotated, quantized by GPTQ and fine-tuned exactly like that recipe, only with per-linear widths.
    """
    kernel = base.rule_for("layers_0/mlp/down_proj/kernel")
    rules = [dataclasses.replace(rule, pattern=re.escape(path))
             for path in OUTSIDE_BLOCKS if (rule := base.rule_for(path)) is not None]
    return {"method": base.method, "method_args": dict(base.method_args), "base_rules": tuple(rules),
            "clip": kernel.weight.clip if kernel is not None and kernel.weight is not None else None,
            "rotate": base.rotate, "finetune": base.finetune, "calibration": base.calibration}


def recipe_settings(method: str, base: Recipe | None = None) -> dict:
    """``allocation_recipe`` keyword arguments: :func:`base_settings` of ``base`` when given, else ``method``
    with the settings of its ready recipe (:func:`method_settings`)."""
    if base is not None:
        return base_settings(base)
    method_args, clip = method_settings(method)
    return {"method": method, "method_args": method_args, "clip": clip}


def allocation_recipe(choice: dict[str, int], method: str, group_size: int | None, name: str,
                      method_args: dict | None = None, base_rules: Sequence[Rule] | None = None,
                      symmetric: bool = False, clip: Any = None, rotate: dict | None = None,
                      finetune: dict | None = None, calibration: dict | None = None) -> Recipe:
    """A recipe with one exact rule per allocated linear (``re.escape``d path), after ``base_rules``.

    The default base rules are the ready recipes' (the embedding table and an untied lm_head
    int8 per row, round-to-nearest). ``clip`` goes into every allocated linear's spec;
    ``rotate`` and ``finetune`` are the recipe's pre- and post-step, ``calibration`` its sampled
    calibration sequences (:func:`base_settings`).
    """
    if base_rules is None:
        base_rules = (Rule("embed/embedding", weight=Spec(8, "channel")),
                      Rule("lm_head/kernel", weight=Spec(8, "channel")))
    rules = list(base_rules)
    for path, bits in choice.items():
        spec = dataclasses.replace(candidate_spec(bits, group_size, symmetric), clip=clip)
        rules.append(Rule(re.escape(path), weight=spec))
    return Recipe(rules=tuple(rules), method=method, method_args=dict(method_args or {}), name=name,
                  rotate=rotate, finetune=finetune, calibration=calibration)


def summary(choice: dict[str, int], cost: dict[str, dict[int, int]], shapes: dict[str, tuple[int, ...]]) -> dict:
    """Bytes, average stored bits per weight and the histogram of widths of an allocation."""
    used = sum(cost[p][b] for p, b in choice.items())
    weights = sum(math.prod(shapes[p]) for p in choice)
    hist: dict[int, int] = {}
    for b in choice.values():
        hist[b] = hist.get(b, 0) + 1
    return {"bytes": used, "avg_bits": 8 * used / weights,
            "widths": {k: hist[k] for k in sorted(hist, key=candidate_order)},
            "weights": weights}


def recipe_yaml(recipe: Recipe, header: Sequence[str]) -> str:
    """The recipe as YAML (``core.rules`` schema) with ``#`` comment lines on top."""
    import yaml

    lines = "".join(f"# {h}\n" for h in header)
    return lines + yaml.safe_dump(recipe.to_dict(), sort_keys=False, width=120)


def measured_candidates(cost: dict[str, dict], candidates: Sequence) -> list:
    """The candidates whose loss change is measured; the others are carried by the proxy's ratio.

    One per width (the plain ``--group-size`` one when present), only widths some layer
    could pick (not costing as much as a wider width: 5-7-bit values in int8 slots are
    never worth it) and not the widest (8-bit changes are lost in noise and never matter to
    the solver). Group-size variants take their anchor's measurement times the proxy's ratio.
    """
    total = {k: sum(row[k] for row in cost.values()) for k in candidates}
    widths = sorted({candidate_bits(k) for k in candidates})
    out = []
    for b in widths[:-1]:
        keys = [k for k in candidates if candidate_bits(k) == b]
        keys = [k for k in keys if not any(candidate_bits(y) > b and total[y] <= total[k] for y in candidates)]
        if keys:
            out.append(b if b in keys else keys[0])
    return out or [candidates[0]]


# --------------------------------------------------------------------------- driver


def sensitivity_params(config, params: dict, rotate_spec: dict | None) -> dict:
    """The float params the sensitivities are measured on: rotated under the base recipe's ``rotate``
    pre-step when it has one (the same function, but the weights its method quantizes differ)."""
    if rotate_spec is None:
        return params
    from llmeq_jax.methods import rotate

    return rotate.rotate_params(config, params, rotate_spec)


SENSITIVITIES = ("measured", "proxy", "nll")


def reference_candidate(cost: dict[str, dict], budget: int):
    """The uniform allocation the ``nll`` sensitivity is taken around: the candidate whose uniform total is the
    largest within the budget (the cheapest candidate when none fits)."""
    keys = list(next(iter(cost.values())))
    total = {k: sum(row[k] for row in cost.values()) for k in keys}
    fits = [k for k in keys if total[k] <= budget]
    return max(fits, key=lambda k: (total[k], candidate_order(k))) if fits else min(keys, key=lambda k: total[k])


def sensitivity_table(config, params: dict, windows: np.ndarray, shapes: dict, candidates: Sequence, cost: dict,
                      spec_for, sensitivity: str = "measured", progress: bool = False, measure: Sequence | None = None,
                      *, reference=None, first_order: float = 0.5, grad_windows: np.ndarray | None = None
                      ) -> tuple[dict, float, float]:
    """``({path: {candidate: D}}, proxy seconds, measured seconds)``: the table the solvers take.

    ``measure``: the candidates whose KL is measured (default :func:`measured_candidates`);
    the others are carried from them by the proxy's ratio.
    ``nll``: every candidate is measured around the uniform ``reference`` candidate, the KL on
    ``windows`` and the first-order term (weighted ``first_order``) on ``grad_windows`` (default
    ``windows``); see :func:`llmeq_jax.methods.sensitivity.local_nll_table`.
    """
    import time

    from llmeq_jax.methods import sensitivity as sens

    if sensitivity == "nll":
        if measure is not None:
            raise AllocationError("--measure applies to --sensitivity measured; nll measures every candidate")
        if reference not in candidates:
            raise AllocationError(f"the nll reference {reference!r} is not among the candidates {list(candidates)}")
        t0 = time.perf_counter()
        table = sens.local_nll_table(config, params, windows, windows if grad_windows is None else grad_windows,
                                     list(shapes), {k: spec_for(k) for k in candidates}, reference,
                                     first_order=first_order, progress=progress)
        return table, 0.0, time.perf_counter() - t0
    t0 = time.perf_counter()
    diags = sens.hessian_diagonals(config, params, windows, progress=progress)
    table = sens.proxy_table(params, diags, list(shapes), candidates, spec_for)
    t_proxy = time.perf_counter() - t0
    t_measured = 0.0
    if sensitivity == "measured":
        t0 = time.perf_counter()
        measure = measured_candidates(cost, candidates) if measure is None else list(measure)
        unknown = [k for k in measure if k not in candidates]
        if unknown:
            raise AllocationError(f"--measure {unknown} are not among the candidates {list(candidates)}")
        kl = sens.measured_kl(config, params, windows, list(shapes), {k: spec_for(k) for k in measure},
                              progress=progress)
        table = sens.combine_table(kl, table, candidate_bits)
        t_measured = time.perf_counter() - t0
    return table, t_proxy, t_measured


def allocate(config, params: dict, windows: np.ndarray, *, candidates: Sequence[int], budget_bits: float | None = None,
             budget_mb: float | None = None, group_size: int | None = 128, solver: str = "greedy",
             sensitivity: str = "measured", method: str = "rtn", name: str = "allocated",
             symmetric: bool = False, edge_min_bits: int | None = 4, max_delta: float | None = 0.5,
             measure: Sequence | None = None, base: Recipe | None = None, progress: bool = False,
             reference=None, first_order: float = 0.5, grad_windows: np.ndarray | None = None
             ) -> tuple[Recipe, dict]:
    """Sensitivities on ``windows`` -> allocation under the budget -> (recipe, info).

    ``base``: a ready recipe the allocation is built on (:func:`base_settings`; replaces ``method``).
    With a ``rotate`` pre-step the sensitivities are measured on the rotated model, the one its
    method quantizes.

    ``edge_min_bits`` and ``max_delta`` are :func:`restrict`'s guards (``max_delta`` applies
    to measured and nll sensitivities only: the proxy's unit is not nats).
    ``reference``, ``first_order``, ``grad_windows``: the ``nll`` sensitivity's uniform reference
    candidate (default :func:`reference_candidate`), the weight of its first-order term and the
    windows of its gradient (default ``windows``).
    ``info`` holds the budget, the bytes used, the average stored bits, the width histogram,
    the per-layer choice and sensitivity table, and the seconds each step took.
    """
    import time

    from llmeq_jax.methods import sensitivity as sens

    if solver not in SOLVERS:
        raise AllocationError(f"--solver {solver!r} is not one of {list(SOLVERS)}")
    if sensitivity not in SENSITIVITIES:
        raise AllocationError(f"--sensitivity {sensitivity!r} is not one of {list(SENSITIVITIES)}")
    if sensitivity == "nll" and solver == "lagrange":
        raise AllocationError("--solver lagrange fits D(b) = a 2^(-2b) to losses that fall with the width; the nll "
                              "sensitivity is a signed change around a reference width: use --solver greedy")
    candidates = parse_candidates(candidates)
    settings = recipe_settings(method, base)
    params = sensitivity_params(config, params, settings.get("rotate"))
    shapes = block_kernels(params)
    budget = budget_bytes(shapes, budget_bits, budget_mb)
    cost = cost_table(shapes, candidates, group_size, symmetric)
    _check_floor(cost, budget)
    spec_for = functools.partial(candidate_spec, group_size=group_size, symmetric=symmetric)
    if sensitivity == "nll":
        reference = reference_candidate(cost, budget) if reference is None else _candidate_key(reference)
    table, t_proxy, t_measured = sensitivity_table(config, params, windows, shapes, candidates, cost, spec_for,
                                                   sensitivity, progress, measure, reference=reference,
                                                   first_order=first_order, grad_windows=grad_windows)
    cost = restrict(cost, table, edges=edge_paths(list(shapes), config.num_layers), edge_min_bits=edge_min_bits,
                    max_delta=max_delta if sensitivity != "proxy" else None)
    _check_floor(cost, budget)
    t0 = time.perf_counter()
    if solver == "greedy":
        choice, lam = greedy(cost, table, budget), None
    else:
        weights = {p: math.prod(s) for p, s in shapes.items()}
        choice, lam = lagrange(cost, sens.lagrange_coefficients(table, weights), budget)
    recipe = allocation_recipe(choice, group_size=group_size, name=name, symmetric=symmetric, **settings)
    info = {"base": base.name if base is not None else None, "budget_bytes": budget,
            **summary(choice, cost, shapes), "solver": solver, "sensitivity": sensitivity,
            "candidates": list(candidates), "group_size": group_size, "reference": reference,
            "first_order": first_order if sensitivity == "nll" else None, "symmetric": symmetric, "lambda": lam,
            "calib_windows": list(windows.shape), "proxy_s": t_proxy, "measured_s": t_measured,
            "solve_s": time.perf_counter() - t0, "choice": choice, "table": table}
    return recipe, info


__all__ = ["AllocationError", "allocate", "SOLVERS", "allocation_recipe", "base_settings", "recipe_settings",
           "sensitivity_params",
           "block_kernels", "budget_bytes", "candidate_spec",
           "candidate_bits", "candidate_order", "cost_table", "reference_candidate", "edge_paths", "measured_candidates", "greedy", "restrict", "sensitivity_table", "lagrange", "parse_candidates", "recipe_yaml", "spec_bytes", "summary"]
