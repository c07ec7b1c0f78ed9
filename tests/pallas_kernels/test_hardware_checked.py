"""Kernels not yet run on a GPU stay off a GPU's default trace (``pallas_kernels.hardware_checked``): a model traced
for a GPU with no dispatch table takes XLA's norm, float-cache step, quantized-cache write, split merge and prompt
attention until ``LLMEQ_UNCHECKED_KERNELS`` names the kernels; checked kernels and interpret mode are not gated."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmeq_jax import calibrate, dispatch_table, generate
from llmeq_jax.kv import attention, spec as kvspec
from llmeq_jax.models import ModelConfig, forward_step, init_cache, init_params, stacked
from pallas_kernels import config, hardware_checked

GPU = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
CONFIG = ModelConfig("llama", 256, 256, 2, 8, 2, 32, 512, 1e-5, 128, False)  # grouped-query: 8 heads over 2
UNCHECKED_NAMES = ("name=rms_norm", "name=append_decode_attention", "name=kv_store_append", "name=merge_splits")


@pytest.fixture(autouse=True)
def _no_table_no_switch(monkeypatch):
    """No dispatch table (the static rule and the gate alone) and no kernel turned on by the environment."""
    monkeypatch.setenv(dispatch_table.ENV, "none")
    monkeypatch.delenv(hardware_checked.ENV, raising=False)


def _decode_step_jaxpr(kv=None) -> str:
    """A one-token step of a stacked bf16 Llama over a bf16 cache (``kv``: a quantized one), traced for a GPU."""
    params = stacked.stack_blocks(CONFIG, jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                                                       init_params(CONFIG, jax.random.key(0))))
    with config.compiling_for(GPU):
        cache = init_cache(CONFIG, 1, 16, jnp.bfloat16, kv=kv)
        step = lambda p, t, c: forward_step(CONFIG, p, t, jnp.ones((1, 1), jnp.int32), c)  # noqa: E731  traced here
        return str(jax.make_jaxpr(step)(params, jnp.zeros((1, 1), jnp.int32), cache))


def _int8_cache():
    params = init_params(CONFIG, jax.random.key(0))
    calib = np.random.default_rng(3).integers(0, CONFIG.vocab_size, (2, 16))
    return calibrate.make_kv_quantizer(kvspec.KVSpec(bits=8), CONFIG, params, calib)


def test_only_kernels_checked_on_a_gpu_run_there_by_default(monkeypatch):
    with config.compiling_for(GPU):
        assert all(hardware_checked.allowed(k) for k in hardware_checked.CHECKED)
        assert not any(hardware_checked.allowed(k) for k in hardware_checked.UNCHECKED)
        monkeypatch.setenv(hardware_checked.ENV, " rms_norm, merge_splits ")
        assert [k for k in hardware_checked.UNCHECKED if hardware_checked.allowed(k)] == ["rms_norm", "merge_splits"]
        monkeypatch.setenv(hardware_checked.ENV, "all")
        assert all(hardware_checked.allowed(k) for k in hardware_checked.UNCHECKED)
    monkeypatch.delenv(hardware_checked.ENV)
    assert all(hardware_checked.allowed(k) for k in hardware_checked.UNCHECKED)  # no GPU: interpret mode's tests


def test_a_misspelt_kernel_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(hardware_checked.ENV, "rms_norm,rmsnorm")
    with config.compiling_for(GPU), pytest.raises(ValueError, match="LLMEQ_UNCHECKED_KERNELS.*rmsnorm.*rms_norm"):
        hardware_checked.allowed("rms_norm")
    with pytest.raises(ValueError, match="unknown kernel 'float'"):
        hardware_checked.allowed("float")


def test_a_gpus_float_decode_step_keeps_xlas_norm_and_attention_until_turned_on(monkeypatch):
    default = _decode_step_jaxpr()
    assert "name=float_matmul" in default  # a checked kernel still runs
    assert not any(name in default for name in UNCHECKED_NAMES)
    monkeypatch.setenv(hardware_checked.ENV, "rms_norm,append_decode_attention")
    on = _decode_step_jaxpr()
    assert on.count("name=rms_norm") == 2 and on.count("name=append_decode_attention") == 1
    monkeypatch.setenv(hardware_checked.ENV, "all")  # the norms folded into the float kernels' products too
    folded = _decode_step_jaxpr()
    assert "name=rms_norm" not in folded and folded.count("name=append_decode_attention") == 1


def test_a_gpus_quantized_cache_step_keeps_xlas_write_and_merge_until_turned_on(monkeypatch):
    kv = _int8_cache()
    default = _decode_step_jaxpr(kv)
    assert "name=decode_attention_int8" in default  # the checked KV kernel, its splits merged by XLA
    assert not any(name in default for name in UNCHECKED_NAMES)
    monkeypatch.setenv(hardware_checked.ENV, "store_append,merge_splits")
    on = _decode_step_jaxpr(kv)
    assert "name=kv_store_append_int8" in on and "name=merge_splits" in on and "name=rms_norm" not in on


def test_a_gpus_prompt_keeps_xlas_attention_until_cudnns_is_turned_on(monkeypatch):
    q = jnp.zeros((1, attention.FLASH_MIN_ROWS, 8, 32), jnp.bfloat16)
    k = jnp.zeros((1, 2, attention.FLASH_MIN_ROWS, 32), jnp.bfloat16)
    with config.compiling_for(GPU):
        assert not attention.flash_ok(q, k)
        monkeypatch.setenv(hardware_checked.ENV, "cudnn_attention")
        assert attention.flash_ok(q, k)


def test_a_decode_loop_traced_with_other_kernels_on_is_not_reused(monkeypatch):
    before = generate.kernel_state()
    monkeypatch.setenv(hardware_checked.ENV, "rms_norm")
    assert generate.kernel_state() != before


def test_the_gpu_session_turns_on_the_kernels_whose_cases_all_passed(tmp_path, capsys):
    """``python -m pallas_kernels.hardware_checked LOG...`` (scripts/gpu_session.sh, after its gpu cases): the
    unchecked kernels with a passed case and no failed one, in the verdict lines of one process or of xdist's, over
    several calls' logs; a kernel none of whose cases ran stays off."""
    case = "tests/pallas_kernels/test_gpu_kernels.py::test_kernel_matches_reference"
    first = tmp_path / "call1.log"
    first.write_text(f"[gw0] [ 10%] PASSED {case}[rms_norm(1, 4096)]\n"
                     f"[gw1] [ 20%] PASSED {case}[store_decode(1, 8)]\n"
                     f"[gw1] [ 30%] FAILED {case}[store_decode(2, 8)]\n"
                     f"[gw0] [ 40%] PASSED {case}[kv_store_append(8, 'f16')]\n"
                     f"FAILED {case}[store_decode(2, 8)] - AssertionError: [x] err 1.0 > tol 0.01\n")
    second = tmp_path / "call2.log"
    second.write_text(f"{case}[prompt_attention8] PASSED\n{case}[kv_store_append(4, 'f32')] ERROR\n")
    hardware_checked.main([str(first), str(second), str(tmp_path / "none.log")])
    assert capsys.readouterr().out.strip() == "rms_norm,cudnn_attention"
    assert hardware_checked.passed_in(first.read_text()) == ["rms_norm", "store_append"]
    assert hardware_checked.passed_in("") == []
