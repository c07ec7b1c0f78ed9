"""Prefill and perplexity-run speed, ours vs transformers, interleaved in one process (docs/cpu-speed.md).

bench_e2e.py runs each variant in a process of its own (for its peak RSS), one after the other;
on a machine whose speed drifts from minute to minute that is too coarse for a 10 % question.
Here every variant runs in the same process and the rounds alternate between them, so a slow
minute slows them all:

* prefill tokens/s: one ``--prefill-len`` sequence through the full forward (logits for every
  position), warm; per variant the best and the median of ``--rounds`` rounds;
* perplexity run: ``--windows`` windows of 512 tokens of the test text in batches of
  ``--batch-size``; the batches alternate between the variants and each variant's wall time is
  summed, its first batch including its compilation (what a user waits for). Ours computes the
  NLL as ``llmeq eval`` does (``pipeline.sequence_nll``), transformers as
  ``cross_entropy(model(batch).logits)``.

Variants: our fp32, each ``--recipes`` (quantized with 16 calibration windows first), and
transformers fp32 holding the same weights (``models.to_transformers``; needs torch).

    PYTHONPATH=. python scripts/bench_prefill.py --recipes rtn-w8a8 --windows 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from llmeq_jax import decode_layout, evaluate, pipeline
from llmeq_jax.models import forward, load_model


def our_variant(config, params):
    """(prefill(tokens [1, T]), nll_sum(windows [B, 512])) for our model with these params."""
    fwd = jax.jit(lambda p, t: forward(config, p, t))
    nll = jax.jit(lambda p, t: jnp.sum(pipeline.sequence_nll(config)(p, t)))
    params = decode_layout.for_prefill(params)  # what llmeq eval / compare run
    return (lambda t: jax.block_until_ready(fwd(params, jnp.asarray(t))),
            lambda w: float(nll(params, jnp.asarray(w))))


def torch_variant(config, params):
    import torch

    from llmeq_jax.models.to_transformers import transformers_llama

    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers_llama(config, params)

    @torch.inference_mode()
    def prefill(t):
        return model(torch.from_numpy(np.asarray(t, np.int64))).logits

    @torch.inference_mode()
    def nll(w):
        batch = torch.from_numpy(np.asarray(w, np.int64))
        logits = model(batch).logits[:, :-1].float()
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       batch[:, 1:].reshape(-1), reduction="sum"))

    return prefill, nll


def settle() -> None:
    """A pause before each timed call: the previous variant's worker threads (torch's OpenMP
    team, XLA's and our pools) spin-wait for a while after their last work, and would otherwise
    take cores from the next variant's first milliseconds."""
    time.sleep(0.3)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipes", nargs="*", default=[])
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext2_test.txt"))
    ap.add_argument("--calib", default=None)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args(argv)

    config, params, tokenizer = load_model(args.model)
    variants = {"fp32": our_variant(config, params)}
    for name in args.recipes:
        q = pipeline.run_recipe(config, params, tokenizer, pipeline.read_recipe(name), args.calib, 16, progress=False)
        variants[name] = our_variant(config, q.params)
    if args.torch:
        variants["transformers-fp32"] = torch_variant(config, params)

    rng = np.random.default_rng(0)
    long = rng.integers(0, config.vocab_size, (1, args.prefill_len)).astype(np.int32)
    times = {name: [] for name in variants}
    for name, (prefill, _) in variants.items():
        prefill(long)  # compile / warm up
    for _ in range(args.rounds):
        for name, (prefill, _) in variants.items():
            settle()
            t0 = time.perf_counter()
            prefill(long)
            times[name].append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    ids = evaluate.tokenize_text(tokenizer, Path(args.text).read_text())
    windows = evaluate.make_windows(ids, 512, args.windows)
    tokenize_s = time.perf_counter() - t0
    ppl_s = dict.fromkeys(variants, tokenize_s)
    nll = dict.fromkeys(variants, 0.0)
    for start in range(0, len(windows), args.batch_size):
        batch = windows[start: start + args.batch_size]
        for name, (_, nll_fn) in variants.items():
            settle()
            t0 = time.perf_counter()
            nll[name] += nll_fn(batch)
            ppl_s[name] += time.perf_counter() - t0

    count = len(windows) * (windows.shape[1] - 1)
    base = "fp32"
    ref = "transformers-fp32" if "transformers-fp32" in variants else None
    print(f"Model {args.model}; {os.cpu_count()} CPUs; jax {jax.__version__}. Prefill {args.prefill_len} tokens, "
          f"{args.rounds} interleaved rounds; perplexity run {args.windows} x 512 tokens, batch {args.batch_size}, "
          "batches interleaved, wall incl. tokenize + compile.\n")
    cols = ["variant", "prefill tok/s (best)", "median", f"vs {base}"] + ([f"vs {ref}"] if ref else [])
    cols += ["ppl", "ppl run s", f"run vs {ref}" if ref else "run"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for name in variants:
        best, med = args.prefill_len / min(times[name]), args.prefill_len / statistics.median(times[name])
        cells = [name, f"{best:.0f}", f"{med:.0f}", f"{min(times[base]) / min(times[name]):.2f}x"]
        if ref:
            cells.append(f"{min(times[ref]) / min(times[name]):.2f}x")
        cells += [f"{np.exp(nll[name] / count):.3f}", f"{ppl_s[name]:.1f}",
                  f"{ppl_s[name] / ppl_s[ref]:.2f}x" if ref else "–"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
