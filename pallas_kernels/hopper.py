"""What the Mosaic GPU (Pallas on Hopper) kernels share: the persistent grid, its tile order, operand layouts in
shared memory, the epilogue's vectors and stores, and GPU interpret mode.

The kernels (:mod:`pallas_kernels.w8a8_hopper`, :mod:`pallas_kernels.weight_only_hopper`) follow the layout of
JAX's own Hopper matmul example (``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``): one program per SM
walking the output tiles (:func:`snake_tile`), three warpgroups -- one issuing TMA copies into a ring of
shared-memory slots, two computing side by side, each owning ``tile_m x tile_n`` of a ``tile_m x 2 tile_n`` output
tile -- and an epilogue through shared memory (:func:`store_output`). The decode kernels
(:mod:`pallas_kernels.decode_hopper`, :mod:`pallas_kernels.kv_attention_hopper`) walk work items of their own on the
same grid and warpgroups (:func:`launch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import config

HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SMEM_BYTES = 232448 - 1024  # an H100/H200 block's opt-in shared memory, less what barriers and alignment take
DEFAULT_SMS = 132  # H100 SXM / H200: where the device does not say (a deviceless topology)
INTERPRET_SMS = 2  # interpret mode: few simulated SMs, each walking several tiles (the persistent loop is tested)
EPILOGUE_SLOTS = 2  # store pieces in flight per compute warpgroup


def is_hopper(device=None) -> bool:
    """Whether ``device`` (default: the traced-for device) has wgmma: compute capability 9.x."""
    cc = config.compute_capability(device)
    return cc is not None and cc[0] == 9


def wgmma_available() -> tuple[bool, str]:
    """(True, "") where a Mosaic GPU kernel with wgmma can run: a Hopper GPU, or interpret mode anywhere."""
    if config.interpret_enabled() or is_hopper():
        return True, ""
    return False, f"wgmma needs a Hopper GPU (sm_90); this device is {config.target_device().device_kind}"


def num_sms(interpret: bool) -> int:
    """Programs of the persistent grid: the device's SMs."""
    if interpret:
        return INTERPRET_SMS
    return int(getattr(config.target_device(), "core_count", 0) or DEFAULT_SMS)


def check_blocks(blocks, tile_k_multiple: int) -> None:
    """The tile settings a persistent kernel here takes, else a ValueError naming ``blocks``' class: output tiles in
    whole wgmma rows (64), ``tile_k`` a multiple of its operand's swizzle row, a ring of at least two slots, epilogue
    pieces dividing the tile, a snake band of at least one tile."""
    name, b = type(blocks).__name__, blocks
    if b.tile_m % 64 or b.tile_n % 64 or b.tile_k % tile_k_multiple or b.stages < 2:
        raise ValueError(f"{name}: tile_m and tile_n multiples of 64, tile_k of {tile_k_multiple}, stages >= 2; "
                         f"got {b}")
    if b.tile_m % b.epi or b.tile_n % b.epi:
        raise ValueError(f"{name}: the epilogue piece {b.epi} must divide tile_m and tile_n ({b})")
    if b.snake_width < 1:
        raise ValueError(f"{name}: snake_width must be >= 1, got {b.snake_width}")


def check_scales(name: str, scale, zero_point, bias, lead: tuple, groups: int, n: int, group) -> None:
    """One ValueError naming ``name`` where a weight-only kernel's scale ``(*lead, groups, n)``, integer zero points
    of the scale's shape, or bias ``(n,)`` are not that."""
    if scale.shape != (*lead, groups, n):
        raise ValueError(f"{name}: scale has shape {scale.shape}, expected {(*lead, groups, n)} "
                         f"({'per channel' if group is None else f'groups of {group}'})")
    if zero_point is not None and (zero_point.shape != scale.shape or not jnp.issubdtype(zero_point.dtype,
                                                                                          jnp.integer)):
        raise ValueError(f"{name}: zero_point {zero_point.shape} {zero_point.dtype}, expected integers of the "
                         f"scale's shape {scale.shape}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{name}: bias has shape {bias.shape}, expected {(n,)}")


def load(ref, layout):
    """A whole shared-memory ``ref`` loaded into registers in ``layout`` (``plgpu.load``: jax 0.10 takes the index as
    an argument, 0.11 indexes the ref itself and deprecates the argument)."""
    import inspect

    import jax.experimental.pallas.mosaic_gpu as plgpu

    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def snake_tile(t, m_tiles: int, n_tiles: int, width: int, minor_n: bool):
    """Output tile ``t``'s (row, column) block in a snake order: bands of ``width`` blocks across the minor
    dimension (N with ``minor_n``), walked along the major one, every other band backwards, so that the programs
    working at once share operand tiles in L2. (``plgpu.planar_snake`` of jax 0.10 computes a remainder by zero
    where the minor size is a multiple of the width -- e.g. Llama's 4096 / 256 -- undefined in LLVM.)"""
    minor, major = (n_tiles, m_tiles) if minor_n else (m_tiles, n_tiles)
    band, within = t // (width * major), t % (width * major)
    band_width = jnp.minimum(width, minor - band * width)  # the last band may be narrower; >= 1 for t in range
    along, across = within // band_width, within % band_width
    along = jnp.where(band % 2 == 0, along, major - 1 - along)
    across = band * width + across
    return (along, across) if minor_n else (across, along)


def swizzled(minor: int, dtype) -> tuple:
    """Shared-memory transforms of a 2-D operand tile whose rows hold ``minor`` values of ``dtype``: 8-row tiles
    as wide as the widest swizzle the row fills (what wgmma and TMA read without bank conflicts)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bits = 4 if jnp.dtype(dtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) else 8 * jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def wait_released(step, steps: int) -> None:
    """The wgmma wait closing step ``step`` of ``steps`` in a pipeline whose slots are released one step late
    (``delay_release=1``): the previous step's group, the step's own left in flight -- except on the last step, which
    waits for its own too. The pipeline never releases the last step's slot; once it returns, its memory warpgroup
    starts the next tile's copies into every slot, that one included, while the last wgmma may still be reading it.
    (Interpret mode runs wgmma synchronously and cannot show the race.)"""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    plgpu.wgmma_wait(1)

    @pl.when(step == steps - 1)
    def _last():
        plgpu.wgmma_wait(0)


def broadcast(vector, shape: tuple[int, int], along_rows: bool, interpret: bool):
    """A vector of per-column (``along_rows``: one value per column, repeated down the rows) or per-row values as an
    array of ``shape`` in the wgmma accumulator's register layout. (Indexing, ``v[None, :]``, finds no layout in
    jax 0.10.2's Mosaic GPU; interpret mode simulates no register layouts.)"""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    reduced = 0 if along_rows else 1
    if not interpret:
        vector = plgpu.layout_cast(vector, plgpu.Layout.WGMMA.reduce(reduced))
    return lax.broadcast_in_dim(vector, shape, (1 - reduced,))


def store_output(y, out_smem, o_tile, wg, epi: int) -> None:
    """Store a compute warpgroup's output tile ``y`` (registers) to ``o_tile`` (its global-memory view) by TMA, in
    ``epi x epi`` pieces through ``out_smem[wg]``'s :data:`EPILOGUE_SLOTS` slots."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rows, cols = y.shape
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores have read their slots
    pieces = [(i, j) for i in range(rows // epi) for j in range(cols // epi)]
    for p, (i, j) in enumerate(pieces):
        slot = p % EPILOGUE_SLOTS
        plgpu.wait_smem_to_gmem(EPILOGUE_SLOTS - 1, wait_read_only=True)
        out_smem[wg, slot] = y[i * epi:(i + 1) * epi, j * epi:(j + 1) * epi]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], o_tile.at[pl.ds(i * epi, epi), pl.ds(j * epi, epi)])


def output_slots(epi: int, dtype):
    """The epilogue's shared memory: :data:`EPILOGUE_SLOTS` ``epi x epi`` pieces per compute warpgroup."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.SMEM((2, EPILOGUE_SLOTS, epi, epi), dtype, transforms=swizzled(epi, dtype))


def output_bytes(epi: int, dtype) -> int:
    return 2 * EPILOGUE_SLOTS * epi * epi * jnp.dtype(dtype).itemsize


def launch(body, out_shape, out_dtype, interpret: bool, approx_math: bool = False):
    """``body`` as a persistent Mosaic GPU kernel: one program per SM (grid axis "sm"), three warpgroups (axis
    "wg": two computing, one issuing TMA copies), warpgroup-level lowering. In interpret mode, GPU interpret mode
    with :mod:`pallas_kernels.mosaic_interpret`'s wgmma. ``out_shape`` and ``out_dtype``: the one output's; or
    ``out_dtype`` None and ``out_shape`` the outputs' ``jax.ShapeDtypeStruct`` s. ``approx_math``: Mosaic GPU's
    approximate transcendental functions and division."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    params = None
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # private in jax 0.10

        from pallas_kernels import mosaic_interpret

        mosaic_interpret.install()
        params = InterpretGPUParams()
    return plgpu.kernel(
        body, out_type=out_shape if out_dtype is None else jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(num_sms(interpret),), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                             approx_math=approx_math),
        interpret=params)


def stages_that_fit(wanted: int, k_steps: int, bytes_at) -> int:
    """The ring's slots: ``wanted``, fewer where ``bytes_at(stages)`` of shared memory do not fit (at least 2),
    and no more than the K loop has steps. Raises where 2 do not fit."""
    stages = wanted
    while stages > 2 and bytes_at(stages) > SMEM_BYTES:
        stages -= 1
    if bytes_at(stages) > SMEM_BYTES:
        raise ValueError(f"needs {bytes_at(stages)} bytes of shared memory at 2 stages; at most {SMEM_BYTES}")
    return min(stages, max(2, k_steps))
