"""pallas_kernels.mosaic_interpret: GPU interpret mode compiles each simulated thread's program once."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import mosaic_interpret
from pallas_kernels.weight_only_hopper import WeightOnlyBlocks, weight_only_hopper


def test_a_kernels_threads_and_later_calls_share_one_compiled_program(monkeypatch):
    """A persistent kernel's three warpgroups on each of its simulated SMs run one jaxpr: compiled once on the first
    call, not again on the second (JAX's own interpreter compiled it in every thread of every call), and the product
    is still right -- the threads' program computes, it is not skipped."""
    monkeypatch.setattr(mosaic_interpret, "_THREAD_PROGRAMS", {})
    compiles = []  # programs lowered through jax.stages (the interpreter's threads' way; a jitted call is not)
    lower = jax.stages.Traced.lower
    monkeypatch.setattr(jax.stages.Traced, "lower", lambda self, *a, **k: compiles.append(1) or lower(self, *a, **k))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 256)), jnp.bfloat16)
    codes = jnp.asarray(rng.integers(-127, 128, (256, 128)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.01, 0.02, (1, 128)), jnp.float32)
    run = jax.jit(lambda x, q, s: weight_only_hopper(x, q, s, blocks=WeightOnlyBlocks(tile_m=64, tile_n=64, stages=2),
                                                     interpret=True))
    first = run(x, codes, scale)
    programs = len(mosaic_interpret._THREAD_PROGRAMS)
    assert programs == 1 and len(compiles) == programs
    second = run(x, codes, scale)
    assert len(mosaic_interpret._THREAD_PROGRAMS) == programs and len(compiles) == programs
    want = np.asarray(x, np.float32) @ (np.asarray(codes, np.float32) * np.asarray(scale))
    np.testing.assert_allclose(np.asarray(first, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


def test_the_interpreter_still_runs_each_thread_through_the_function_replaced():
    """Canary: the thread-map callback looks ``_run_jaxpr`` up by name when it starts a thread, so replacing it takes
    effect. When JAX renames it, the kernels still run (slowly) and this fails: find the new place, or drop the
    replacement if JAX caches the compile itself."""
    from jax._src.pallas.mosaic.interpret import thread_map

    mosaic_interpret.install()
    assert thread_map._run_jaxpr is mosaic_interpret._run_thread
    assert "_run_jaxpr" in thread_map._thread_map_callback.__code__.co_names
