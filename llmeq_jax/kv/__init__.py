"""Quantized KV cache (SimQuant / KVQuant-style). Imports run one way, bottom to top:

* :mod:`llmeq_jax.kv.spec`       what is quantized and how: ``KVSpec``, calibrated ``KeyRanges``, ``KVQuantizer``
* :mod:`llmeq_jax.kv.grid`       grid math: min/max grids, codes, per-token / per-channel quantize, outliers
* :mod:`llmeq_jax.kv.attention`  softmax attention over key/value sets (one, several, merged by log-sum-exp)
* :mod:`llmeq_jax.kv.cache`      the float and the quantized cache: where a KV entry is written and read
* :mod:`llmeq_jax.kv.memory`     bytes per token of a cache, the longest context a budget holds

RoPE is :mod:`llmeq_jax.core.rope`; static key ranges are calibrated by running the model,
in :mod:`llmeq_jax.calibrate` (``calibrate_key_ranges``, ``make_kv_quantizer``). The Pallas
KV kernels (:mod:`pallas_kernels.kv_cache`) import only ``spec``/``grid`` and ``core``.

This file imports nothing: a kernel importing ``kv.grid`` must not pull in ``kv.cache``
(which imports the kernels).
"""
