"""The calibrated-methods accuracy table: one `llmeq compare` per recipe, then one combined table.

Each recipe runs in its own `llmeq compare` process (so a slow or failing row
does not lose the others, and every row is measured the same way) and its
report lands in ``<out>/<recipe>/report.json``; the combined Markdown table
(perplexity, delta vs fp32, bytes, quantization wall time) is printed and
written to ``<out>/table.md``. ``--calib-sweep`` adds perplexity vs number of
calibration samples for the given recipes. Quantization times are printed
figures, not checks.

    PYTHONPATH=$PWD python scripts/bench_methods.py --model smollm2-135m --windows 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROWS = ("fp32", "rtn-w8", "rtn-w8a8-static", "rtn-w8a8", "smoothquant-w8a8", "smoothquant-w8a8-dynamic",
        "smoothquant-w8a8-mixed",
        "zeroquant-w8a8-g128", "rtn-w4-g128", "gptq-w4-g128", "awq-w4-g128", "gptq-w3-g128",
        "zeroquant-lkd-w8a8-g128")


def run_compare(model, recipe, out: Path, args, calib_samples: int) -> dict | None:
    report = out / "report.json"
    if report.is_file() and not args.rerun:
        return json.loads(report.read_text())
    cmd = [sys.executable, "-m", "llmeq_jax.cli", "compare", model, "--recipes", recipe, "--windows",
           str(args.windows), "--seq-len", str(args.seq_len), "--calib-samples", str(calib_samples),
           "--calib-seq-len", str(args.calib_seq_len), "--no-speed", "--out-dir", str(out), "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if proc.returncode != 0:
        print(f"{recipe}: failed after {time.perf_counter() - t0:.0f} s:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(report.read_text())


def table(rows: list[dict], base: float | None) -> str:
    lines = ["| recipe | calib samples | ppl | Δ% vs fp32 | bytes (MB) | quantize s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        d = "" if base is None else f"{100 * (r['ppl'] / base - 1):+.2f}"
        lines.append(f"| {r['recipe']} | {r.get('calib_samples') or 0} | {r['ppl']:.3f} | {d} | "
                     f"{r['param_bytes'] / 1e6:.2f} | {r.get('quantize_s') or 0:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--recipes", nargs="+", default=list(ROWS))
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--calib-sweep", nargs="*", default=[], help="recipes to rerun with each of --sweep-samples")
    p.add_argument("--sweep-samples", nargs="+", type=int, default=[16, 32, 64, 128])
    p.add_argument("--out", default="runs/bench_methods")
    p.add_argument("--rerun", action="store_true", help="ignore reports already in --out")
    args = p.parse_args(argv)
    out = Path(args.out)
    rows = []
    for recipe in args.recipes:
        rep = run_compare(args.model, recipe, out / recipe, args, args.calib_samples)
        if rep:
            rows += rep["rows"]
            r = rep["rows"][-1]
            print(f"{recipe}: ppl {r['ppl']:.3f}, quantize {r.get('quantize_s') or 0:.1f} s", flush=True)
    base = next((r["ppl"] for r in rows if r["recipe"] == "fp32"), None)
    text = table(rows, base)
    sweep = []
    for recipe in args.calib_sweep:
        for n in args.sweep_samples:
            rep = run_compare(args.model, recipe, out / f"{recipe}-calib{n}", args, n)
            if rep:
                sweep += rep["rows"]
                print(f"{recipe} with {n} samples: ppl {rep['rows'][-1]['ppl']:.3f}", flush=True)
    if sweep:
        text += "\n\nPerplexity vs calibration samples\n\n" + table(sweep, base)
    head = (f"{args.model}, WikiText-2 test, seq {args.seq_len}, {args.windows} windows; calibration "
            f"{args.calib_samples} x {args.calib_seq_len} tokens of WikiText-2 validation\n\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(head + text + "\n")
    print(head + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
