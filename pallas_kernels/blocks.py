"""Block sizes for the matmul kernels: parameters with a small per-shape table.

Rows of the table are (largest M it applies to, bm, bn, bk, num_warps, num_stages).
Decode (few rows) wants wide N tiles and long K steps to stream the weight;
prefill wants square-ish tiles for reuse. Every block dim is a power of two
(a Triton requirement) and at least 16 (tensor-core dot minimum); shapes that
are not multiples of a block are handled by masks in the kernels.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.common import MIN_DOT, next_pow2


@dataclasses.dataclass(frozen=True)
class Blocks:
    bm: int
    bn: int
    bk: int
    num_warps: int = 4
    num_stages: int = 2


# (max M, bm, bn, bk, warps, stages); the last row covers everything larger.
# M <= 16: bn 128 measured 1.1-1.3x faster than 64 for int4 decode on an H100 (with split K).
MATMUL_TABLE = (
    (16, 16, 128, 256, 4, 3),
    (64, 32, 64, 128, 4, 3),
    (256, 64, 128, 64, 4, 3),
    (None, 128, 128, 64, 8, 3),
)
# int8 x int8 (W8A8): K steps of the same bytes as above (twice the elements). Large M: 128x128 tiles, 8 warps,
# 3 stages were the fastest of five settings for the K-major weights these rows take (w8a8.TRANSPOSE_MIN_M) on an
# H200 at M = 2048 (1.27x bf16 against 1.12x for the 256x128 tiles an H100 had measured best for the (K, N) layout).
INT8_TABLE = (
    (16, 16, 64, 512, 4, 3),
    (64, 32, 64, 256, 4, 3),
    (256, 64, 128, 128, 4, 3),
    (None, 128, 128, 128, 8, 3),
)


def _fit(block: int, size: int, minimum: int = MIN_DOT) -> int:
    """Shrink a block to the (power-of-two padded) size, never below ``minimum``."""
    return max(minimum, min(block, next_pow2(size)))


def matmul_blocks(
    m: int, n: int, k: int, group: int | None = None, *, min_bk: int = MIN_DOT, int8: bool = False
) -> Blocks:
    """Blocks for an (m, k) x (k, n) product; with per-group scales the K step is the group."""
    for max_m, bm, bn, bk, warps, stages in INT8_TABLE if int8 else MATMUL_TABLE:
        if max_m is None or m <= max_m:
            break
    bk = group if group is not None else _fit(bk, k, min_bk)
    return Blocks(_fit(bm, m), _fit(bn, n), bk, warps, stages)
