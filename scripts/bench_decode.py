"""Decode tokens/s of several recipes in one process, interleaved round by round.

On a shared machine a variant measured alone can land in a slow minute; here every
round times each variant once (warm: ``generate`` of N tokens minus ``generate`` of 1,
so prefill and the once-per-call weight transposition cancel out), and the table shows
medians and the median of per-round ratios to fp32.

    PYTHONPATH=. python scripts/bench_decode.py rtn-w8 rtn-w4-g128 rtn-w8a8 [--batch 1] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipes", nargs="+", help="recipe names or paths (fp32 is always measured)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    from llmeq_jax import pipeline
    from llmeq_jax.core.rules import quantize_params
    from llmeq_jax.generate import generate
    from llmeq_jax.models import load_model

    config, params, _ = load_model(args.model)
    variants = {"fp32": params}
    for name in args.recipes:
        variants[name] = quantize_params(params, pipeline.read_recipe(name))
    prompt = jnp.ones((args.batch, args.prompt_len), jnp.int32)

    def seconds(p, n):
        t = time.perf_counter()
        jax.block_until_ready(generate(config, p, prompt, n))
        return time.perf_counter() - t

    for p in variants.values():  # compile both lengths
        seconds(p, 1), seconds(p, args.new_tokens)
    rates = {k: [] for k in variants}
    for _ in range(args.rounds):
        for k, p in variants.items():
            one, many = seconds(p, 1), seconds(p, args.new_tokens)
            rates[k].append(args.batch * (args.new_tokens - 1) / (many - one))
    print(f"| variant | decode tok/s (batch {args.batch}) | vs fp32 | rounds |")
    print("|---|---|---|---|")
    for k, v in rates.items():
        ratio = statistics.median(a / b for a, b in zip(v, rates["fp32"]))
        print(f"| {k} | {statistics.median(v):.1f} | {ratio:.2f}x | {' '.join(f'{a:.1f}' for a in v)} |")


if __name__ == "__main__":
    main()
