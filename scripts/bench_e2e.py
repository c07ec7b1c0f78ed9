"""End-to-end speed of quantized models, side by side in one run (the README's speed table).

For each variant — our model under each recipe, and (when torch is installed)
transformers fp32 and torch ``quantize_dynamic`` int8 holding the same weights —
in a subprocess of its own (so its peak RSS is its own), this measures:

* decode tokens/s at batch 1 and 8: greedy, ``--new-tokens`` after a ``--prompt-len``
  prompt; the decode part only: time(generate N) - time(generate 1), warm, median;
* prefill tokens/s: one ``--prefill-len`` sequence through a full forward, warm, median;
* perplexity-run wall seconds: ``--windows`` windows of 512 tokens of the test text,
  tokenizing, compiling and evaluating (what a user waits for), and the perplexity;
* compile seconds: the first decode and prefill calls minus warm ones;
* peak RSS (MiB) of the variant's process (load + quantize + all of the above).

Ratios are against our fp32 row of the same run. Prints a Markdown table and writes JSON.

    PYTHONPATH=. python scripts/bench_e2e.py                       # smollm2-135m, default recipes
    PYTHONPATH=. python scripts/bench_e2e.py --recipes fp32 rtn-w8 --windows 4 --no-torch
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_RECIPES = ("fp32", "rtn-w8", "rtn-w4-g128", "rtn-w8a8")
TORCH_VARIANTS = ("transformers-fp32", "torch-dynamic-int8")
COLUMNS = ("decode_b1", "decode_b8", "prefill")


def median_seconds(fn, repeats: int) -> tuple[float, float]:
    """(first call seconds, median of ``repeats`` warm calls)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------- one variant, in its own process


def measure_ours(args, recipe_name: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from llmeq_jax import decode_layout, evaluate, pipeline
    from llmeq_jax.generate import generate
    from llmeq_jax.models import forward, load_model

    config, params, tokenizer = load_model(args.model)
    t0 = time.perf_counter()
    quantize_s = 0.0
    if recipe_name != "fp32":
        params, quantize_s, _, _ = pipeline.run_recipe(config, params, tokenizer, pipeline.read_recipe(recipe_name),
                                                    args.calib, 16, progress=False)
    jax.block_until_ready(params)
    out = {"quantize_s": quantize_s, "param_mb": pipeline.param_bytes(params) / 1e6}
    rng = np.random.default_rng(0)

    def decode(batch: int) -> tuple[float, float]:
        prompt = jnp.asarray(rng.integers(0, config.vocab_size, (batch, args.prompt_len)), jnp.int32)
        first_one, one = median_seconds(lambda: jax.block_until_ready(generate(config, params, prompt, 1)), args.repeats)
        first_all, full = median_seconds(
            lambda: jax.block_until_ready(generate(config, params, prompt, args.new_tokens)), args.repeats)
        return batch * (args.new_tokens - 1) / max(full - one, 1e-9), first_one + first_all - one - full

    out["decode_b1"], compile_b1 = decode(1)
    out["decode_b8"], _ = decode(8)
    fwd = jax.jit(lambda p, t: forward(config, p, t))
    long = jnp.asarray(rng.integers(0, config.vocab_size, (1, args.prefill_len)), jnp.int32)
    prefill_params = decode_layout.for_prefill(params)  # what llmeq eval / compare run
    first, warm = median_seconds(lambda: jax.block_until_ready(fwd(prefill_params, long)), args.repeats)
    out["prefill"] = args.prefill_len / warm
    out["compile_s"] = compile_b1 + first - warm

    t0 = time.perf_counter()
    ids = evaluate.tokenize_text(tokenizer, Path(args.text).read_text())
    windows = evaluate.make_windows(ids, 512, args.windows)
    res = evaluate.perplexity(None, windows, batch_size=args.batch_size, params=prefill_params,
                              nll_fn=pipeline.sequence_nll(config))
    out["ppl_run_s"] = time.perf_counter() - t0
    out["ppl"] = res["ppl"]
    return out


def measure_torch(args, variant: str) -> dict:
    import numpy as np
    import torch

    from llmeq_jax import evaluate
    from llmeq_jax.models import load_model
    from llmeq_jax.models.to_transformers import transformers_llama

    torch.set_num_threads(os.cpu_count() or 1)
    config, params, tokenizer = load_model(args.model)
    model = transformers_llama(config, params)
    del params
    t0 = time.perf_counter()
    if variant == "torch-dynamic-int8":
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    out = {"quantize_s": time.perf_counter() - t0, "param_mb": None}
    rng = np.random.default_rng(0)

    def gen(prompt, n):
        return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    def decode(batch: int) -> float:
        prompt = torch.from_numpy(rng.integers(0, config.vocab_size, (batch, args.prompt_len)))
        _, one = median_seconds(lambda: gen(prompt, 1), args.repeats)
        _, full = median_seconds(lambda: gen(prompt, args.new_tokens), args.repeats)
        return batch * (args.new_tokens - 1) / max(full - one, 1e-9)

    with torch.inference_mode():
        out["decode_b1"] = decode(1)
        out["decode_b8"] = decode(8)
        long = torch.from_numpy(rng.integers(0, config.vocab_size, (1, args.prefill_len)))
        _, warm = median_seconds(lambda: model(long).logits, args.repeats)
        out["prefill"] = args.prefill_len / warm
        out["compile_s"] = 0.0
        t0 = time.perf_counter()
        ids = evaluate.tokenize_text(tokenizer, Path(args.text).read_text())
        windows = evaluate.make_windows(ids, 512, args.windows)
        total = 0.0
        for start in range(0, len(windows), args.batch_size):
            batch = torch.from_numpy(windows[start : start + args.batch_size].astype(np.int64))
            logits = model(batch).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                    reduction="sum")
            total += float(nll)
        out["ppl_run_s"] = time.perf_counter() - t0
        out["ppl"] = float(np.exp(total / (len(windows) * (windows.shape[1] - 1))))
    return out


def run_one(args) -> None:
    measure = measure_torch if args.one in TORCH_VARIANTS else measure_ours
    result = measure(args, args.one)
    result["peak_rss_mib"] = peak_rss_mib()
    Path(args.result).write_text(json.dumps(result))


# --------------------------------------------------------------------------- the whole run


def child_command(args, variant: str, result: Path) -> list[str]:
    cmd = [sys.executable, __file__, "--one", variant, "--result", str(result), "--model", args.model,
           "--text", args.text, "--windows", str(args.windows), "--batch-size", str(args.batch_size),
           "--repeats", str(args.repeats), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--prefill-len", str(args.prefill_len)]
    return cmd + (["--calib", args.calib] if args.calib else [])


def torch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def machine_line() -> str:
    import jax

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}; "
            f"jax {jax.__version__} ({jax.default_backend()})")


def table(rows: dict[str, dict]) -> str:
    base = rows.get("fp32", {})

    def ratio(row, key):
        return f"{row[key] / base[key]:.2f}x" if base.get(key) and row.get(key) else "–"

    lines = ["| variant | decode b1 tok/s | vs fp32 | decode b8 tok/s | vs fp32 | prefill tok/s | vs fp32 | ppl | "
             "ppl run s | compile s | peak RSS MiB |", "|" + "---|" * 11]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} |" + " |" * 10)
            continue
        lines.append(
            f"| {name} | {r['decode_b1']:.1f} | {ratio(r, 'decode_b1')} | {r['decode_b8']:.1f} | "
            f"{ratio(r, 'decode_b8')} | {r['prefill']:.0f} | {ratio(r, 'prefill')} | {r['ppl']:.3f} | "
            f"{r['ppl_run_s']:.1f} | {r['compile_s']:.1f} | {r['peak_rss_mib']:.0f} |")
    return "\n".join(lines)


def run_all(args) -> None:
    variants = list(args.recipes)
    if "fp32" not in variants:
        variants.insert(0, "fp32")
    if args.torch and torch_available():
        variants += list(TORCH_VARIANTS)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            result = Path(tmp) / f"{v}.json"
            print(f"[bench_e2e] {v} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(child_command(args, v, result), capture_output=True, text=True)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                rows[v] = {"error": last}
                print(f"[bench_e2e] {v} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            rows[v] = json.loads(result.read_text())
    report = {"model": args.model, "machine": machine_line(), "text": args.text, "windows": args.windows,
              "protocol": (f"decode: greedy, {args.new_tokens} new tokens after a {args.prompt_len}-token prompt, "
                           f"time(N) - time(1), median of {args.repeats} warm runs; prefill: {args.prefill_len} tokens, "
                           f"batch 1; ppl run: {args.windows} windows of 512, batch {args.batch_size}, wall incl. "
                           "tokenize + compile"),
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"Model {args.model}; {report['machine']}.\n{report['protocol']}.\n")
    print(table(rows))
    print(f"\nJSON: {out}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES))
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext2_test.txt"))
    ap.add_argument("--calib", default=None, help="calibration text for recipes that need one")
    ap.add_argument("--windows", type=int, default=16, help="perplexity windows of 512 tokens")
    ap.add_argument("--batch-size", type=int, default=4, help="perplexity batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure transformers fp32 and torch quantize_dynamic int8 (needs torch)")
    ap.add_argument("--out", default="runs/bench_e2e.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        run_one(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
