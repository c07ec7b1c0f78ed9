"""End-to-end speed of quantized models, side by side in one run (the README's speed table).

For each variant — our model under each recipe, and (when torch is installed) transformers
holding the same weights — in a subprocess of its own (so its peak memory is its own), this
measures:

* decode tokens/s at each ``--batches`` size: greedy, ``--new-tokens`` after a
  ``--prompt-len`` prompt; the decode part only: time(N - 1 steps) - time(no step) of one compiled
  decode loop (``generate.decode_timing``, what time(generate N) - time(generate 1) measures), warm,
  median;
* prefill tokens/s: one ``--prefill-len`` sequence through a full forward, warm, median;
* perplexity-run wall seconds: ``--windows`` windows of 512 tokens of the test text,
  tokenizing, compiling and evaluating (what a user waits for), and the perplexity;
* compile seconds: the first call of the decode loop (at the first batch size) and of the
  ``--prefill-len`` forward, minus warm ones;
* peak RSS (MiB) of the variant's process, and on a GPU its peak device memory;
* its logits (``logits``): one prompt's last position (the prompt's kernels) and two teacher-forced decode steps
  after it (the decode step's), the same tokens for every variant, against the same model with no kernel (XLA
  alone: ``vs_xla``, the kernels' own error) and against the baseline's (``vs_base``, what quantizing cost on
  these weights) -- the largest relative error of the three positions and how many agree on the top token. A fast
  kernel with wrong sums shows here, where tokens/s alone would count it a win.

Two modes:

* a real model (``--model``, default smollm2-135m) on this machine: variants ``fp32``, each
  recipe, transformers fp32 and torch ``quantize_dynamic`` int8;
* random weights of published shapes (``--shapes llama-2-7b``, ``models.shapes``; nothing
  to download), e.g. on a GPU: ``--dtype bfloat16`` makes ``bf16`` the baseline, recipes
  quantize the bf16 weights (round-to-nearest recipes only: there is no text to calibrate
  on), no perplexity; with torch on CUDA, transformers bf16 with a static KV cache
  (random weights of the same shapes) runs beside.

``--scan-layers`` adds each of our variants with its blocks stacked under one ``lax.scan``
(``models.stacked``; rows ``<variant>+scan``). Ratios are against the baseline row (``fp32``
or ``bf16``) of the same run. Prints a Markdown table and writes JSON.

    PYTHONPATH=. python scripts/bench_e2e.py                       # smollm2-135m, default recipes
    PYTHONPATH=. python scripts/bench_e2e.py --recipes fp32 rtn-w8 --windows 4 --no-torch
    PYTHONPATH=. python scripts/bench_e2e.py --recipes rtn-w8 --scan-layers --no-torch   # + stacked blocks
    PYTHONPATH=. python scripts/bench_e2e.py --shapes llama-2-7b --dtype bfloat16 --recipes rtn-w8 rtn-w4-g128 \\
        --batches 1 16 --prefill-len 2048 --scan-layers                                # a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_RECIPES = ("fp32", "rtn-w8", "rtn-w4-g128", "rtn-w8a8")
FLOAT_VARIANTS = {"fp32": "float32", "bf16": "bfloat16"}
TORCH_CPU_VARIANTS = ("transformers-fp32", "torch-dynamic-int8")
TORCH_GPU_VARIANTS = ("transformers-bf16-static",)
TORCH_VARIANTS = TORCH_CPU_VARIANTS + TORCH_GPU_VARIANTS
SCAN_SUFFIX = "+scan"  # a variant name ending in it: the blocks stacked under one lax.scan (models/stacked.py)


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


def baseline(args) -> str:
    """The float variant the ratios divide by: ``fp32`` or ``bf16`` (``--dtype``)."""
    return "bf16" if args.dtype == "bfloat16" else "fp32"


# --------------------------------------------------------------------------- one variant, in its own process


def our_model(args, recipe_name: str):
    """(config, params, tokenizer or None, quantize seconds) of our model under ``recipe_name``."""
    import jax
    import jax.numpy as jnp

    from llmeq_jax import methods, pipeline
    from llmeq_jax.models import load_model, shapes

    dtype = jnp.dtype(FLOAT_VARIANTS.get(recipe_name, args.dtype))
    if args.shapes:
        config = shapes.shape_config(args.shapes, args.layers)
        params, tokenizer = shapes.random_params(config, dtype), None
    else:
        config, params, tokenizer = load_model(args.model, dtype)
    if recipe_name in FLOAT_VARIANTS:
        return config, params, tokenizer, 0.0
    recipe = pipeline.read_recipe(recipe_name)
    if tokenizer is None and methods.needs_calibration(recipe):
        raise SystemExit(f"{recipe_name}: needs calibration text, which random-weight shapes have none of; "
                         "use round-to-nearest recipes with --shapes")
    t0 = time.perf_counter()
    params = pipeline.run_recipe(config, params, tokenizer, recipe, args.calib, 16, progress=False).params
    jax.block_until_ready(params)
    return config, params, tokenizer, time.perf_counter() - t0


def device_peak_mib() -> float | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 2**20 if "peak_bytes_in_use" in stats else None


def profile_decode_kernels(args, config, params, rng, tokens_per_s: float) -> dict:
    """One warm ``generate`` at the first batch size under ``jax.profiler.trace``: each GPU kernel of the
    decode loop with its device µs and launches per step (``profile_decode.device_kernel_times``), their
    sum against the step's wall time (the rest is launch gaps and host work). Under a profiler XLA may
    launch kernels one by one instead of as command buffers: the per-kernel times are the point, not the
    sum. No kernels on a CPU (its trace has host threads only: ``scripts/profile_decode.py``)."""
    import jax
    import jax.numpy as jnp

    from llmeq_jax.generate import generate
    from profile_decode import device_kernel_times, kernel_table, trace_events

    batch = args.batches[0]
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, (batch, args.prompt_len)), jnp.int32)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(generate(config, params, prompt, args.new_tokens))
        times = device_kernel_times(trace_events(Path(tmp)))
    steps = args.new_tokens - 1
    return {"batch": batch, "steps": steps, "layers": config.num_layers, "wall_us_per_step": 1e6 * batch / tokens_per_s,
            "kernel_us_per_step": sum(us for us, _ in times.values()) / steps,
            "launches_per_step": sum(n for _, n in times.values()) / steps,
            "kernels": kernel_table(times, steps, args.profile_top)}


def profile_table(name: str, profile: dict) -> str:
    """A variant's decode-step profile (:func:`profile_decode_kernels`) as Markdown: each kernel's µs and
    launches per step (per layer too, where it runs once a layer)."""
    if "error" in profile:
        return f"{name}: no profile ({profile['error']})"
    head = (f"{name}, batch {profile['batch']}: {profile['kernel_us_per_step']:.0f} µs of kernels in "
            f"{profile['launches_per_step']:.0f} launches per decode step; wall {profile['wall_us_per_step']:.0f} µs "
            "a step unprofiled")
    if not profile["kernels"]:
        return head + " (no GPU kernels in the trace)"
    lines = [head, "", "| kernel | µs / step | launches / step | µs / launch | share |", "|---|---:|---:|---:|---:|"]
    for kernel, us, launches, share in profile["kernels"]:
        lines.append(f"| {kernel} | {us:.1f} | {launches:g} | {us / max(launches, 1e-9):.2f} | {100 * share:.1f}% |")
    lines.append(f"\n({profile['layers']} layers: a kernel with {profile['layers']} launches a step runs once a layer)")
    return "\n".join(lines)


# A child's progress lines start with this; the parent echoes them as they come (run_all), so a run stopped by
# its time limit still shows which phase of which variant the time went to.
PROGRESS = "[bench_e2e]   "


def phase_clock(variant: str):
    """``done(what)``: print a progress line -- ``what`` and the seconds since the previous one -- to stderr."""
    last = [time.perf_counter()]

    def done(what: str) -> None:
        now = time.perf_counter()
        print(f"{PROGRESS}{variant}: {what} ({now - last[0]:.1f} s)", file=sys.stderr, flush=True)
        last[0] = now

    return done


def measure_ours(args, variant: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from llmeq_jax import evaluate, pipeline
    from llmeq_jax.generate import decode_timing
    from llmeq_jax.models import forward, stacked
    from llmeq_jax.subchannel import prompt_jit

    recipe_name, scan = variant.removesuffix(SCAN_SUFFIX), variant.endswith(SCAN_SUFFIX)
    done = phase_clock(variant)
    config, params, tokenizer, quantize_s = our_model(args, recipe_name)
    done(f"weights ready (quantizing took {quantize_s:.1f} s)")
    out = {"quantize_s": quantize_s, "param_mb": pipeline.param_bytes(params) / 1e6}
    prefill_params = pipeline.run_layout(config, params, scan)  # what llmeq eval / compare run
    if scan:
        params = stacked.stack_blocks(config, params)
    jax.block_until_ready((prefill_params, params))
    done("prefill layout and stacked blocks")
    rng = np.random.default_rng(0)

    def decode(batch: int, kv=None) -> tuple[float, float]:
        """(tokens/s of the decode steps, seconds compiling the decode loop): one compiled loop timed at
        new_tokens - 1 steps and at none (generate.decode_timing: what generate(N) - generate(1) measures,
        without compiling the loop and the prompt's prefill twice); a float cache, or quantized by ``kv``."""
        prompt = jnp.asarray(rng.integers(0, config.vocab_size, (batch, args.prompt_len)), jnp.int32)
        seconds, first = decode_timing(config, params, prompt, args.new_tokens, args.repeats, kv=kv)
        return batch * (args.new_tokens - 1) / seconds, max(first - seconds, 0.0)

    compile_s = 0.0
    for i, batch in enumerate(args.batches):
        out[f"decode_b{batch}"], compiled = decode(batch)
        compile_s += compiled if i == 0 else 0.0
        done(f"decode at batch {batch}: {out[f'decode_b{batch}']:.1f} tok/s")
    if args.kv_bits:  # the same decode over a quantized KV cache (online key ranges from the prompt, 4 float sinks)
        out["decode_kv"] = decode(args.batches[0], kv_quantizer(args.kv_bits, args.prompt_len))[0]
        done(f"decode at batch {args.batches[0]} with an int{args.kv_bits} KV cache: {out['decode_kv']:.1f} tok/s")
    if args.profile:  # after the measurements: a profiler that fails (no CUPTI) costs the profile, not the row
        try:
            out["profile"] = profile_decode_kernels(args, config, params, rng, out[f"decode_b{args.batches[0]}"])
        except Exception as e:  # noqa: BLE001 -- whatever the profiler raised, the row's figures stand
            out["profile"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        done("decode profiled")
    fwd = prompt_jit(lambda p, t: forward(config, p, t))  # XLA's sub-channel fusion on where it may run
    long = jnp.asarray(rng.integers(0, config.vocab_size, (1, args.prefill_len)), jnp.int32)
    first, warm = median_seconds(lambda: jax.block_until_ready(fwd(prefill_params, long)), args.repeats)
    out["prefill"] = args.prefill_len / warm
    out["compile_s"] = compile_s + first - warm
    done(f"prefill of {args.prefill_len}: {out['prefill']:.0f} tok/s")

    if args.windows and tokenizer is not None:
        t0 = time.perf_counter()
        ids = evaluate.tokenize_text(tokenizer, Path(args.text).read_text())
        windows = evaluate.make_windows(ids, 512, args.windows)
        res = evaluate.perplexity(None, windows, batch_size=args.batch_size, params=prefill_params,
                                  nll_fn=pipeline.sequence_nll(config))
        out["ppl_run_s"] = time.perf_counter() - t0
        out["ppl"] = res["ppl"]
    out["device_peak_mib"] = device_peak_mib()
    if args.result:  # after the measurements: the logits the parent compares, with kernels and with XLA alone
        np.savez(logits_path(Path(args.result)), kernels=logits_probe(config, params, args.prompt_len),
                 xla=logits_probe(config, params, args.prompt_len, kernels=False))
        done("logits probed, with the kernels and with XLA alone")
    return out


LOGITS_STEPS = 2  # teacher-forced decode steps whose logits are compared (with XLA alone's, with the baseline's)


def logits_probe(config, params, prompt_len: int, kernels: bool = True):
    """Row 0's float32 logits ``[1 + LOGITS_STEPS, vocab]``: a random prompt's last position (generate's prefill)
    and LOGITS_STEPS decode steps fed fixed tokens (generate's decode step, its layout and kernels) -- the same
    tokens for every variant of a run (their own seed). ``kernels=False``: no Pallas or native kernel, XLA alone."""
    import contextlib

    import jax.numpy as jnp
    import numpy as np

    from llmeq_jax import generate as gen, native
    from llmeq_jax.models import init_cache
    from pallas_kernels import config as kernel_config

    tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (1, prompt_len + LOGITS_STEPS)),
                         jnp.int32)
    with contextlib.ExitStack() as off:
        if not kernels:
            off.enter_context(native.disabled())
            off.enter_context(kernel_config.disabled())
        state = gen.kernel_state()
        cache = init_cache(config, 1, prompt_len + LOGITS_STEPS, gen.cache_dtype_for(params))
        logits, cache = gen.prefill(config, params, tokens[:, :prompt_len], jnp.ones((1, prompt_len), jnp.int32),
                                    cache, kernels=state)
        out, laid = [logits[0]], gen.decode_params(params, 1)
        for i in range(prompt_len, prompt_len + LOGITS_STEPS):
            logits, cache = gen.decode_step(config, laid, tokens[:, i], cache, kernels=state)
            out.append(logits[0])
        return np.asarray(jnp.stack(out).astype(jnp.float32))


def logits_agreement(got, want) -> dict:
    """How far one :func:`logits_probe` is from another (XLA alone's on the same weights, or the baseline's): the
    largest relative L2 error over its positions, and at how many of them the top token agrees (NaN logits: an
    infinite error)."""
    import numpy as np

    errors = [float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30)) if np.all(np.isfinite(g))
              else float("inf") for g, w in zip(got, want)]
    agree = int(sum(int(np.argmax(g) == np.argmax(w)) for g, w in zip(got, want)))
    return {"rel_err": max(errors), "top1": agree, "positions": len(errors)}


def logits_path(result: Path) -> Path:
    return result.with_suffix(".logits.npz")


def kv_quantizer(bits: int, prompt_len: int):
    """A quantized KV cache's setting for random weights (no calibration text): int``bits`` codes, keys per channel
    before RoPE on ranges taken online from the prompt, the default 4 float sinks."""
    from llmeq_jax.kv import spec as kvspec

    return kvspec.KVQuantizer(None, kvspec.KVSpec(bits=bits, key_range="online", prompt_tokens=prompt_len))


def torch_model(args, variant: str):
    """(config, transformers model, tokenizer or None) for a torch variant."""
    import torch
    import transformers

    from llmeq_jax.models import load_model, shapes
    from llmeq_jax.models.to_transformers import hf_llama_config, transformers_llama

    if variant == "transformers-bf16-static":  # random weights of the shapes, built on the GPU in bf16
        config = shapes.shape_config(args.shapes, args.layers) if args.shapes else load_model(args.model)[0]
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(hf_llama_config(config)).to(torch.bfloat16).eval()
        # generate compiles the forward by itself for a static cache on CUDA (transformers >= 4.45: its
        # auto-compile, torch.compile of the decode step; generation_config.disable_compile would turn it off):
        # this row is transformers' fast path, not eager PyTorch
        model.generation_config.cache_implementation = "static"
        return config, model, None
    torch.set_num_threads(os.cpu_count() or 1)
    config, params, tokenizer = load_model(args.model)
    model = transformers_llama(config, params)
    if variant == "torch-dynamic-int8":
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    return config, model, tokenizer


def measure_torch(args, variant: str) -> dict:
    import numpy as np
    import torch

    from llmeq_jax import evaluate

    t0 = time.perf_counter()
    config, model, tokenizer = torch_model(args, variant)
    out = {"quantize_s": time.perf_counter() - t0 if variant == "torch-dynamic-int8" else 0.0, "param_mb": None}
    device = next(model.parameters()).device
    rng = np.random.default_rng(0)

    def sync(x):
        if device.type == "cuda":
            torch.cuda.synchronize()
        return x

    def gen(prompt, n):
        return sync(model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0))

    def tokens(shape):
        return torch.from_numpy(rng.integers(0, config.vocab_size, shape)).to(device)

    def decode(batch: int) -> tuple[float, float]:
        prompt = tokens((batch, args.prompt_len))
        first_one, one = median_seconds(lambda: gen(prompt, 1), args.repeats)
        first_all, full = median_seconds(lambda: gen(prompt, args.new_tokens), args.repeats)
        return batch * (args.new_tokens - 1) / max(full - one, 1e-9), first_one + first_all - one - full

    with torch.inference_mode():
        compile_s = 0.0
        for i, batch in enumerate(args.batches):
            out[f"decode_b{batch}"], compiled = decode(batch)
            compile_s += compiled if i == 0 else 0.0
        long = tokens((1, args.prefill_len))
        first, warm = median_seconds(lambda: sync(model(long).logits), args.repeats)
        out["prefill"] = args.prefill_len / warm
        out["compile_s"] = compile_s + first - warm  # the static cache's warm-up and generate's torch.compile
        if args.windows and tokenizer is not None:
            t0 = time.perf_counter()
            ids = evaluate.tokenize_text(tokenizer, Path(args.text).read_text())
            windows = evaluate.make_windows(ids, 512, args.windows)
            total = 0.0
            for start in range(0, len(windows), args.batch_size):
                batch = torch.from_numpy(windows[start : start + args.batch_size].astype(np.int64)).to(device)
                logits = model(batch).logits[:, :-1].float()
                nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                        batch[:, 1:].reshape(-1), reduction="sum")
                total += float(nll)
            out["ppl_run_s"] = time.perf_counter() - t0
            out["ppl"] = float(np.exp(total / (len(windows) * (windows.shape[1] - 1))))
    out["device_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    return out


def run_one(args) -> None:
    measure = measure_torch if args.one in TORCH_VARIANTS else measure_ours
    result = measure(args, args.one)
    result["peak_rss_mib"] = peak_rss_mib()
    Path(args.result).write_text(json.dumps(result))


# --------------------------------------------------------------------------- the whole run


def child_command(args, variant: str, result: Path) -> list[str]:
    return [sys.executable, __file__, *args.argv, "--one", variant, "--result", str(result)]


def torch_variants(args) -> list[str]:
    """The torch rows this machine can run: transformers bf16 with a static cache on CUDA (needs
    Llama shapes), else transformers fp32 and quantize_dynamic int8 of the real model on the CPU."""
    import importlib.util

    if not args.torch or importlib.util.find_spec("torch") is None:
        return []
    import torch

    if torch.cuda.is_available():
        return list(TORCH_GPU_VARIANTS)
    return [] if args.shapes else list(TORCH_CPU_VARIANTS)


def machine_line() -> str:
    import jax

    from llmeq_jax import dispatch_table
    from pallas_kernels import hardware_checked

    device = jax.devices()[0]
    unchecked = ",".join(sorted(hardware_checked.named())) or "none"
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}; "
            f"jax {jax.__version__} ({jax.default_backend()}: {device.device_kind}); "
            f"dispatch table: {dispatch_table.describe(device)}; kernels not yet checked on a GPU turned on "
            f"({hardware_checked.ENV}): {unchecked}")


def agreement_cell(agree: dict | None) -> str:
    return "–" if agree is None else f"{100 * agree['rel_err']:.2f} %, {agree['top1']}/{agree['positions']}"


def table(rows: dict[str, dict], base_name: str, batches: list[int]) -> str:
    base = rows.get(base_name, {})

    def ratio(row, key):
        return f"{row[key] / base[key]:.2f}x" if base.get(key) and row.get(key) else "–"

    def num(value, fmt):
        return "–" if value is None else format(value, fmt)

    keys = [f"decode_b{b}" for b in batches] + ["prefill"]
    head = [h for b in batches for h in (f"decode b{b} tok/s", f"vs {base_name}")]
    head += ["prefill tok/s", f"vs {base_name}", "ppl", "ppl run s", "compile s", "peak RSS MiB", "device peak MiB"]
    kv = any("decode_kv" in r for r in rows.values())
    if kv:  # --kv-bits: the first batch's decode over a quantized cache, and against the row's own float cache
        head += [f"decode b{batches[0]} quantized KV tok/s", "vs float KV"]
    probed = any("logits" in r for r in rows.values())
    if probed:  # the kernels' own error (vs XLA on the same weights), then quantizing's (vs the baseline)
        head += ["logits vs XLA: max rel. err, top-1", f"logits vs {base_name}"]
    lines = ["| variant | " + " | ".join(head) + " |", "|" + "---|" * (len(head) + 1)]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} |" + " |" * (len(head) - 1))
            continue
        cells = [c for k in keys for c in (f"{r[k]:.1f}" if k != "prefill" else f"{r[k]:.0f}", ratio(r, k))]
        cells += [num(r.get("ppl"), ".3f"), num(r.get("ppl_run_s"), ".1f"), f"{r['compile_s']:.1f}",
                  f"{r['peak_rss_mib']:.0f}", num(r.get("device_peak_mib"), ".0f")]
        if kv:
            own = r.get(f"decode_b{batches[0]}")
            cells += [num(r.get("decode_kv"), ".1f"),
                      f"{r['decode_kv'] / own:.2f}x" if r.get("decode_kv") and own else "–"]
        if probed:
            cells += [agreement_cell(r.get("logits", {}).get(which)) for which in ("vs_xla", "vs_base")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def variants_of(args) -> list[str]:
    base = baseline(args)
    ours = [base] + [r for r in args.recipes if r != base]
    if args.scan_only:  # only the stacked-blocks layout (a 32-layer model compiles one block)
        ours = [v + SCAN_SUFFIX for v in ours]
    elif args.scan_layers:  # each of ours, then the same with stacked blocks
        ours = [name for v in ours for name in (v, v + SCAN_SUFFIX)]
    # the other frameworks' rows right after the baseline: a run cut short by a time limit still compares them
    baseline_rows = [v for v in ours if v.removesuffix(SCAN_SUFFIX) == base]
    return baseline_rows + torch_variants(args) + [v for v in ours if v not in baseline_rows]


def report_of(args, rows: dict[str, dict]) -> dict:
    model = f"random weights of {args.shapes} shapes" + (f" ({args.layers} layers)" if args.layers else "") \
        if args.shapes else args.model
    ppl = (f"; ppl run: {args.windows} windows of 512, batch {args.batch_size}, wall incl. tokenize + compile"
           if args.windows and not args.shapes else "")
    return {"model": model, "machine": machine_line(), "text": args.text, "windows": args.windows,
            "dtype": args.dtype,
            "protocol": (f"decode: greedy, {args.new_tokens} new tokens after a {args.prompt_len}-token prompt, "
                         f"time(N - 1 steps) - time(0 steps) of one compiled loop, median of {args.repeats} warm runs, "
                         f"batches {args.batches}; prefill: "
                         f"{args.prefill_len} tokens, batch 1{ppl}"),
            "rows": rows}


# A runtime's log lines (glog: severity letter, MMDD, time, thread, file:line]) and the source traces XLA
# appends to them: after a GPU fault, hundreds of them followed the Python traceback and hid it.
_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.]+:\d+\]")
_TRACE_LINE = re.compile(r"^(=== Source Location Trace: ===|\S+\.(cc|h):\d+)\s*$")


def failure_of(stderr: str) -> str:
    """A failed variant's stderr without runtime log lines: the traceback, its exception last."""
    kept = [line for line in stderr.splitlines()
            if line.strip() and not _LOG_LINE.match(line) and not _TRACE_LINE.match(line.strip())]
    return "\n".join(kept) or stderr.strip()


def add_logits_agreement(row: dict, mine: Path, base: Path) -> None:
    """``row["logits"]``: the variant's probed logits (:func:`logits_probe`) against its own XLA path's and, where
    the baseline probed its own, against those."""
    import numpy as np

    if not mine.exists():
        return
    probe = np.load(mine)
    row["logits"] = {"vs_xla": logits_agreement(probe["kernels"], probe["xla"])}
    if base.exists():
        row["logits"]["vs_base"] = logits_agreement(probe["kernels"], np.load(base)["kernels"])


def run_child(command: list[str]) -> tuple[int, str]:
    """Run one variant's process: (exit code, its stderr); its progress lines echoed to ours as they come."""
    lines = []
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith(PROGRESS):
                print(line, end="", file=sys.stderr, flush=True)
    return proc.returncode, "".join(lines)


def run_all(args) -> None:
    rows: dict[str, dict] = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    base = baseline(args) + (SCAN_SUFFIX if args.scan_only else "")
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants_of(args):
            result = Path(tmp) / f"{v}.json"
            print(f"[bench_e2e] {v} ...", file=sys.stderr, flush=True)
            returncode, stderr = run_child(child_command(args, v, result))
            if returncode != 0:
                message = failure_of(stderr)
                rows[v] = {"error": (message.splitlines() or ["no output"])[-1]}
                print(f"[bench_e2e] {v} failed:\n{message[-3000:]}", file=sys.stderr)
            else:
                rows[v] = json.loads(result.read_text())
                add_logits_agreement(rows[v], logits_path(result), logits_path(Path(tmp) / f"{base}.json"))
            # After every variant: a run stopped by a time limit keeps the rows it finished.
            out.write_text(json.dumps(report_of(args, rows), indent=1))
    report = report_of(args, rows)
    print(f"Model {report['model']} ({args.dtype}); {report['machine']}.\n{report['protocol']}.\n")
    print(table(rows, base, args.batches))
    for name, row in rows.items():
        if row.get("profile"):
            print("\n" + profile_table(name, row["profile"]))
    print(f"\nJSON: {out}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shapes", help="random weights of these published shapes instead of --model "
                                     "(llmeq_jax.models.shapes: llama-2-7b, llama-3-8b, smollm2-135m)")
    ap.add_argument("--layers", type=int, help="with --shapes: this many layers instead of the model's own")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the float weights' dtype (and the baseline row: fp32 or bf16)")
    ap.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES))
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext2_test.txt"))
    ap.add_argument("--calib", default=None, help="calibration text for recipes that need one")
    ap.add_argument("--windows", type=int, default=16, help="perplexity windows of 512 tokens (0: none)")
    ap.add_argument("--batch-size", type=int, default=4, help="perplexity batch")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--kv-bits", type=int, choices=(4, 8),
                    help="also decode (the first batch size) over an int4 / int8 KV cache (online key ranges)")
    ap.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure transformers (and torch quantize_dynamic int8 on a CPU); needs torch")
    ap.add_argument("--scan-layers", action="store_true",
                    help=f"also each of our variants with its blocks stacked under one scan (rows '<variant>{SCAN_SUFFIX}')")
    ap.add_argument("--scan-only", action="store_true",
                    help="only our variants with stacked blocks (ratios against the baseline's '+scan' row)")
    ap.add_argument("--profile", action="store_true",
                    help="also trace one decode of each of our variants and list its GPU kernels (µs, launches)")
    ap.add_argument("--profile-top", type=int, default=40, help="kernels listed per variant with --profile")
    ap.add_argument("--out", default="runs/bench_e2e.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.shapes:
        from llmeq_jax.models import shapes

        if args.shapes not in shapes.PUBLISHED:
            ap.error(f"--shapes: unknown {args.shapes!r}; known: {', '.join(shapes.PUBLISHED)}")
    elif args.layers:
        ap.error("--layers goes with --shapes (a real model keeps its own depth)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        run_one(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
