"""Compile seconds of a model's prefill forward and decode loop: blocks unrolled vs one scan.

Compilation is measured ahead of time on abstract params (shapes and dtypes only), so a
Llama-2-7B-shaped model needs no weights and no device memory: one block of the real shapes
is built (random, quantized by the recipe when one is given) and its shapes repeated for
every layer. For each (model shape, recipe) the script lowers and compiles, with the blocks
unrolled (``layers_0`` .. ``layers_{L-1}``) and stacked (``models.stacked``, one ``lax.scan``):

* ``prefill``: ``forward`` of ``--prefill-len`` tokens at batch 1, params in the prefill
  layout (``decode_layout.for_prefill``, what ``llmeq eval`` runs);
* ``decode``: ``generate``'s compiled decode loop (``--new-tokens`` steps, batch ``--batch``).

Prints a Markdown table and writes JSON (``--out``).

    PYTHONPATH=. python scripts/bench_compile.py                          # smollm2-135m, llama-2-7b; fp32, rtn-w4-g128
    PYTHONPATH=. python scripts/bench_compile.py --shapes llama-2-7b --recipes bf16 rtn-w8 --layers 8 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from llmeq_jax import decode_layout, generate, methods, pipeline
from llmeq_jax.models import forward, init_cache, shapes, stacked


def model_config(name: str):
    """The ModelConfig of published shapes (``models.shapes.PUBLISHED``)."""
    try:
        return shapes.shape_config(name)
    except ValueError as e:
        raise SystemExit(f"--shapes: {e}") from None


def abstract_params(config, recipe: str, layers: int, dtype=jnp.float32):
    """ShapeDtypeStructs of the model's params under ``recipe`` ('fp32', 'bf16' or a recipe name
    quantizing ``dtype`` weights), with ``layers`` blocks: one real block quantized, its shapes repeated."""
    one = dataclasses.replace(config, num_layers=1)
    float_dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}.get(recipe, dtype)
    params = shapes.random_params(one, float_dtype)
    if recipe not in ("fp32", "bf16"):
        params, _ = methods.quantize_model(one, params, pipeline.read_recipe(recipe), None)
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    block = specs.pop("layers_0")
    return {**specs, **{f"layers_{i}": block for i in range(layers)}}


def compile_seconds(fn, *args, **static) -> float:
    t0 = time.perf_counter()
    jax.jit(fn, static_argnames=tuple(static)).lower(*args, **static).compile()
    return time.perf_counter() - t0


def measure(config, params, layout: str, args) -> dict:
    """Compile seconds of prefill and decode for ``params`` (abstract) in ``layout``."""
    stack = (lambda p: stacked.stack_blocks(config, p)) if layout == "scan" else (lambda p: p)
    prefill_params = jax.eval_shape(lambda p: stack(decode_layout.for_prefill(p)), params)
    decode_params = jax.eval_shape(stack, params)
    tokens = jax.ShapeDtypeStruct((1, args.prefill_len), jnp.int32)
    prefill = compile_seconds(lambda p, t: forward(config, p, t), prefill_params, tokens)

    dtype = jnp.bfloat16 if jax.tree.leaves(params)[0].dtype == jnp.bfloat16 else jnp.float32
    cache = jax.eval_shape(lambda: init_cache(config, args.batch, args.prompt_len + args.new_tokens, dtype))
    logits = jax.ShapeDtypeStruct((args.batch, config.vocab_size), jnp.float32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    loop = generate._decode_loop.__wrapped__  # the jitted loop's function, compiled here with timing
    decode = compile_seconds(
        lambda p, l, c, k, s: loop(config, p, l, c, k, s, max_new_tokens=args.new_tokens, greedy=True,
                                   temperature=1.0, top_k=0, top_p=1.0, kernels=generate.kernel_state()),
        decode_params, logits, cache, key, jax.ShapeDtypeStruct((), jnp.int32))
    return {"prefill_compile_s": prefill, "decode_compile_s": decode}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-2-7b"])
    ap.add_argument("--recipes", nargs="+", default=["fp32", "rtn-w4-g128"])
    ap.add_argument("--layers", nargs="*", type=int, default=[],
                    help="layer counts to compile (default: each model's own)")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the weights' dtype before a recipe quantizes them (activations follow it)")
    ap.add_argument("--out", default="runs/bench_compile.json")
    args = ap.parse_args(argv)

    rows = []
    for shape in args.shapes:
        config = model_config(shape)
        for recipe in args.recipes:
            for layers in args.layers or [config.num_layers]:
                cfg = dataclasses.replace(config, num_layers=layers)
                params = abstract_params(cfg, recipe, layers, jnp.dtype(args.dtype))
                for layout in ("unrolled", "scan"):
                    r = {"shape": shape, "recipe": recipe, "layers": layers, "layout": layout,
                         **measure(cfg, params, layout, args)}
                    rows.append(r)
                    print(f"{shape} {recipe} L={layers} {layout}: prefill {r['prefill_compile_s']:.1f} s, "
                          f"decode {r['decode_compile_s']:.1f} s", flush=True)

    device = jax.devices()[0]
    print(f"\n{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, {platform.node()}; "
          f"prefill {args.prefill_len} tokens at batch 1, decode loop {args.new_tokens} steps at batch {args.batch}\n")
    print("| model shapes | recipe | layers | prefill unrolled s | prefill scan s | decode unrolled s | decode scan s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    by_key = {(r["shape"], r["recipe"], r["layers"], r["layout"]): r for r in rows}
    for (shape, recipe, layers, layout), r in by_key.items():
        if layout != "unrolled":
            continue
        s = by_key[(shape, recipe, layers, "scan")]
        print(f"| {shape} | {recipe} | {layers} | {r['prefill_compile_s']:.1f} | {s['prefill_compile_s']:.1f} "
              f"| {r['decode_compile_s']:.1f} | {s['decode_compile_s']:.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": device.device_kind, "jax": jax.__version__,
                                          "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
