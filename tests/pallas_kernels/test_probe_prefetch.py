"""scripts/probe_prefetch.py: the layer loop it times computes what it says with and without the prefetch (interpret
mode on the CPU), the prefetch reads the bytes it says, and the script refuses what it cannot time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import config
from pallas_kernels import int4_words as iw
from tests.scripts_loader import load_script

K, N, LAYERS = 256, 384, 3


@pytest.fixture(scope="module")
def probe():
    return load_script("probe_prefetch")


@pytest.fixture(scope="module")
def stacks(probe):
    return probe.stacked_weights(K, N, LAYERS)


def _reference(probe, h, words, scales, window):
    """The loop in plain jnp: the window's norms, then the layer's product through the word kernel's reference."""
    for layer in range(words.shape[0]):
        v = h
        for _ in range(window):
            v = h + probe.rms_norm(v) * 0.5
        y = iw.int4_words_reference(v.astype(jnp.bfloat16), words[layer], scales[layer], group=probe.GROUP)
        h = v + jnp.tile(y.astype(jnp.float32), (1, -(-K // N)))[:, :K] * 1e-3
    return h


@pytest.mark.parametrize("stream", [None, "main", "side"])
def test_the_loop_is_the_window_then_the_product_whatever_the_prefetch(probe, stacks, stream):
    words, scales = stacks
    h = jax.random.normal(jax.random.key(1), (1, K), jnp.float32)
    with config.interpret(True):
        got = jax.jit(lambda h, w, s: probe.layer_loop(h, w, s, window=2, stream=stream, nbytes=8192))(
            h, words, scales)
    want = _reference(probe, h, words, scales, window=2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-3)
    assert float(jnp.abs(got - h).max()) > 1e-2  # the window and the product changed the row


def test_the_window_alone_has_no_product(probe, stacks):
    words, scales = stacks
    h = jax.random.normal(jax.random.key(2), (1, K), jnp.float32)
    got = probe.layer_loop(h, words, scales, window=1, product=False)
    want = h
    for _ in range(LAYERS):
        want = want + probe.rms_norm(want) * 0.5
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


def test_prefetch_rows_are_the_layers_first_bytes(probe):
    assert probe.prefetch_rows((8, 512, 22016), 16 << 20) == (16 << 20) // (4 * 22016)
    assert probe.prefetch_rows((8, 512, 1024), 16 << 20) == 512  # 16 MB of a 2 MB layer: all of it


def test_variants_name_what_they_time(probe):
    names = probe.variants(3, (8, 16), side=True)
    assert list(names)[:3] == ["window only", "product only", "both"]
    assert names["side 16 MB"] == (dict(window=3, stream="side", nbytes=16 << 20), "lhs")
    assert probe.variants(1, (0.5,), side=False)["main 0.5 MB"][0]["nbytes"] == 1 << 19
    assert "side 8 MB" not in probe.variants(3, (8,), side=False)
    both = probe.variants(3, (8,), side=False, graphs=("lhs", "concurrent"))
    assert both["main 8 MB, concurrent"] == (dict(window=3, stream="main", nbytes=8 << 20), "concurrent")
    assert probe.GRAPHS["concurrent"] == {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


def test_an_unknown_stream_is_refused(probe, stacks):
    words, scales = stacks
    with pytest.raises(ValueError, match="stream must be one of"):
        probe.layer_loop(jnp.ones((1, K)), words, scales, stream="l2", nbytes=4096)


@pytest.mark.parametrize("argv, message", [
    (["--weights", "100x256"], "--weights"),
    (["--mb", "0"], "--mb"),
    (["--layers", "1"], "--layers"),
    (["--graphs", "serial"], "--graphs"),
    ([], "no GPU found"),
])
def test_the_script_refuses_what_it_cannot_time(probe, argv, message, capsys):
    with pytest.raises(SystemExit):
        probe.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("stream, annotated, barrier",
                         [("side", True, False), ("main", False, True), (None, False, False)])
def test_lowered_for_cuda_the_prefetch_is_there_and_on_its_stream(probe, stacks, stream, annotated, barrier):
    """What a GPU compiles: the XOR reduction (live: the product's x depends on it), on the second stream for "side"
    (XLA's explicit stream annotation), kept a kernel of its own for "main"; one word kernel either way."""
    words, scales = stacks
    text = jax.jit(lambda h, w, s: probe.layer_loop(h, w, s, window=2, stream=stream, nbytes=8192)).trace(
        jnp.ones((1, K)), words, scales).lower(lowering_platforms=("cuda",)).as_text()
    assert ("stablehlo.xor" in text) == (stream is not None)
    assert ('_xla_stream_annotation = "1"' in text) == annotated
    assert ("optimization_barrier" in text) == barrier
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_a_run_times_every_variant_and_checks_its_output(probe, capsys):
    """The whole run on the CPU (interpret mode; its times mean nothing here): a row per variant and command-buffer
    scheduling (compiled with its option), the prefetch rows with their ideal saving, and every variant with a
    product giving the baseline's output bit for bit."""
    with config.interpret(True):
        rows = probe.run(weights=((K, N),), layers=2, window=1, mbs=(0.02, 1000), reps=1)
    by_name = {r["variant"]: r for r in rows}
    plain = {"window only", "product only", "both", "main 0.02 MB", "side 0.02 MB"}  # 1000 MB: > a layer
    assert set(by_name) == plain | {f"{name}, concurrent" for name in plain}
    assert all(by_name[f"{name}, concurrent"]["graph"] == "concurrent" for name in plain)
    for name in ("main 0.02 MB", "side 0.02 MB", "main 0.02 MB, concurrent"):
        assert by_name[name]["same_output"] is True and by_name[name]["ideal_us"] > 0
    assert all(by_name[name]["same_output"] is None for name in ("window only", "product only", "both"))
    assert by_name["both"]["ideal_us"] is None and all(r["us"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert printed.count("output: same") == 4 and "DIFFERENT" not in printed
