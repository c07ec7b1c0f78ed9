"""GPT-2 decoder block: learned positions (added at the embedding), LayerNorm, GELU (tanh), fused QKV.

Param tree of one block::

    ln_1/{scale,bias}
    attn/qkv_proj/{kernel,bias}   (in, 3*hidden): q | k | v, as HF's c_attn
    attn/o_proj/{kernel,bias}
    ln_2/{scale,bias}
    mlp/fc_in/{kernel,bias}, mlp/fc_out/{kernel,bias}
"""

from __future__ import annotations

import flax.linen as nn
import jax

from llmeq_jax.kv import cache as kvcache
from llmeq_jax.kv.attention import dot_product_attention
from llmeq_jax.models.config import ModelConfig
from llmeq_jax.models.layers import LayerNorm, Linear


class GPT2Attention(nn.Module):
    config: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x, mask, cache):
        c = self.config
        b, t, d = x.shape
        qkv = Linear(3 * d, True, name="qkv_proj")(x)
        q, k, v = (a.reshape(b, t, c.num_heads, c.head_dim) for a in jax.numpy.split(qkv, 3, axis=-1))
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, H, T, D]
        if cache is None:
            out = dot_product_attention(q, k, v, mask)
        else:  # the cache type decides how keys/values are stored and read back
            out, cache = kvcache.attend(cache, self.layer, q, k, v, mask)
        out = out.reshape(b, t, d)
        return Linear(d, True, name="o_proj")(out), cache


class GPT2MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        h = Linear(c.intermediate_size, True, name="fc_in")(x)
        h = jax.nn.gelu(h, approximate=c.act == "gelu_tanh")
        return Linear(c.hidden_size, True, name="fc_out")(h)


class GPT2Block(nn.Module):
    config: ModelConfig
    layer: int = 0

    @nn.compact
    def __call__(self, x, positions, mask, cache=None):
        del positions  # GPT-2 adds learned positions once, at the embedding
        c = self.config
        h, cache = GPT2Attention(c, self.layer, name="attn")(LayerNorm(c.norm_eps, name="ln_1")(x), mask, cache)
        x = x + h
        x = x + GPT2MLP(c, name="mlp")(LayerNorm(c.norm_eps, name="ln_2")(x))
        return x, cache
