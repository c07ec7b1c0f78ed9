"""What the calibrated methods share: the kernels of one decoder block, the rule each gets, RTN of a block.

Calibrated methods run one decoder block at a time (``calibrate(...,
process_block=...)``); inside a block, kernel paths are relative
(``attn/q_proj/kernel``) while recipe rules match full paths
(``layers_3/attn/q_proj/kernel``). These helpers translate.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from llmeq_jax.core import fp8grid
from llmeq_jax.core.qarray import QArray, is_qarray
from llmeq_jax.core.quantize import Spec, largest_value, quantize_dequantize
from llmeq_jax.core.rules import Recipe, Rule, is_quantizable, path_str, quantize_leaf


def block_kernel_paths(block: dict) -> list[str]:
    """Relative paths of the (float) linear kernels of a block, in tree order."""
    out = []
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(block, is_leaf=is_qarray):
        p = path_str(key_path)
        if not isinstance(leaf, QArray) and is_quantizable(p, leaf):
            out.append(p)
    return out


def quant_rule(recipe: Recipe, layer: int, rel: str) -> Rule | None:
    """The rule that quantizes ``layers_{layer}/{rel}``, or None when it stays float."""
    rule = recipe.rule_for(f"layers_{layer}/{rel}")
    return None if rule is None or rule.skip else rule


def rtn_block(block: dict, layer: int, recipe: Recipe, block_stats: dict | None, done: dict | None = None) -> dict:
    """Quantize every kernel of a block its rule quantizes; ``done`` maps paths already quantized to QArrays."""
    from llmeq_jax.core.rules import get_path, set_path

    done = done or {}
    for rel in block_kernel_paths(block):
        if rel in done:
            block = set_path(block, rel, done[rel])
            continue
        rule = quant_rule(recipe, layer, rel)
        if rule is None:
            continue
        full = f"layers_{layer}/{rel}"
        stats = None if block_stats is None or rel not in block_stats else {full: block_stats[rel]}
        block = set_path(block, rel, quantize_leaf(full, get_path(block, rel), rule, stats))
    return block


def fake_quant_act(x: jax.Array, rule: Rule, static_absmax: jax.Array | None = None) -> jax.Array:
    """What W8A8 does to a linear's input under ``rule`` (identity without an activation spec)."""
    if rule is None or rule.act is None:
        return x
    if rule.act_static:
        scale = jnp.maximum(jnp.max(static_absmax) * rule.act_clip, jnp.finfo(jnp.float32).tiny) / largest_value(rule.act)
        if rule.act.grid == "fp8":
            return fp8grid.to_fp8(x / scale).astype(jnp.float32) * scale
        return jnp.clip(jnp.round(x / scale), -127, 127) * scale
    return quantize_dequantize(x, Spec(8, "token", grid=rule.act.grid))


def option(default, types: tuple, check, hint: str):
    """A field of a method's options dataclass: its default, the accepted types, a value check and the hint
    the error shows (``method_args.<name> must be <hint>``)."""
    return dataclasses.field(default=default, metadata={"types": types, "check": check, "hint": hint})


def options_from_args(cls, method: str, method_args: dict, section: str = "method_args"):
    """A method's frozen options dataclass ``cls`` built from a recipe's ``method_args``.

    The one convention of every calibrated method: its module declares ``<Method>Options`` (fields made
    with :func:`option`) and ``parse_args(method_args) -> <Method>Options``. Unknown keys, wrong types and
    out-of-range values are one clear RecipeError each; missing keys take the field's default.
    """
    from llmeq_jax.core.rules import RecipeError

    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(method_args) - set(fields)
    if unknown:
        raise RecipeError(f"{method}: unknown {section} {sorted(unknown)}; allowed: {sorted(fields)}")
    values = {}
    for name, f in fields.items():
        v = method_args.get(name, f.default)
        types, ok, hint = f.metadata["types"], f.metadata["check"], f.metadata["hint"]
        if isinstance(v, bool) and bool not in types or not isinstance(v, types) or not ok(v):
            raise RecipeError(f"{method}: {section}.{name} must be {hint}, got {v!r}")
        values[name] = v
    return cls(**values)


def parse_section(cls, data: Any, source: str, section: str) -> dict | None:
    """A recipe's optional ``section:`` mapping validated by ``cls`` -> a plain dict with every option
    (None stays None; anything but a mapping is one RecipeError naming the keys)."""
    if data is None:
        return None
    if not isinstance(data, dict):
        from llmeq_jax.core.rules import RecipeError

        keys = sorted(f.name for f in dataclasses.fields(cls))
        raise RecipeError(f"{source}: {section} must be a mapping with keys among {keys}, got {data!r}")
    return dataclasses.asdict(options_from_args(cls, source, data, section=section))
