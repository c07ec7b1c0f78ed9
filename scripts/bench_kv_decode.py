"""Decode tokens/s with a float vs a quantized KV cache, side by side, at one context length.

    PYTHONPATH=$PWD python scripts/bench_kv_decode.py --model smollm2-135m --context 1024 --new-tokens 64

Protocol: the prompt is the first ``--context`` tokens of WikiText-2 test (per row,
``--batch`` rows); greedy decode of ``--new-tokens`` tokens on one prefilled cache
(``generate.decode_timing``: one compiled loop timed for every step and for none, so the prompt's
prefill, which dwarfs the steps at long contexts, is not in the timed calls), median of ``--runs`` warm runs;
tokens/s = batch x (new tokens - 1) / decode time. Static key ranges come from 2
calibration windows (their values do not change the speed). Every quantized cache
keeps 4 float sink tokens. On a GPU each quantized setting runs twice: through the
Pallas decode kernel (the default there) and through XLA (``config.disabled()``),
which dequantizes the whole store every step. On a CPU the store is read by the native kernel
(``native.kv_store_attention``) where it takes the setting, else by XLA; compare with XLA's path by
running an older checkout (docs/cpu-speed.md).
``--recipe`` quantizes the weights first (their share of a step shrinks, the cache's grows).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import jax.numpy as jnp

from llmeq_jax import calibrate, evaluate, pipeline
from llmeq_jax.kv import cache as kvcache
from llmeq_jax.kv import spec as kvspec
from llmeq_jax.data import CALIB_TEXT, EVAL_TEXT, find_data_file
from llmeq_jax.generate import decode_timing
from llmeq_jax.models import load_model
from pallas_kernels import config as kernel_config

SETTINGS = [
    ("float", None),
    ("int8 pre-RoPE", kvspec.KVSpec(8)),
    ("int4 pre-RoPE", kvspec.KVSpec(4)),
    ("int4 pre-RoPE w32", kvspec.KVSpec(4, window=32)),
    ("int4 post-RoPE", kvspec.KVSpec(4, pre_rope=False)),
]


def _paths(spec, head_dim: int, on_gpu: bool) -> list:
    """[(label, context manager factory)] of the paths a quantized cache's store is read by here: the
    Pallas kernel and XLA on a GPU; on a CPU the one path it takes (the native kernel where it reads
    the setting: ``native.disabled()`` would switch the weights' kernels off as well)."""
    if spec is None:
        return [("xla", contextlib.nullcontext)]
    if on_gpu:
        return [("kernel", lambda: kernel_config.interpret(False)), ("xla", kernel_config.disabled)]
    return [("native" if kvcache.native_reads_store(spec, head_dim) else "xla", contextlib.nullcontext)]


def decode_tok_s(config, params, prompt, new_tokens: int, kv, runs: int) -> float:
    seconds = decode_timing(config, params, prompt, new_tokens, runs, kv=kv)[0]
    return prompt.shape[0] * (new_tokens - 1) / seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per row")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--recipe", default="fp32", help="weights: fp32 or a recipe name (e.g. rtn-w4-g128)")
    args = p.parse_args(argv)

    config, params, tokenizer = load_model(args.model)
    if args.recipe != "fp32":
        params = pipeline.run_recipe(config, params, tokenizer, pipeline.read_recipe(args.recipe), None, 16, False)[0]
    ids = evaluate.tokenize_text(tokenizer, find_data_file(None, EVAL_TEXT, "evaluation text").read_text())
    prompt = jnp.asarray(evaluate.make_windows(ids, args.context, args.batch))
    calib_ids = evaluate.tokenize_text(tokenizer, find_data_file(None, CALIB_TEXT, "calibration text").read_text())
    calib = evaluate.make_windows(calib_ids, 512, 2)
    on_gpu = kernel_config.on_gpu()
    print(f"# {args.model} ({args.recipe} weights), context {args.context}, batch {args.batch}, "
          f"{args.new_tokens} new tokens, median of {args.runs}; {evaluate.machine()}", flush=True)
    base = None
    for name, spec in SETTINGS:
        kv = calibrate.make_kv_quantizer(spec, config, params, calib)
        for path, switch in _paths(spec, config.head_dim, on_gpu):
            with switch():
                tok_s = decode_tok_s(config, params, prompt, args.new_tokens, kv, args.runs)
            base = base or tok_s
            label = name if spec is None else f"{name} ({path})"
            print(f"{label:<28} {tok_s:9.1f} tok/s  {tok_s / base:5.2f}x float", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
