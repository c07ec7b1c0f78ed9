"""KV-cache quantization table: perplexity and cache bytes per token for each KV setting.

    PYTHONPATH=$PWD python scripts/bench_kv.py --model smollm2-135m --seq-len 512 --windows 16

Protocol (DESIGN §6): WikiText-2 test tokenized whole without BOS, non-overlapping
windows of seq_len, first --windows of them, ppl = exp(mean next-token NLL).
Every quantized setting keeps the first 4 tokens of each window in float (attention
sinks, the KVSpec default) unless its name says "no-sinks".
Each quantized setting is evaluated through the prefill path (``forward(..., kv=...)``:
attention reads K/V exactly as the quantized cache would hold them). Static
per-channel key ranges are calibrated on WikiText-2 *validation* windows; online
ones come from the first 64 tokens of each window (its "prompt").
One JSON line per setting goes to --out as soon as it is measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

from llmeq_jax import calibrate, evaluate
from llmeq_jax.kv import grid as kvgrid
from llmeq_jax.kv import memory as kvmemory
from llmeq_jax.kv import spec as kvspec
from llmeq_jax.data import CALIB_TEXT, EVAL_TEXT, find_data_file
from llmeq_jax.models import forward, init_cache, load_model


def settings() -> list[tuple[str, kvspec.KVSpec | None]]:
    out: list[tuple[str, kvspec.KVSpec | None]] = [("float", None)]
    for w in (0, 32):
        out += [
            (f"int8 ch pre-RoPE w{w}", kvspec.KVSpec(8, "channel", True, w)),
            (f"int4 ch pre-RoPE w{w}", kvspec.KVSpec(4, "channel", True, w)),
            (f"int4 ch pre-RoPE 1% out w{w}", kvspec.KVSpec(4, "channel", True, w, 0.01)),
            (f"int4 ch post-RoPE w{w}", kvspec.KVSpec(4, "channel", False, w)),
            (f"int4 tok w{w}", kvspec.KVSpec(4, "token", False, w)),
            (f"int2 ch pre-RoPE w{w}", kvspec.KVSpec(2, "channel", True, w)),
            (f"int2 ch pre-RoPE 1% out w{w}", kvspec.KVSpec(2, "channel", True, w, 0.01)),
            (f"int8 ch online p64 w{w}", kvspec.KVSpec(8, "channel", True, w, key_range="online")),
            (f"int4 ch online p64 w{w}", kvspec.KVSpec(4, "channel", True, w, key_range="online")),
        ]
    # Every row above keeps the default 4 attention-sink tokens in float; these turn them off.
    out += [
        ("int4 ch pre-RoPE w0 no-sinks", kvspec.KVSpec(4, "channel", True, 0, sink_tokens=0)),
        ("int4 ch pre-RoPE 1% out w0 no-sinks", kvspec.KVSpec(4, "channel", True, 0, 0.01, sink_tokens=0)),
        ("int2 ch pre-RoPE 1% out w0 no-sinks", kvspec.KVSpec(2, "channel", True, 0, 0.01, sink_tokens=0)),
    ]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--calib-windows", type=int, default=8)
    p.add_argument("--only", nargs="*", help="substrings of setting names to run (default: all)")
    p.add_argument("--budget-gb", type=float, default=1.0, help="memory budget for the longest-context column")
    p.add_argument("--out", default="runs/bench_kv.jsonl")
    args = p.parse_args(argv)

    config, params, tokenizer = load_model(args.model)
    test_ids = evaluate.tokenize_text(tokenizer, find_data_file(None, EVAL_TEXT, "evaluation text").read_text())
    calib_ids = evaluate.tokenize_text(tokenizer, find_data_file(None, CALIB_TEXT, "calibration text").read_text())
    wins = evaluate.make_windows(test_ids, args.seq_len, args.windows)
    calib = evaluate.make_windows(calib_ids, args.seq_len, args.calib_windows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"# {args.model}, {EVAL_TEXT}, seq_len {args.seq_len}, {len(wins)} windows; calib {len(calib)} x "
          f"{args.seq_len} of {CALIB_TEXT}; {evaluate.machine()}", flush=True)
    keys_by_rope: dict[bool, jax.Array] = {}

    def quantizer(spec):
        """Calibrated KVQuantizer; the calibration keys are collected once per pre/post-RoPE."""
        if spec is None or not spec.needs_key_ranges:
            return calibrate.make_kv_quantizer(spec)
        if spec.pre_rope not in keys_by_rope:
            keys_by_rope[spec.pre_rope] = calibrate.collect_keys(config, params, calib, pre_rope=spec.pre_rope)
        return kvspec.KVQuantizer(
            kvgrid.key_ranges_from_keys(keys_by_rope[spec.pre_rope], spec.outlier_frac, spec.sink_tokens), spec)

    base = None
    for name, spec in settings():
        if args.only and not any(s in name for s in args.only):
            continue
        t0 = time.perf_counter()
        kv = quantizer(spec)
        calib_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = evaluate.perplexity(lambda p, t, kv=kv: forward(config, p, t, kv=kv), wins, batch_size=args.batch_size,
                                 params=params)
        eval_s = time.perf_counter() - t0
        mem = kvmemory.memory(jax.eval_shape(lambda kv=kv: init_cache(config, 1, args.seq_len, kv=kv)))
        if spec is None:
            base = res["ppl"], mem["bytes_per_token"]
        row = {
            "setting": name,
            "spec": None if spec is None else spec.to_dict(),
            "seq_len": args.seq_len,
            "windows": res["windows"],
            "ppl": res["ppl"],
            "delta_pct": None if base is None else 100 * (res["ppl"] / base[0] - 1),
            "bytes_per_token": mem["bytes_per_token"],
            "fixed_bytes": mem["fixed_bytes"],
            "x_smaller": None if base is None else base[1] / mem["bytes_per_token"],
            "longest_context_at_budget": kvmemory.longest_context(
                mem["bytes_per_token"], mem["fixed_bytes"], args.budget_gb * 2**30
            ),
            "calib_s": calib_s,
            "eval_s": eval_s,
        }
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        d = "" if row["delta_pct"] is None else f"{row['delta_pct']:+.2f}%"
        x = "" if row["x_smaller"] is None else f"{row['x_smaller']:.2f}x"
        print(f"{name:<32} ppl {res['ppl']:9.4f} {d:>9}  {mem['bytes_per_token']:8.0f} B/token {x:>7}  "
              f"({eval_s:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
