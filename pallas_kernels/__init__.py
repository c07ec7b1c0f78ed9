"""Pallas (GPU Triton) kernels for llmeq_jax, each beside a pure-jnp reference of the same math.

Which kernel ``llmeq_jax.ops.linear`` uses for a product is decided on the ops side,
in :mod:`llmeq_jax.kernel_dispatch`.

* :mod:`pallas_kernels.w8a8`         fused per-token activation quantize + int8 GEMM + rescale
* :mod:`pallas_kernels.weight_only`  int8 / packed-int4 weight-only matmul (dequantize in registers)
* :mod:`pallas_kernels.int4_words`   int4 weight-only decode on 32-bit words of eight K values (inline PTX)
* :mod:`pallas_kernels.float_matmul` a float kernel's layer read in place from its stack (decode in the scan)
* :mod:`pallas_kernels.kv_cache`     single-query decode attention over the quantized KV cache's store
* :mod:`pallas_kernels.rms_norm`     a decode step's RMSNorm in one launch, its scale read in place from a stack
* :mod:`pallas_kernels.config`       the interpret-mode switch for running kernels on CPU
* :mod:`pallas_kernels.settings`     the matmul kernels' launch settings at decode rows, overridden for a block
* :mod:`pallas_kernels.offsets`      64-bit pointer offsets for one-byte arrays of 2-4 GiB (a lowering fix)
"""

from pallas_kernels import config, offsets, settings

offsets.install()  # before any kernel is lowered: int8 stacks of 2-4 GiB would be read out of bounds

__all__ = ["config", "offsets", "settings"]
