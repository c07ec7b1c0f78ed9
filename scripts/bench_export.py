"""Export benchmark: file size, max |Δlogit| after reloading, and runtime speed, per format and recipe.

    python scripts/bench_export.py [--model smollm2-135m] [--out runs/export] [--formats gguf compressed-tensors onnx]
                                   [--recipes rtn-w8 ...]

For each recipe: quantize (RTN), save our checkpoint, export it, reload the
export (GGUF: our own GGUF loader; compressed-tensors: transformers +
compressed-tensors on CPU; ONNX: onnxruntime CPU with ``session_options()``)
and compare logits on one 128-token window of wikitext2_test.txt with our
quantized model's. Speed: prefill tokens/s of the same window, warm, median of
3, ours (jitted XLA) and the runtime's; for ONNX also decode tokens/s (batch 1,
32 steps after the 128-token prefill, each step feeding the present caches
back), ours through ``generate.decode_step``. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax import checkpoint, data, pipeline
from llmeq_jax.core.qarray import QArray, is_qarray
from llmeq_jax.core.rules import quantize_params
from llmeq_jax.export import export_checkpoint
from llmeq_jax.export.onnx import session_options
from llmeq_jax.models import forward, load_model
from llmeq_jax.models.registry import REGISTRY, resolve

CASES = [  # (recipe, format)
    ("rtn-w8", "gguf"),
    ("rtn-w4-g32-q4_0", "gguf"),
    ("rtn-w4-g32-asym-q4_1", "gguf"),
    ("rtn-w8", "compressed-tensors"),
    ("rtn-w4-g32-q4_0", "compressed-tensors"),
    ("rtn-w8a8", "compressed-tensors"),
    ("fp32", "onnx"),
    ("rtn-w8", "onnx"),
    ("rtn-w4-g32-q4_0", "onnx"),
    ("rtn-w4-g32-asym-q4_1", "onnx"),
    ("rtn-w4-g128", "onnx"),
    ("rtn-w8a8", "onnx"),
]
DECODE_STEPS = 32


def median_time(fn, runs=3):
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def fp16_scales(params):
    """The same integers on float16-rounded scales: the grid a GGUF file can hold exactly."""
    def fix(leaf):
        if isinstance(leaf, QArray):
            return dataclasses.replace(leaf, scale=leaf.scale.astype(jnp.float16).astype(jnp.float32))
        return leaf

    return jax.tree_util.tree_map(fix, params, is_leaf=is_qarray)


def onnx_logits(config, path, ids, steps=DECODE_STEPS):
    """(logits, prefill seconds, decode seconds per token) of the ONNX graph in onnxruntime (CPU)."""
    import onnxruntime as ort

    from llmeq_jax.export.onnx import empty_past, next_past

    session = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    x = np.asarray([ids], np.int64)

    def run(tokens, past):
        return dict(zip(names, session.run(None, {"input_ids": tokens, **past})))

    first = run(x, empty_past(config, 1))
    prefill_s = median_time(lambda: run(x, empty_past(config, 1)))

    def decode():
        out = first
        for _ in range(steps):
            token = out["logits"][:, -1].argmax(-1).reshape(1, 1).astype(np.int64)
            out = run(token, next_past(config, out))

    return first["logits"], prefill_s, median_time(decode) / steps


def ours_decode_s(config, params, ids, steps=DECODE_STEPS):
    """Seconds per decode token of our jitted decode_step (batch 1, greedy, after prefilling ``ids``)."""
    from llmeq_jax import generate

    toks = jnp.asarray([ids], jnp.int32)
    mask = jnp.ones_like(toks)

    def decode():
        cache = generate.init_cache(config, 1, len(ids) + steps + 1)
        logits, cache = generate.prefill(config, params, toks, mask, cache)
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, cache = generate.decode_step(config, params, jnp.argmax(logits, -1).astype(jnp.int32), cache)
        jax.block_until_ready(logits)
        return time.perf_counter() - t0

    decode()
    return float(np.median([decode() for _ in range(3)])) / steps


def runtime_logits(fmt, path, ids):
    """(logits, prefill seconds) of the exported model in its runtime."""
    if fmt == "gguf":
        config, params, _ = load_model(path)
        fwd = jax.jit(lambda p, t: forward(config, p, t))
        toks = jnp.asarray([ids], jnp.int32)
        return np.asarray(fwd(params, toks)), None  # ours reading GGUF: no separate runtime here
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x).logits.numpy()
        seconds = median_time(lambda: model(x))
    return logits, seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="runs/export")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--formats", nargs="+", default=["gguf", "compressed-tensors", "onnx"])
    ap.add_argument("--recipes", nargs="+", default=None, help="only these recipes (default: every case)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = resolve(args.model) if args.model in REGISTRY else Path(args.model)
    config, params, tokenizer = load_model(source)
    text = data.find_data_file(None, data.EVAL_TEXT, "evaluation text").read_text()
    ids = tokenizer(text[:20000], add_special_tokens=False)["input_ids"][: args.tokens]
    toks = jnp.asarray([ids], jnp.int32)
    rows = []
    decode_rows = []
    quantized = {}
    cases = [c for c in CASES if c[1] in args.formats and (args.recipes is None or c[0] in args.recipes)]
    for recipe_name, fmt in cases:
        recipe = pipeline.read_recipe(recipe_name)
        if recipe_name not in quantized:
            qparams = quantize_params(params, recipe)
            ckpt = checkpoint.save_model_checkpoint(out / f"ckpt-{recipe_name}", config, qparams, tokenizer,
                                                    recipe=recipe, overwrite=True, extra={"source": str(source)})
            fwd = jax.jit(lambda p, t: forward(config, p, t))
            ref = np.asarray(fwd(qparams, toks))
            ours_s = median_time(lambda: jax.block_until_ready(fwd(qparams, toks)))
            ref16 = np.asarray(fwd(fp16_scales(qparams), toks))
            quantized[recipe_name] = (ckpt, ref, ref16, ours_s)
        ckpt, ref, ref16, ours_s = quantized[recipe_name]
        target = out / {"gguf": f"{recipe_name}.gguf", "onnx": f"{recipe_name}.onnx"}.get(fmt, f"{recipe_name}-ct")
        t0 = time.perf_counter()
        export_checkpoint(ckpt, fmt, target, source=source, overwrite=True)
        export_s = time.perf_counter() - t0
        size = checkpoint.disk_bytes(target) if target.is_dir() else target.stat().st_size
        if fmt == "onnx":
            logits, rt_s, rt_decode_s = onnx_logits(config, target, ids)
            qparams = checkpoint.load_model_checkpoint(ckpt)[1]
            decode_rows.append((recipe_name, 1 / ours_decode_s(config, qparams, ids), 1 / rt_decode_s))
            print(decode_rows[-1], flush=True)
        else:
            logits, rt_s = runtime_logits(fmt, target, ids)
        rel = float(np.max(np.abs(logits - ref)) / np.max(np.abs(ref)))
        rel16 = float(np.max(np.abs(logits - ref16)) / np.max(np.abs(ref))) if fmt == "gguf" else None
        rows.append((fmt, recipe_name, size, checkpoint.disk_bytes(ckpt), rel, rel16, export_s, len(ids) / ours_s,
                     None if rt_s is None else len(ids) / rt_s))
        print(rows[-1], flush=True)
    print()
    print("| format | recipe | file MB | our checkpoint MB | max abs Δlogit / max abs logit "
          "| same, vs ours on float16 scales | export s | ours prefill tok/s | runtime prefill tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for fmt, name, size, ck, rel, rel16, ex, ours, rt in rows:
        runtime = "n/a (read by our loader)" if rt is None else \
            f"{rt:.0f} ({'onnxruntime' if fmt == 'onnx' else 'transformers'} CPU)"
        r16 = "—" if rel16 is None else f"{rel16:.1e}"
        print(f"| {fmt} | {name} | {size / 1e6:.1f} | {ck / 1e6:.1f} | {rel:.1e} | {r16} | {ex:.1f} | {ours:.0f} "
              f"| {runtime} |")
    if decode_rows:
        print()
        print("| recipe | ours decode tok/s | onnxruntime decode tok/s | onnxruntime / ours |")
        print("|---|---:|---:|---:|")
        for name, ours, rt in decode_rows:
            print(f"| {name} | {ours:.1f} | {rt:.1f} | {rt / ours:.2f} |")
    for p in out.glob("ckpt-*"):
        shutil.rmtree(p, ignore_errors=True)


if __name__ == "__main__":
    main()
