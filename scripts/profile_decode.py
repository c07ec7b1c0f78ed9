"""Where a decode step spends its time: the XLA ops of greedy decoding, ranked by wall time.

Runs ``generate`` once to compile, then once under ``jax.profiler.trace`` and sums the
durations of each op in the Perfetto trace (the ops of the decode loop's body run once
per token). Prints the top ``--top`` ops with their share of the total and calls per token.

    PYTHONPATH=. python scripts/profile_decode.py --recipe rtn-w8 --new-tokens 32

On a GPU the trace also holds the device's kernels: :func:`device_kernel_times` reads them
(``scripts/bench_e2e.py --profile`` lists them per variant).
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
    totals: collections.Counter = collections.Counter()
    for e in trace_events(trace_dir):
        if e.get("ph") != "X" or e["name"].startswith(_CONTAINERS):
            continue
        if not (e.get("args") or {}).get("hlo_module", "").startswith(module):
            continue
        totals[op_kind(e["name"])] += e.get("dur", 0)
    return totals


def trace_events(trace_dir: Path) -> list[dict]:
    """The events of the (last) Perfetto trace ``jax.profiler.trace(..., create_perfetto_trace=True)`` wrote."""
    path = sorted(Path(trace_dir).rglob("*.json.gz"))[-1]
    events = json.load(gzip.open(path))
    return events["traceEvents"] if isinstance(events, dict) else events


def device_kernel_times(events: list[dict], module: str = "jit__decode_loop") -> dict[str, tuple[float, int]]:
    """{kernel name: (total microseconds, launches)} of what ran on a GPU during a trace: the complete
    events of the trace's ``/device:`` processes on their ``Stream`` threads (the derived ``XLA Ops`` /
    ``XLA Modules`` lines of the same process repeat those times per HLO op and are left out), counting
    only kernels of the XLA module whose name starts with ``module`` where an event names its module.
    Empty on a CPU, whose trace has host threads only (:func:`op_times` reads those)."""
    devices, streams, named_threads = set(), set(), set()
    for e in events:
        if e.get("ph") != "M":
            continue
        name = (e.get("args") or {}).get("name", "")
        if e.get("name") == "process_name" and name.startswith("/device:"):
            devices.add(e["pid"])
        elif e.get("name") == "thread_name":
            named_threads.add((e["pid"], e.get("tid")))
            if name.startswith("Stream"):
                streams.add((e["pid"], e.get("tid")))
    totals: dict[str, list] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in devices:
            continue
        thread = (e["pid"], e.get("tid"))
        if thread in named_threads and thread not in streams:
            continue
        hlo_module = (e.get("args") or {}).get("hlo_module")
        if hlo_module is not None and not hlo_module.startswith(module):
            continue
        entry = totals.setdefault(e["name"], [0.0, 0])
        entry[0] += e.get("dur", 0.0)
        entry[1] += 1
    return {name: (us, n) for name, (us, n) in totals.items()}


def kernel_table(times: dict[str, tuple[float, int]], steps: int, top: int = 40) -> list[list]:
    """[[kernel, µs per step, launches per step, share of the kernels' time], ...] of
    :func:`device_kernel_times` over ``steps`` decode steps, the longest first (``top`` of them)."""
    total = sum(us for us, _ in times.values()) or 1.0
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])[:top]
    return [[name, us / steps, n / steps, us / total] for name, (us, n) in ranked]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default="fp32")
    ap.add_argument("--keep-quantized", action="store_true", help="a GGUF --model's quantized blocks kept as stored")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)

    from llmeq_jax import pipeline
    from llmeq_jax.generate import generate
    from llmeq_jax.models import load_model

    config, params, tokenizer = load_model(args.model, keep_quantized=args.keep_quantized)
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
