"""Kernel launch settings overridden for a block (pallas_kernels/settings.py): grids, numerics, refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import float_matmul, int4_words, settings, w8a8, weight_only
from pallas_kernels.blocks import Blocks


def _grids(fn, *args) -> list[tuple]:
    """The grid of every pallas_call ``fn`` traces to."""
    jaxpr = jax.make_jaxpr(lambda *a: fn(*a))(*args)  # a fresh function: make_jaxpr caches traces by function
    return [tuple(e.params["grid_mapping"].grid) for e in jaxpr.eqns if e.primitive.name == "pallas_call"]


def _int4(k=512, n=256, m=1, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.integers(-8, 8, (k, n)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.005, 0.02, (k // 128, n)), jnp.float32)
    zero = jnp.asarray(rng.integers(-3, 4, (k // 128, n)), jnp.int8)
    x = jax.random.normal(jax.random.key(seed), (m, k)).astype(jnp.bfloat16)
    return x, int4_words.pack_words(q, 128), scale, zero


def _words(x, w, s, z):
    return int4_words.int4_words_matmul(x, w, s, group=128, w_zero_point=z, interpret=True)


def test_override_changes_the_word_kernels_grid_at_decode_rows_only():
    x, w, s, z = _int4()
    x_prefill = jnp.zeros((settings.DECODE_ROWS + 1, x.shape[1]), x.dtype)
    default, prefill = _grids(_words, x, w, s, z), _grids(_words, x_prefill, w, s, z)
    with settings.override("int4_words", bn=64, k_splits=2):
        assert _grids(_words, x, w, s, z) == [(1, 256 // 64, 2)] != default
        assert _grids(_words, x_prefill, w, s, z) == prefill  # beyond decode rows: the kernel's own launch
    assert _grids(_words, x, w, s, z) == default


def test_programs_sets_the_split_target():
    x, w, s, z = _int4(k=4096, n=256)
    with settings.override("int4_words", programs=8):  # 2 column tiles of 128: 4 splits reach 8 programs
        assert _grids(_words, x, w, s, z) == [(1, 2, 4)]
    with settings.override("int4_words", programs=64):  # 32 K blocks, at least 4 a split: 8 splits at most
        assert _grids(_words, x, w, s, z) == [(1, 2, 8)]


def test_explicit_arguments_win_over_the_override():
    x, w, s, z = _int4()
    with settings.override("int4_words", bn=64, k_splits=2):
        grids = _grids(lambda *a: int4_words.int4_words_matmul(*a[:3], group=128, w_zero_point=a[3], k_splits=1,
                                                               blocks=Blocks(16, 128, 128, 4, 3), interpret=True),
                       x, w, s, z)
    assert grids == [(1, 2, 1)]


@pytest.mark.parametrize("fields", [dict(bn=64, bk=256, stages=2, k_splits=2), dict(epilogue="mma", warps=2),
                                    dict(programs=64, bk=512)])
def test_the_word_kernel_under_settings_matches_its_reference(fields):
    x, w, s, z = _int4(k=1024, n=192, m=3, seed=len(fields))
    with settings.override("int4_words", **fields):
        got = _words(x, w, s, z)
    want = int4_words.int4_words_reference(x, w, s, group=128, w_zero_point=z)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2,
                               atol=1e-2 * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))


def test_the_other_kernels_take_their_settings():
    rng = np.random.default_rng(1)
    k, n = 768, 192  # 6 K blocks of 128: 3 splits of 2
    q = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.001, 0.01, (1, n)), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (2, k)).astype(jnp.bfloat16)
    wf = jax.random.normal(jax.random.key(2), (k, n)).astype(jnp.bfloat16)
    calls = {
        "int8_f16": lambda: weight_only.weight_only_matmul(x, q.T, scale, bits=8, w_layout="nk", dequant="f16",
                                                           interpret=True),
        "weight_only": lambda: weight_only.weight_only_matmul(x, q.T, scale, bits=8, w_layout="nk", interpret=True),
        "w8a8": lambda: w8a8.w8a8_matmul(x, q.T, scale, w_layout="nk", interpret=True),
        "float_matmul": lambda: float_matmul.float_matmul(x, wf, interpret=True),
    }
    wants = {"int8_f16": weight_only.weight_only_reference(x, q, scale, bits=8),
             "float_matmul": jnp.dot(x.astype(jnp.float32), wf.astype(jnp.float32))}
    wants["weight_only"] = wants["int8_f16"]
    wants["w8a8"] = w8a8.w8a8_reference(x, q, scale)
    for name, call in calls.items():
        with settings.override(name, bn=32, bk=128, k_splits=3):
            assert _grids(call)[-1] == (1, n // 32, 3), name
            got = call()
        want = wants[name]
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2,
                                   atol=2e-2 * float(jnp.max(jnp.abs(want.astype(jnp.float32)))), err_msg=name)
        assert _grids(call)[-1] != (1, n // 32, 3), name  # outside the block: the kernel's own launch


def test_overrides_nest_and_are_hashable_state():
    assert settings.current() == ()
    with settings.override("int4_words", bn=64):
        with settings.override("int8_f16", stages=4), settings.override("int4_words", bn=256):
            assert dict(settings.current()) == {"int4_words": settings.Settings(bn=256),
                                                "int8_f16": settings.Settings(stages=4)}
            hash(settings.current())
        assert settings.of("int4_words", 1) == settings.Settings(bn=64)
        assert settings.of("int8_f16", 1) is settings.NONE
    assert settings.current() == ()


@pytest.mark.parametrize("kernel, fields, message", [
    ("int5_words", {}, "unknown kernel 'int5_words'"),
    ("int4_words", {"tile": 3}, "unknown field(s) tile"),
    ("int4_words", {"bn": 0}, "int4_words.bn must be a positive integer"),
    ("int4_words", {"stages": True}, "must be a positive integer"),
    ("int8_f16", {"epilogue": "mma"}, "epilogue belongs to int4_words,"),
    ("int4_words", {"epilogue": "cols"}, "one of ('rows', 'mma')"),
    ("int4_words", {"convert": "xla"}, "convert belongs to int8_f16,"),
    ("int8_f16", {"convert": "host"}, "one of ('kernel', 'xla')"),
    ("weight_only", {"norm": "apart"}, "norm belongs to int4_words, float_matmul, int8_f16, w8a8,"),
    ("int8_f16", {"codes": "xla"}, "codes belongs to w8a8,"),
    ("float_matmul", {"norm": "after"}, "one of ('fold', 'apart')"),
])
def test_bad_settings_are_refused(kernel, fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        with settings.override(kernel, **fields):
            pass
    assert settings.current() == ()


def test_a_setting_the_kernel_cannot_take_fails_its_own_check():
    x, w, s, z = _int4()
    with settings.override("int4_words", bk=192), pytest.raises(ValueError, match="K block must be 128"):
        _words(x, w, s, z)


def test_parse_reads_a_command_lines_setting():
    assert settings.parse("int4_words:bn=256,stages=4") == ("int4_words", {"bn": 256, "stages": 4})
    assert settings.parse("int4_words:epilogue=mma") == ("int4_words", {"epilogue": "mma"})
    assert settings.parse("float_matmul:norm=apart") == ("float_matmul", {"norm": "apart"})
    assert settings.parse("int8_f16") == ("int8_f16", {})
    assert settings.parse("int8_f16:convert=xla,bn=128") == ("int8_f16", {"convert": "xla", "bn": 128})
    with pytest.raises(ValueError, match="'bn' in 'int4_words:bn' is not name=value"):
        settings.parse("int4_words:bn")
    with pytest.raises(ValueError, match="'x' in 'int4_words:bn=x' is not an integer"):
        settings.parse("int4_words:bn=x")
    with pytest.raises(ValueError, match="unknown kernel"):
        settings.parse("int9:bn=64")
