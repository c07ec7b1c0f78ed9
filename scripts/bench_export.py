"""Export benchmark: file size, max |Δlogit| after reloading, and runtime speed, per format and recipe.

    python scripts/bench_export.py [--model smollm2-135m] [--out runs/export] [--formats gguf compressed-tensors onnx]
                                   [--recipes rtn-w8 ...]

For each recipe: quantize (RTN), save our checkpoint, export it, reload the
export (GGUF: llama.cpp through llama-cpp-python when it is installed, else our
own GGUF loader; compressed-tensors: transformers + compressed-tensors on CPU;
ONNX: onnxruntime CPU with ``session_options()``) and compare logits on one
128-token window of wikitext2_test.txt with our quantized model's. Speed:
prefill tokens/s of the same window, warm, ours (jitted XLA) and the runtime's;
for ONNX and llama.cpp also decode tokens/s (batch 1, 32 greedy steps after the
128-token prefill), ours through ``generate`` (t(33) - t(1)); there the four
timings run in turn for ``--rounds`` rounds and each is the median of its
rounds (elsewhere, median of 3). In
llama.cpp, also perplexity over ``--ppl-windows`` windows of 256 tokens beside
ours (its quantized dot products quantize activations to 8 bits per block of
32, so its logits differ from ours by more than the file's rounding). Prints
markdown tables.

llama-cpp-python is not a dependency (pip builds llama.cpp from source, ~15 min on 2 cores):
``pip install llama-cpp-python``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax import checkpoint, data, pipeline
from llmeq_jax.core.qarray import QArray, is_qarray
from llmeq_jax.core.rules import quantize_params
from llmeq_jax.evaluate import token_nll
from llmeq_jax.export import export_checkpoint
from llmeq_jax.export.onnx import session_options
from llmeq_jax.models import forward, load_model
from llmeq_jax.models.registry import REGISTRY, resolve

CASES = [  # (recipe, format)
    ("fp32", "gguf"),
    ("rtn-w8", "gguf"),
    ("rtn-w8-q8_0", "gguf"),
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
RUNTIMES = {"gguf": "llama.cpp", "onnx": "onnxruntime", "compressed-tensors": "transformers"}


def jit_forward(config):
    """The model's forward, jitted: ``fwd(params, tokens)``."""
    return jax.jit(lambda p, t: forward(config, p, t))


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


def onnx_runner(config, path, ids, steps=DECODE_STEPS):
    """(logits, one prefill's seconds, one decode's seconds per token) of the ONNX graph in onnxruntime (CPU)."""
    import onnxruntime as ort

    from llmeq_jax.export.onnx import empty_past, next_past

    session = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    x = np.asarray([ids], np.int64)

    def run(tokens, past):
        return dict(zip(names, session.run(None, {"input_ids": tokens, **past})))

    first = run(x, empty_past(config, 1))

    def decode():
        out = first
        t0 = time.perf_counter()
        for _ in range(steps):
            token = out["logits"][:, -1].argmax(-1).reshape(1, 1).astype(np.int64)
            out = run(token, next_past(config, out))
        return (time.perf_counter() - t0) / steps

    return first["logits"], lambda: seconds(lambda: run(x, empty_past(config, 1))), decode


def ours_runner(config, params, ids, steps=DECODE_STEPS):
    """(one prefill's seconds: the jitted forward over ``ids``; one decode's seconds per token: our ``generate``
    of steps + 1 tokens minus generate of 1, as scripts/bench_kv_decode.py measures it), both warm."""
    from llmeq_jax.generate import generate

    prompt = jnp.asarray([ids], jnp.int32)
    fwd = jit_forward(config)

    def prefill():
        return seconds(lambda: jax.block_until_ready(fwd(params, prompt)))

    def gen(n):
        return seconds(lambda: jax.block_until_ready(generate(config, params, prompt, n)))

    prefill(), gen(1), gen(steps + 1)  # compile
    return prefill, lambda: max(gen(steps + 1) - gen(1), 1e-9) / steps


def ours_first_token(config, params, ids, prompt_activation_bits=16):
    """Timer of one prompt's seconds to its first new token, warm: our ``generate`` of one token, the
    prefill a request takes (the head on the last position only, integer panels where they exist)."""
    from llmeq_jax.generate import generate

    prompt = jnp.asarray([ids], jnp.int32)

    def first_token():
        return seconds(lambda: jax.block_until_ready(
            generate(config, params, prompt, 1, prompt_activation_bits=prompt_activation_bits)))

    first_token()  # compile
    return first_token


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_medians(timers: dict, rounds: int) -> dict:
    """Median of each timer over ``rounds`` rounds that call every timer once in turn: ours and the runtime's in
    alternation, so that a slow minute of a shared machine lands on both."""
    times = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            times[name].append(timer())
    return {name: float(np.median(t)) for name, t in times.items()}


def has_llama_cpp() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_model(path, n_ctx, logits_all=True):
    """A GGUF file in llama.cpp, float32 KV cache (its float16 default would add its own rounding), every core.
    ``logits_all``: every position's logits (False: the last position's only, as a request computes them)."""
    from llama_cpp import Llama

    return Llama(str(path), n_ctx=n_ctx, logits_all=logits_all, verbose=False, n_threads=len(os.sched_getaffinity(0)),
                 type_k=0, type_v=0)


def llama_cpp_runner(path, ids, steps=DECODE_STEPS):
    """(logits [1, T, V], one prefill's seconds, one decode's seconds per token) of a GGUF file in llama.cpp."""
    llm = llama_cpp_model(path, len(ids) + steps + 1)

    def prefill():
        llm.reset()
        llm.eval(ids)

    prefill()
    logits = np.asarray(llm.scores[: len(ids)], np.float32)[None]

    def decode():
        prefill()
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return (time.perf_counter() - t0) / steps

    return logits, lambda: seconds(prefill), decode


def llama_cpp_first_token(path, ids):
    """Timer of one prompt's seconds to its first new token in llama.cpp, warm: the prompt evaluated without
    ``logits_all`` (the head on the last position only, as llama.cpp serves a request), then that position's
    greedy token."""
    llm = llama_cpp_model(path, len(ids) + 1, logits_all=False)
    vocab = llm.n_vocab()

    def first_token():
        def run():
            llm.reset()
            llm.eval(ids)
            return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))

        return seconds(run)

    first_token()
    return first_token


def mean_nll(logits, ids):
    """Mean next-token NLL of one window's logits [T, V] (ours or llama.cpp's scores) and its ids [T]."""
    return float(jnp.mean(token_nll(jnp.asarray(logits)[None], jnp.asarray(ids)[None])))


def perplexities(config, params, path, windows):
    """(llama.cpp's, ours) perplexity of the GGUF file and our quantized model over the same token windows."""
    llm = llama_cpp_model(path, len(windows[0]))
    fwd = jit_forward(config)
    theirs, ours = [], []
    for w in windows:
        llm.reset()
        llm.eval(list(w))
        theirs.append(mean_nll(llm.scores[: len(w)], w))
        ours.append(mean_nll(fwd(params, jnp.asarray([w], jnp.int32))[0], w))
    return float(np.exp(np.mean(theirs))), float(np.exp(np.mean(ours)))


def runtime_logits(fmt, path, ids):
    """(logits, prefill seconds) of the exported model in its runtime."""
    if fmt == "gguf":
        config, params, _ = load_model(path)
        fwd = jit_forward(config)
        toks = jnp.asarray([ids], jnp.int32)
        return np.asarray(fwd(params, toks)), None  # ours reading GGUF: no separate runtime here
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x).logits.numpy()
        elapsed = median_time(lambda: model(x))
    return logits, elapsed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="runs/export")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--formats", nargs="+", default=["gguf", "compressed-tensors", "onnx"])
    ap.add_argument("--recipes", nargs="+", default=None, help="only these recipes (default: every case)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="ONNX / llama.cpp: rounds of prefill and decode timings, ours and the runtime's in turn")
    ap.add_argument("--ppl-windows", type=int, default=8,
                    help="GGUF in llama.cpp: perplexity over this many 256-token windows, ours beside it (0: none)")
    args = ap.parse_args()
    llama_cpp = has_llama_cpp()
    if "gguf" in args.formats and not llama_cpp:
        print("llama-cpp-python is not installed: GGUF files are read back by our own loader, not run in llama.cpp")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = resolve(args.model) if args.model in REGISTRY else Path(args.model)
    config, params, tokenizer = load_model(source)
    text = data.find_data_file(None, data.EVAL_TEXT, "evaluation text").read_text()
    ids = tokenizer(text[:20000], add_special_tokens=False)["input_ids"][: args.tokens]
    toks = jnp.asarray([ids], jnp.int32)
    rows = []
    decode_rows = []
    ppl_rows = []
    ppl_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ppl_windows = [np.asarray(ppl_ids[i * 256:(i + 1) * 256]) for i in range(args.ppl_windows)]
    quantized = {}
    cases = [c for c in CASES if c[1] in args.formats and (args.recipes is None or c[0] in args.recipes)]
    for recipe_name, fmt in cases:
        recipe = pipeline.read_recipe(recipe_name)
        if recipe_name not in quantized:
            qparams = quantize_params(params, recipe)
            ckpt = checkpoint.save_model_checkpoint(out / f"ckpt-{recipe_name}", config, qparams, tokenizer,
                                                    recipe=recipe, overwrite=True, extra={"source": str(source)})
            fwd = jit_forward(config)
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
        if fmt == "onnx" or (fmt == "gguf" and llama_cpp):
            logits, rt_prefill, rt_decode = (onnx_runner(config, target, ids) if fmt == "onnx"
                                             else llama_cpp_runner(target, ids))
            qparams = checkpoint.load_model_checkpoint(ckpt)[1]
            our_prefill, our_decode = ours_runner(config, qparams, ids)
            med = interleaved_medians({"ours prefill": our_prefill, "prefill": rt_prefill, "ours decode": our_decode,
                                       "decode": rt_decode}, args.rounds)
            ours_s, rt_s = med["ours prefill"], med["prefill"]
            decode_rows.append((fmt, recipe_name, 1 / med["ours decode"], 1 / med["decode"]))
            print(decode_rows[-1], flush=True)
            if fmt == "gguf" and ppl_windows:
                ppl_rows.append((recipe_name, *perplexities(config, qparams, target, ppl_windows)))
                print(ppl_rows[-1], flush=True)
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
        runtime = "n/a (read by our loader)" if rt is None else f"{rt:.0f} ({RUNTIMES[fmt]} CPU)"
        r16 = "—" if rel16 is None else f"{rel16:.1e}"
        print(f"| {fmt} | {name} | {size / 1e6:.1f} | {ck / 1e6:.1f} | {rel:.1e} | {r16} | {ex:.1f} | {ours:.0f} "
              f"| {runtime} |")
    if decode_rows:
        print()
        print("| format | recipe | ours decode tok/s | runtime decode tok/s | runtime / ours |")
        print("|---|---|---:|---:|---:|")
        for fmt, name, ours, rt in decode_rows:
            print(f"| {fmt} | {name} | {ours:.1f} | {rt:.1f} ({RUNTIMES[fmt]}) | {rt / ours:.2f} |")
    if ppl_rows:
        print()
        print(f"| recipe (GGUF) | llama.cpp perplexity | ours | llama.cpp / ours |  ({args.ppl_windows} x 256 tokens)")
        print("|---|---:|---:|---:|")
        for name, theirs, ours in ppl_rows:
            print(f"| {name} | {theirs:.4f} | {ours:.4f} | {theirs / ours:.4f} |")
    for p in out.glob("ckpt-*"):
        shutil.rmtree(p, ignore_errors=True)


if __name__ == "__main__":
    main()
