"""Decode tokens/s of one model under kernel launch settings, side by side in one process (issue #15).

Why: the matmul kernels' tiles, stages and K splits were chosen by timing each kernel alone, where the
run-to-run spread of one setting on an H200 (1.24x bf16 in one run, 1.58x in the next) is as large as the
differences between settings -- so no setting could be told apart. A decode step of a 7B model (~2.5 ms,
~128 kernel calls) averages that spread away, and its tokens/s is the figure #15's targets are about.

One process: random weights of published shapes (``--shapes``, no download) in bf16, the recipe
quantizes them once, blocks stacked under one scan (as ``bench_e2e.py --scan-only``). Then the bf16
model's decode, and the quantized model's decode under its kernels' defaults and under each setting
(``pallas_kernels.settings.override``: each compiles its own loop; the weights and their decode layout
are shared), in ``--rounds`` rounds (the later rounds find the loops compiled), each setting's tokens/s
the median over rounds; ratios against the defaults and bf16 of the same process.

A setting is ``kernel:field=value,...`` (``pallas_kernels.settings``: bn, bk, warps, stages, programs,
k_splits, epilogue), e.g. ``int4_words:bn=256,stages=4``, or a read-ahead of each decode product's weights into
L2 while the small kernels before it run, ``prefetch:mb=16,stream=side`` (``pallas_kernels.prefetch``); without
``--settings`` the recipe's kernels get :data:`DEFAULT_SETTINGS`. Settings apply to the launches of at most 16
rows (decode); the dispatch is the shipped table's (a setting does not move a product between a kernel and XLA).

    PYTHONPATH=. python scripts/sweep_decode.py --shapes llama-2-7b --recipe rtn-w4-g128   # a GPU
    PYTHONPATH=. python scripts/sweep_decode.py --shapes llama-2-7b --recipe rtn-w8 --settings int8_f16:stages=4

``--interpret``: the kernels in Pallas interpret mode (a CPU check that every setting runs; the times mean
nothing there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# Which kernels a recipe's decode products run on a GPU (kernel_dispatch), and what is tried for each: the
# split target (programs; 264 by default), the column tile, K steps of more bytes, pipeline depth, warps.
KERNELS_OF = {"rtn-w4-g128": ("int4_words",), "rtn-w8": ("int8_f16", "weight_only"), "rtn-w8a8": ("w8a8",),
              "bf16": ("float_matmul",)}
DEFAULT_SETTINGS = {
    "int4_words": ["programs=132", "programs=528", "bn=128", "bn=256", "bk=256", "bk=512", "stages=2", "stages=4",
                   "warps=8", "epilogue=mma", "bk=256,stages=4", "bk=256,programs=528", "bn=256,programs=132"],
    # x made float16 by XLA or in the kernel: which is the default depends on whether the norm kernel runs
    # (int8_f16.converts_in_xla), so both are tried
    "int8_f16": ["programs=132", "programs=528", "bn=128", "bk=1024", "stages=4", "warps=8", "convert=xla",
                 "convert=kernel"],
    "weight_only": ["programs=528", "stages=4"],
    "w8a8": ["programs=132", "programs=528", "bn=128", "stages=4", "warps=8"],
    "float_matmul": ["programs=132", "programs=528", "bn=128", "stages=4", "warps=8"],
}
DEFAULTS = "defaults"


def settings_of(args) -> list[str]:
    """The settings to try, as ``kernel:fields`` strings (checked: a typo fails before any weight is made)."""
    from pallas_kernels import settings

    if args.settings:
        wanted = list(args.settings)
    else:
        kernels = KERNELS_OF.get(args.recipe)
        if kernels is None:
            raise SystemExit(f"--recipe {args.recipe}: no default settings (known: {', '.join(KERNELS_OF)}); "
                             "give --settings")
        wanted = [f"{kernel}:{fields}" for kernel in kernels for fields in DEFAULT_SETTINGS[kernel]]
    for text in wanted:
        try:
            settings.check(text)
        except ValueError as e:
            raise SystemExit(f"--settings: {e}") from None
    return wanted


def models(args):
    """(config, bf16 params, the recipe's params, quantize seconds), blocks stacked under one scan."""
    import jax
    import jax.numpy as jnp

    from llmeq_jax import pipeline
    from llmeq_jax.models import shapes, stacked

    config = shapes.shape_config(args.shapes, args.layers)
    bf16 = shapes.random_params(config, jnp.bfloat16)
    t0 = time.perf_counter()
    if args.recipe == "bf16":
        quantized = bf16
    else:
        quantized = pipeline.run_recipe(config, bf16, None, pipeline.read_recipe(args.recipe), None, 16,
                                        progress=False).params
        jax.block_until_ready(quantized)
    quantize_s = time.perf_counter() - t0
    quantized = stacked.stack_blocks(config, quantized)
    bf16 = stacked.stack_blocks(config, bf16)
    return config, bf16, quantized, quantize_s


def decode_rate(config, params, prompt, args) -> tuple[float, float]:
    """(tokens/s of ``args.new_tokens - 1`` decode steps, seconds of the loop's first call) under the settings in
    force (``generate.decode_timing``)."""
    from llmeq_jax.generate import decode_timing

    seconds, first = decode_timing(config, params, prompt, args.new_tokens, args.repeats)
    if seconds <= 1e-6:  # decode_timing's floor: the steps' time vanished in the loop's noise; once more, 5x the runs
        seconds, _ = decode_timing(config, params, prompt, args.new_tokens, 5 * args.repeats)
    if seconds <= 1e-6:  # too few steps to time
        raise RuntimeError(f"{args.new_tokens - 1} decode steps took no measurable time: raise --new-tokens")
    return prompt.shape[0] * (args.new_tokens - 1) / seconds, first


def run(args) -> dict:
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np

    from llmeq_jax import native
    from pallas_kernels import config as kernel_config, settings

    wanted = settings_of(args)
    if not (args.interpret or kernel_config.on_gpu()):
        raise SystemExit(f"no GPU here ({jax.default_backend()}): the Pallas kernels do not run, so no setting changes "
                         "anything; --interpret checks that every setting runs (its times mean nothing)")
    interpret = contextlib.ExitStack()
    if args.interpret:  # the Pallas kernels interpreted, and the CPU's native ones off (they would take decode)
        interpret.enter_context(kernel_config.interpret(True))
        interpret.enter_context(native.disabled())
    with interpret:
        config, bf16, quantized, quantize_s = models(args)
        print(f"{args.shapes}: {config.num_layers} layers, {args.recipe} quantized in {quantize_s:.1f} s", flush=True)
        rng = np.random.default_rng(0)
        prompt = jnp.asarray(rng.integers(0, config.vocab_size, (args.batch, args.prompt_len)), jnp.int32)
        rows: dict[str, dict] = {}

        def measure(name: str, params, setting: str | None) -> None:
            row = rows.setdefault(name, {"tok_s": [], "first_s": None, "error": None})
            if row["error"]:
                return
            try:
                with settings.scope(setting) if setting else contextlib.nullcontext():
                    rate, first = decode_rate(config, params, prompt, args)
            except Exception as e:  # noqa: BLE001 -- a setting Triton or the kernel refuses: reported, the rest go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                print(f"   {name}: failed: {row['error']}", flush=True)
                return
            row["tok_s"].append(rate)
            row["first_s"] = row["first_s"] if row["first_s"] is not None else first
            print(f"   {name}: {rate:.1f} tok/s (first call {first:.1f} s)", flush=True)

        for round_ in range(args.rounds):
            print(f"round {round_ + 1} of {args.rounds}", flush=True)
            if args.recipe != "bf16":
                measure("bf16", bf16, None)
            measure(DEFAULTS, quantized, None)
            for setting in wanted:
                measure(setting, quantized, setting)
    return {"shapes": args.shapes, "layers": config.num_layers, "recipe": args.recipe, "batch": args.batch,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "rounds": args.rounds,
            "device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "interpret": args.interpret,
            "quantize_s": quantize_s, "rows": {name: summary(row) for name, row in rows.items()}}


def summary(row: dict) -> dict:
    return {**row, "median": statistics.median(row["tok_s"]) if row["tok_s"] else None}


def table(report: dict) -> str:
    """Markdown: each setting's tokens/s per round, the median, and ratios to the defaults and bf16 medians."""
    rows = report["rows"]
    base = rows.get(DEFAULTS, {}).get("median")
    bf16 = rows.get("bf16", {}).get("median")
    head = " | ".join(f"round {i + 1}" for i in range(report["rounds"]))
    lines = [f"| setting | {head} | median tok/s | vs defaults | vs bf16 | first call s |",
             "| --- |" + " ---: |" * (report["rounds"] + 4)]
    for name, row in rows.items():
        if row["error"]:
            lines.append(f"| {name} | failed: {row['error'][:120]} |")
            continue
        rates = " | ".join(f"{r:.1f}" for r in row["tok_s"]) + " |" * (report["rounds"] - len(row["tok_s"]))
        med = row["median"]
        vs = lambda b: f"{med / b:.3f}x" if b else ""  # noqa: E731
        lines.append(f"| {name} | {rates} | {med:.1f} | {vs(base)} | {vs(bf16)} | {row['first_s']:.1f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    from llmeq_jax.models import shapes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-2-7b", choices=sorted(shapes.PUBLISHED))
    ap.add_argument("--layers", type=int, help="this many layers instead of the model's own")
    ap.add_argument("--recipe", default="rtn-w4-g128", help="a round-to-nearest recipe, or bf16 (the float kernel)")
    ap.add_argument("--settings", nargs="+", help="kernel:field=value,... or prefetch:mb=N,stream=main|side "
                    "(default: the recipe's DEFAULT_SETTINGS)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed loops per measurement (their median)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over all settings, in turns")
    ap.add_argument("--interpret", action="store_true", help="kernels in interpret mode (a CPU check)")
    ap.add_argument("--out", default="runs/sweep_decode.json")
    args = ap.parse_args(argv)
    if args.new_tokens < 2 or args.rounds < 1 or args.repeats < 1:
        ap.error("--new-tokens needs >= 2 (one timed step), --rounds and --repeats >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\n{report['shapes']} ({report['layers']} layers), {report['recipe']}, batch {report['batch']}, "
          f"{report['new_tokens'] - 1} decode steps x {report['repeats']} a measurement; {report['device']}, "
          f"jax {report['jax']}{' (interpret mode: times mean nothing)' if report['interpret'] else ''}\n")
    print(table(report))
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
