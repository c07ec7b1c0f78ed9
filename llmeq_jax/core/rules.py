"""Rules and recipes: which parameter gets which quantization spec.

A :class:`Rule` matches the ``/``-joined path of a parameter leaf with
``re.fullmatch``; a :class:`Recipe` is an ordered list of rules plus a method.
The first matching rule wins. Quantizable leaves are the linear kernels
(leaves named ``kernel``, the ``(in, out)`` matrices that ``ops.linear``
consumes) and the token embedding table ``embed/embedding``; position
embeddings, norms and biases stay in float. The table is ``(vocab, hidden)``:
the transposed kernel of the LM head it also is when embeddings are tied, so a
rule's spec means the same on it as on ``lm_head/kernel`` (``channel`` = one
scale per vocabulary row, ``group`` = groups along hidden); see
:func:`table_spec`. Rules that matched nothing are
reported with an :class:`UnusedRuleWarning`, never silently ignored; a recipe
whose rules match no kernel at all is an error.

YAML form (``llmeq_jax/configs/*.yaml``)::

    name: rtn-w4-g128
    method: rtn            # which algorithm produces the weights
    method_args: {}        # its options
    rotate: {kind: hadamard, seed: 0, online_down_proj: true}   # optional pre-step (methods/rotate.py)
    rules:                 # first match wins
      - pattern: ".*lm_head.*"
        skip: true
      - pattern: ".*/kernel"
        weight: {bits: 4, granularity: group, group_size: 128}
        act: {bits: 8, granularity: token}   # optional: W8A8, dynamic per token
        act_static: false                     # true: per-tensor scale from calibration
        act_clip: 1.0                         # static only: the calibrated absmax times this ratio
        act_ema: 0.9                          # or: per-tensor scale tracked online (llmeq_jax/online.py)
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from llmeq_jax.core.qarray import QArray, is_qarray
from llmeq_jax.core.quantize import Spec, largest_value, quantize

QUANTIZABLE_LEAF = "kernel"
# The token embedding table: quantized row-wise, so a lookup dequantizes only the rows it reads
# and the tied LM head streams int8/int4 bytes (ops.take_rows, ops.linear(..., transpose=True)).
EMBEDDING_TABLE = "embed/embedding"


class RecipeError(ValueError):
    """A recipe (YAML or Python) that cannot be used, with the reason."""


class UnusedRuleWarning(UserWarning):
    """A rule whose pattern matched no quantizable parameter."""


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str
    weight: Spec | None = None
    act: Spec | None = None
    act_static: bool = False
    skip: bool = False
    act_ema: float | None = None  # online per-tensor activation scale: EMA decay in [0, 1) (llmeq_jax/online.py)
    # Static scales only: the calibrated absmax is multiplied by this ratio in (0, 1] (clips the rare
    # largest activations, e.g. of attention-sink tokens, for a finer grid on all others).
    act_clip: float = 1.0

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise RecipeError(f"rule pattern {self.pattern!r} is not a valid regular expression: {e}") from None
        if self.skip and (self.weight is not None or self.act is not None):
            raise RecipeError(f"rule {self.pattern!r} says skip and also gives a spec; choose one")
        if not self.skip and self.weight is None:
            raise RecipeError(f"rule {self.pattern!r} has no weight spec; give `weight:` or `skip: true`")
        if self.act is not None:
            if self.act.granularity not in ("token", "tensor"):
                raise RecipeError(
                    f"rule {self.pattern!r}: activation granularity must be 'token' or 'tensor', "
                    f"got {self.act.granularity!r}"
                )
            if self.act.bits != 8 or not self.act.symmetric or self.act.grid not in ("uniform", "fp8"):
                raise RecipeError(f"rule {self.pattern!r}: activations are quantized to symmetric int8 or fp8 (E4M3) "
                                  f"only, got {self.act.describe()}")
            if self.weight is not None and self.weight.bits > 8:
                raise RecipeError(f"rule {self.pattern!r}: W8A8 needs weights of at most 8 bits")
            if self.weight is not None and self.weight.grid != self.act.grid:
                want = "an fp8 weight grid (grid: fp8)" if self.act.grid == "fp8" else "a uniform weight grid"
                raise RecipeError(f"rule {self.pattern!r}: {self.act.describe()} activations need {want}, got "
                                  f"weight grid={self.weight.grid!r} (log2 weights run weight-only; int8 and fp8 "
                                  "operands do not meet in one dot)")
        if self.act_static and (self.act is None or self.act.granularity != "tensor"):
            raise RecipeError(f"rule {self.pattern!r}: act_static needs act granularity 'tensor'")
        if isinstance(self.act_clip, bool) or not isinstance(self.act_clip, (int, float)) \
                or not 0 < self.act_clip <= 1:
            raise RecipeError(f"rule {self.pattern!r}: act_clip must be a number in (0, 1], got {self.act_clip!r}")
        if self.act_clip != 1.0 and not self.act_static:
            raise RecipeError(f"rule {self.pattern!r}: act_clip applies to static activation scales (act_static: true)")
        if self.act_ema is not None:
            if self.act is not None and self.act.grid == "fp8":
                raise RecipeError(f"rule {self.pattern!r}: act_ema (online scales) tracks int8 ranges; fp8 activations "
                                  "take dynamic per-token scales or a static one (act_static: true)")
            if self.act is None or self.act.granularity != "tensor" or self.act_static:
                raise RecipeError(f"rule {self.pattern!r}: act_ema (online scales) needs act granularity 'tensor' "
                                  "and no act_static (a scale is either calibrated or tracked)")
            from llmeq_jax.core.ema import check_alpha

            try:
                check_alpha(self.act_ema)
            except ValueError as e:
                raise RecipeError(f"rule {self.pattern!r}: act_{e}") from None

    def matches(self, path: str) -> bool:
        return re.fullmatch(self.pattern, path) is not None


@dataclasses.dataclass(frozen=True)
class Recipe:
    rules: tuple[Rule, ...]
    method: str = "rtn"
    method_args: dict = dataclasses.field(default_factory=dict)
    name: str = "custom"
    kv: dict | None = None
    # A pre-step on the float params before calibration/quantization (methods/rotate.py), e.g.
    # {kind: hadamard, seed: 0, online_down_proj: true}; None: no rotation.
    rotate: dict | None = None
    # A post-step on the quantized params: fine-tune scales (and latent weights) against the float
    # model on the calibration windows (methods/distill.py), e.g. {steps: 100, learn: scales}; None: none.
    finetune: dict | None = None
    # More calibration data: sequences sampled from the float model added to the calibration windows
    # (methods/sampled_text.py), e.g. {sampled: 48, seed: 0}; None: the calibration windows only.
    calibration: dict | None = None

    def __post_init__(self):
        object.__setattr__(self, "rules", tuple(self.rules))
        if self.rotate is not None:
            from llmeq_jax.methods.rotate import parse_rotate

            object.__setattr__(self, "rotate", parse_rotate(self.rotate, f"recipe {self.name!r}"))
        if self.finetune is not None:
            from llmeq_jax.methods.distill import parse_finetune

            object.__setattr__(self, "finetune", parse_finetune(self.finetune, f"recipe {self.name!r}"))
        if self.calibration is not None:
            from llmeq_jax.methods.sampled_text import parse_calibration

            object.__setattr__(self, "calibration", parse_calibration(self.calibration, f"recipe {self.name!r}"))

    def rule_for(self, path: str) -> Rule | None:
        for rule in self.rules:
            if rule.matches(path):
                return rule
        return None

    def to_dict(self) -> dict:
        """Plain data (the YAML schema); stored with checkpoints."""
        out: dict[str, Any] = {"name": self.name, "method": self.method, "method_args": dict(self.method_args)}
        out["rules"] = [_rule_to_dict(r) for r in self.rules]
        if self.kv is not None:
            out["kv"] = dict(self.kv)
        if self.rotate is not None:
            out["rotate"] = dict(self.rotate)
        if self.finetune is not None:
            out["finetune"] = dict(self.finetune)
        if self.calibration is not None:
            out["calibration"] = dict(self.calibration)
        return out


# --------------------------------------------------------------------------- paths


def key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path: tuple) -> str:
    return "/".join(key_name(k) for k in path)


def get_path(tree: dict, path: str) -> Any:
    """The node of nested dicts ``tree`` at ``path`` ("layers_0/mlp/up_proj/kernel": :func:`path_str`'s form)."""
    for key in path.split("/"):
        tree = tree[key]
    return tree


def set_path(tree: dict, path: str, value: Any) -> dict:
    """A copy of ``tree`` with the node at ``path`` replaced (the dicts along the way copied, nothing else)."""
    head, _, rest = path.partition("/")
    out = dict(tree)
    out[head] = value if not rest else set_path(tree[head], rest, value)
    return out


def is_table(path: str) -> bool:
    """True for the token embedding table (quantized as the transposed head kernel)."""
    return path == EMBEDDING_TABLE


def is_quantizable(path: str, leaf: Any) -> bool:
    ndim = getattr(leaf, "ndim", 0)
    if is_table(path):
        return ndim == 2
    return path.rsplit("/", 1)[-1] == QUANTIZABLE_LEAF and ndim >= 2


def table_spec(spec: Spec) -> Spec:
    """A kernel-view spec on the ``(vocab, hidden)`` table: swap the axis it names.

    On an ``(in, out)`` kernel ``channel`` means one scale per output (axis -1) and
    ``group`` groups along the input (axis 0); the table is that kernel transposed,
    so the same spec acts on axis 0 (rows) and axis 1 (hidden) of the table.
    """
    if spec.granularity == "tensor":
        return spec
    if spec.granularity == "token":
        raise RecipeError(f"an embedding table takes tensor, channel or group specs, not {spec.granularity!r}")
    kernel_axis = (spec.axis if spec.axis is not None else spec.default_axis) % 2
    return dataclasses.replace(spec, axis=1 - kernel_axis)


def quantize_table(w: jax.Array, spec: Spec) -> QArray:
    """Quantize an embedding table under a kernel-view ``spec``; sub-byte values packed along hidden.

    Packing along hidden (axis 1) keeps every vocabulary row whole, so a lookup gathers rows.
    """
    return _quantize_table_jit(jnp.asarray(w), spec=table_spec(spec))


@functools.partial(jax.jit, static_argnames=("spec",))
def _quantize_table_jit(w, *, spec):
    return quantize(w, spec, pack_axis=1)


def leaf_paths(params: Any) -> list[str]:
    return [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_qarray)]



# --------------------------------------------------------------------------- quantize_params


def check_finite(path: str, leaf: Any) -> None:
    # Counted where the weights live: on an accelerator one number comes back, not the weights (a NumPy
    # check copied a 7B model's 13 GB off the GPU: a 17.5 GB host peak, much of its 20-28 s of round-to-
    # nearest); on the host NumPy counts faster than XLA's CPU backend (0.7 s against 1.2 s on two bf16
    # Llama-2-7B layers).
    on_host = not isinstance(leaf, jax.Array) or all(d.platform == "cpu" for d in leaf.devices())
    n = int(np.size(leaf) - np.count_nonzero(np.isfinite(np.asarray(leaf)))) if on_host else int(_nonfinite(leaf))
    if n:
        raise ValueError(f"parameter {path!r} holds {n} NaN/Inf value(s); quantization needs finite weights")


@jax.jit
def _nonfinite(a: jax.Array) -> jax.Array:
    return jnp.sum(~jnp.isfinite(a), dtype=jnp.int32)


def static_act_scale(path: str, stats: dict | None, clip: float = 1.0, act: Spec | None = None) -> jax.Array:
    """Per-tensor activation scale from the calibrated absmax of ``path``'s input (times ``clip``): onto
    int8's 127, or onto 448 for an fp8 ``act`` spec."""
    if stats is None or path not in stats or "absmax" not in stats[path]:
        raise RecipeError(
            f"static activation scale for {path!r} needs calibration statistics "
            "(stats[path]['absmax']); run calibration first or use dynamic per-token activations"
        )
    amax = jnp.max(jnp.asarray(stats[path]["absmax"], jnp.float32)) * clip
    top = largest_value(act if act is not None else Spec(8))
    return jnp.reshape(jnp.maximum(amax, jnp.finfo(jnp.float32).tiny) / top, ())


def map_rules(
    params: Any,
    recipe: Recipe,
    fn: Callable[[str, jax.Array, Rule], Any],
    progress: bool = False,
) -> Any:
    """Apply ``fn(path, leaf, rule)`` to every quantizable leaf whose first matching rule quantizes it.

    The shared walk of every method: it checks leaves are finite, warns about
    rules that matched nothing, and fails if the recipe touches no kernel.
    """
    used: set[int] = set()
    touched = [0]
    bar = None
    if progress:
        from tqdm import tqdm

        n = sum(is_quantizable(p, leaf) for p, leaf in zip(leaf_paths(params), jax.tree_util.tree_leaves(params)))
        bar = tqdm(total=n, desc=f"quantize {recipe.name}", unit="layer", leave=False)

    def visit(key_path, leaf):
        path = path_str(key_path)
        if isinstance(leaf, QArray) or not is_quantizable(path, leaf):
            return leaf
        for i, rule in enumerate(recipe.rules):
            if rule.matches(path):
                used.add(i)
                touched[0] += 1
                if rule.skip:
                    return leaf
                check_finite(path, leaf)
                out = fn(path, leaf, rule)
                if bar is not None:
                    bar.update(1)
                return out
        return leaf

    out = jax.tree_util.tree_map_with_path(visit, params, is_leaf=is_qarray)
    if bar is not None:
        bar.close()
    if recipe.rules and touched[0] == 0:
        kernels = [p for p in leaf_paths(params) if p.endswith("/" + QUANTIZABLE_LEAF)][:5]
        raise RecipeError(
            f"recipe {recipe.name!r} matched no quantizable parameter; kernel paths look like {kernels}"
        )
    paths = set(leaf_paths(params))
    for i, rule in enumerate(recipe.rules):
        if i not in used and not _for_an_absent_tied_head(rule, paths):
            warnings.warn(f"recipe {recipe.name!r}: rule {rule.pattern!r} matched no parameter", UnusedRuleWarning)
    return out


# The separate LM head a rule may be written for (the ready recipes quantize it int8 per row by a rule of its own).
HEAD_KERNEL = "lm_head/kernel"


def _for_an_absent_tied_head(rule: Rule, paths: set[str]) -> bool:
    """A rule for the LM head cannot apply to a model whose head is tied to the embedding table
    (the tree has the table and no head kernel): it is not reported as unused there. A rule that
    would not match the head either (a typo) still is."""
    return rule.matches(HEAD_KERNEL) and HEAD_KERNEL not in paths and EMBEDDING_TABLE in paths


def quantize_leaf(path: str, w: jax.Array, rule: Rule, stats: dict | None = None) -> QArray:
    """Round-to-nearest quantization of one kernel (or the embedding table) under ``rule``."""
    if is_table(path):
        if rule.act is not None:  # e.g. a ".*" W8A8 rule: the table still gets its weight spec
            warnings.warn(f"{path}: an embedding table is looked up (and used as a weight-only head), so rule "
                          f"{rule.pattern!r}'s activation spec does not apply to it; its weights are quantized only",
                          UserWarning)
        return quantize_table(w, rule.weight)
    act_scale = static_act_scale(path, stats, rule.act_clip, rule.act) if rule.act_static else None
    return _quantize_jit(jnp.asarray(w), act_scale, spec=rule.weight, act_spec=rule.act)


@functools.partial(jax.jit, static_argnames=("spec", "act_spec"))
def _quantize_jit(w, act_scale, *, spec, act_spec):
    return quantize(w, spec, act_spec=act_spec, act_scale=act_scale)


def quantize_params(params: Any, recipe: Recipe, stats: dict | None = None, progress: bool = False) -> Any:
    """Round-to-nearest (RTN) quantization of a Flax param tree under ``recipe``.

    ``stats`` (from calibration, keyed by kernel path) is needed only for
    rules with static activation scales.
    """
    return map_rules(params, recipe, lambda path, w, rule: quantize_leaf(path, w, rule, stats), progress)


# --------------------------------------------------------------------------- YAML

_RULE_KEYS = {"pattern", "weight", "act", "act_static", "skip", "act_ema", "act_clip"}
_RECIPE_KEYS = {"name", "method", "method_args", "rules", "kv", "rotate", "finetune", "calibration"}
_SPEC_KEYS = {f.name for f in dataclasses.fields(Spec)}


def _spec_from_dict(d: Any, where: str) -> Spec:
    if not isinstance(d, dict):
        raise RecipeError(f"{where}: expected a mapping of {sorted(_SPEC_KEYS)}, got {d!r}")
    unknown = set(d) - _SPEC_KEYS
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_SPEC_KEYS)}")
    # YAML strings like 'no' or 'false' are truthy: demand real booleans.
    _check_bool(d, "symmetric", where)
    try:
        return Spec(**d)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{where}: {e}") from None


def _check_bool(d: dict, key: str, where: str) -> None:
    if key in d and not isinstance(d[key], bool):
        raise RecipeError(f"{where}: {key!r} must be true or false, got {d[key]!r}")


def _rule_to_dict(rule: Rule) -> dict:
    out: dict[str, Any] = {"pattern": rule.pattern}
    if rule.skip:
        out["skip"] = True
    if rule.weight is not None:
        out["weight"] = _spec_to_dict(rule.weight)
    if rule.act is not None:
        out["act"] = _spec_to_dict(rule.act)
    if rule.act_static:
        out["act_static"] = True
    if rule.act_ema is not None:
        out["act_ema"] = rule.act_ema
    if rule.act_clip != 1.0:
        out["act_clip"] = rule.act_clip
    return out


def _spec_to_dict(spec: Spec) -> dict:
    default = Spec()
    d = {f.name: getattr(spec, f.name) for f in dataclasses.fields(Spec)}
    return {k: v for k, v in d.items() if k in ("bits", "granularity") or v != getattr(default, k)}


def recipe_from_dict(data: Any, source: str = "recipe") -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: expected a mapping with keys {sorted(_RECIPE_KEYS)}, got {type(data).__name__}")
    unknown = set(data) - _RECIPE_KEYS
    if unknown:
        raise RecipeError(f"{source}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_RECIPE_KEYS)}")
    rules_data = data.get("rules", [])
    if not isinstance(rules_data, list):
        raise RecipeError(f"{source}: 'rules' must be a list of rules")
    rules = []
    for i, r in enumerate(rules_data):
        where = f"{source}: rules[{i}]"
        if not isinstance(r, dict) or "pattern" not in r:
            raise RecipeError(f"{where}: expected a mapping with a 'pattern', got {r!r}")
        unknown = set(r) - _RULE_KEYS
        if unknown:
            raise RecipeError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_RULE_KEYS)}")
        if not isinstance(r["pattern"], str):
            raise RecipeError(f"{where}: 'pattern' must be a string")
        _check_bool(r, "skip", where)
        _check_bool(r, "act_static", where)
        try:
            rules.append(
                Rule(
                    pattern=r["pattern"],
                    weight=None if r.get("weight") is None else _spec_from_dict(r["weight"], where + ".weight"),
                    act=None if r.get("act") is None else _spec_from_dict(r["act"], where + ".act"),
                    act_static=bool(r.get("act_static", False)),
                    skip=bool(r.get("skip", False)),
                    act_ema=r.get("act_ema"),
                    act_clip=r.get("act_clip", 1.0),
                )
            )
        except RecipeError as e:
            raise RecipeError(f"{where}: {e}") from None
    method = data.get("method", "rtn")
    if not isinstance(method, str):
        raise RecipeError(f"{source}: 'method' must be a string")
    method_args = data.get("method_args") or {}
    if not isinstance(method_args, dict):
        raise RecipeError(f"{source}: 'method_args' must be a mapping")
    kv = data.get("kv")
    if kv is not None and not isinstance(kv, dict):
        raise RecipeError(f"{source}: 'kv' must be a mapping")
    from llmeq_jax.methods.rotate import parse_rotate

    rotate = parse_rotate(data.get("rotate"), source)
    from llmeq_jax.methods.distill import parse_finetune

    finetune = parse_finetune(data.get("finetune"), source)
    from llmeq_jax.methods.sampled_text import parse_calibration

    calibration = parse_calibration(data.get("calibration"), source)
    return Recipe(rules=tuple(rules), method=method, method_args=method_args, name=str(data.get("name", source)), kv=kv,
                  rotate=rotate, finetune=finetune, calibration=calibration)


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a YAML recipe; errors name the file and the offending entry."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe file {str(path)!r} is not valid YAML: {e}") from None
    if isinstance(data, dict) and "name" not in data:
        data = {**data, "name": path.stem}
    return recipe_from_dict(data, source=str(path))
