"""Llama-family decoder block: Llama, Mistral (sliding window), Qwen2 (QKV bias), Qwen3 (q/k RMSNorm).

pre-norm -> GQA attention with RoPE -> residual -> pre-norm -> SwiGLU -> residual.
Param tree of one block::

    input_norm/scale
    attn/{q,k,v,o}_proj/kernel (+ bias for Qwen2 q/k/v), attn/{q,k}_norm/scale (Qwen3)
    post_attn_norm/scale
    mlp/{gate,up,down}_proj/kernel
    mlp/down_rot/f_0, f_1, ...   optional: an online rotation of down_proj's input (methods/rotate.py)
"""

from __future__ import annotations

import flax.linen as nn
import jax

from llmeq_jax import ops
from llmeq_jax.core.rope import apply_rope, rope_inv_freq
from llmeq_jax.decode_layout import PanelKernel
from llmeq_jax.kv import cache as kvcache
from llmeq_jax.kv.attention import dot_product_attention
from llmeq_jax.models.config import ModelConfig
from llmeq_jax.models.layers import Linear, RMSNorm, apply_kron, parallel_linears


class LlamaAttention(nn.Module):
    config: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x, positions, mask, cache, residual=None):
        """(``residual`` + the attention's output, the cache); ``residual`` None: the output alone."""
        c = self.config
        b, t, _ = x.shape
        q, k, v = parallel_linears(self, x, "qkv_proj", [
            ("q_proj", c.num_heads * c.head_dim, c.qkv_bias),
            ("k_proj", c.num_kv_heads * c.head_dim, c.qkv_bias),
            ("v_proj", c.num_kv_heads * c.head_dim, c.qkv_bias),
        ])
        q = q.reshape(b, t, c.num_heads, c.head_dim)
        k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
        v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:  # Qwen3: RMSNorm over each head's features, before RoPE
            q = RMSNorm(c.norm_eps, name="q_norm")(q)
            k = RMSNorm(c.norm_eps, name="k_norm")(k)
        k_raw = k.transpose(0, 2, 1, 3)  # before RoPE: a pre-RoPE quantized cache stores these
        # a float cache's decode kernel rotates q and k itself (kv.cache.rotates): they reach it before RoPE
        deferred = cache is not None and kvcache.rotates(cache, q, positions)
        if not deferred:
            inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, KV, T, D]
        if cache is None:
            out = dot_product_attention(q, k, v, mask)
        else:  # the cache type decides how keys/values are stored and read back
            out, cache = kvcache.attend(cache, self.layer, q, k, v, mask, k_raw=k_raw,
                                        rope=positions if deferred else None)
        out = out.reshape(b, t, c.num_heads * c.head_dim)
        return Linear(c.hidden_size, c.o_bias, name="o_proj")(out, residual=residual), cache


class KronRotation(nn.Module):
    """``x @ kron(f_0, f_1, ...)`` over the last axis, the factors read from the params (never initialized)."""

    count: int

    @nn.compact
    def __call__(self, x):
        factors = [self.get_variable("params", f"f_{i}") for i in range(self.count)]
        return apply_kron(x, factors)


class SwiGLU(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, residual=None):
        """``residual`` + the MLP's output (``residual`` None: the output alone)."""
        c = self.config
        joined = self.variables.get("params", {}).get("gate_up_proj", {}).get("kernel")
        # Prefill layout (packed float panels), a weight-only kernel on the dequantized panels, or the decode
        # layout's paired gate/up words (which only ops.swiglu reads right): the activation inside the GEMM.
        if (isinstance(joined, PanelKernel) and joined.swiglu) or ops.swiglu_fuses(x, joined) \
                or ops.paired_swiglu(joined):
            h = ops.swiglu(x, joined)
        else:
            gate, up = parallel_linears(self, x, "gate_up_proj", [
                ("gate_proj", c.intermediate_size, False),
                ("up_proj", c.intermediate_size, False),
            ])
            h = jax.nn.silu(gate) * up
        # An online rotation before down_proj exists only in a rotated model's params (QuaRot): down_proj's
        # kernel then holds its inverse, and down_proj's Linear (so calibration too) sees the rotated input.
        rot = self.variables.get("params", {}).get("down_rot")
        if rot is not None:
            h = KronRotation(len(rot), name="down_rot")(h)
        return Linear(c.hidden_size, name="down_proj")(h, residual=residual)


class LlamaBlock(nn.Module):
    config: ModelConfig
    layer: int = 0

    @nn.compact
    def __call__(self, x, positions, mask, cache=None):
        c = self.config
        # the residual adds inside o_proj and down_proj: a decode step's kernels add them as they finish their
        # products (ops.linear's residual)
        x, cache = LlamaAttention(c, self.layer, name="attn")(RMSNorm(c.norm_eps, fold=True, name="input_norm")(x),
                                                              positions, mask, cache, residual=x)
        x = SwiGLU(c, name="mlp")(RMSNorm(c.norm_eps, fold=True, name="post_attn_norm")(x), residual=x)
        return x, cache
