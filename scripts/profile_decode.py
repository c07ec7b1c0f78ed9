"""Where a decode step spends its time: the XLA ops of greedy decoding, ranked by wall time.

Runs ``generate`` once to compile, then once under ``jax.profiler.trace`` and sums the
durations of each op in the Perfetto trace (the ops of the decode loop's body run once
per token). Prints the top ``--top`` ops with their share of the total and calls per token.

    PYTHONPATH=. python scripts/profile_decode.py --recipe rtn-w8 --new-tokens 32
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# Trace events that are containers (the executor, Python frames), not ops.
_CONTAINERS = ("ThunkExecutor", "$", "while", "PjitFunction", "Execute")


def op_kind(name: str) -> str:
    """``dot.4942`` -> ``dot``: ops of one kind summed (XLA numbers every instance)."""
    return re.sub(r"\.\d+$", "", name)


def op_times(trace_dir: Path, module: str = "jit__decode_loop") -> collections.Counter:
    """Total microseconds per op kind in the Perfetto trace under ``trace_dir``, counting only
    ops of the XLA module whose name starts with ``module`` (the decode loop: prefill and the
    other one-off programs of a generate call would otherwise be spread over the steps)."""
    path = sorted(trace_dir.rglob("*.json.gz"))[-1]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    totals: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e["name"].startswith(_CONTAINERS):
            continue
        if not (e.get("args") or {}).get("hlo_module", "").startswith(module):
            continue
        totals[op_kind(e["name"])] += e.get("dur", 0)
    return totals


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default="fp32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)

    from llmeq_jax import pipeline
    from llmeq_jax.generate import generate
    from llmeq_jax.models import load_model

    config, params, tokenizer = load_model(args.model)
    if args.recipe != "fp32":
        params = pipeline.run_recipe(config, params, tokenizer, pipeline.read_recipe(args.recipe), None, 16, False)[0]
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.prompt_len)),
                         jnp.int32)
    jax.block_until_ready(generate(config, params, prompt, args.new_tokens))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(generate(config, params, prompt, args.new_tokens))
        totals = op_times(Path(tmp))
    steps = args.new_tokens - 1
    total = sum(totals.values())
    print(f"\n{args.recipe}: {total / 1e3 / steps:.2f} ms of ops per decode step ({steps} steps; the decode loop's "
          f"module only, incl. its one-off weight transposition)")
    for name, us in totals.most_common(args.top):
        print(f"{us / 1e3 / steps:8.3f} ms/token {100 * us / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
