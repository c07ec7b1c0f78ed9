"""Two real processes (scripts/launch_multihost.py): sharded calibration, quantization, GPTQ and a
checkpoint written together equal one process on one device, bit for bit."""

from __future__ import annotations

import functools
import subprocess
import sys

import jax
import numpy as np

from llmeq_jax import calibrate, checkpoint, native
from llmeq_jax.core.qarray import QArray, is_qarray
from llmeq_jax.core.rules import path_str, quantize_params
from llmeq_jax.methods import quantize_model
from tests.distributed_helpers import HELPERS, REPO, subprocess_env, tiny


def test_two_processes_calibrate_and_quantize_identically(tmp_path, monkeypatch):
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "launch_multihost.py"), "--local", "2", "--cpu-devices", "2",
         "--timeout", "300", str(HELPERS / "two_process_worker.py"), str(tmp_path)],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=360,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    p0, p1 = (dict(np.load(tmp_path / f"process_{i}.npz")) for i in range(2))
    assert set(p0) == set(p1)
    for key in p0:  # both processes hold the same statistics, scales and values, bit for bit
        assert np.array_equal(p0[key], p1[key]), key
    assert not p0["meta:fully_addressable"]

    # ... and they equal one process on one device.
    params = tiny.params()
    stats, _ = calibrate.calibrate(tiny.CONFIG, params, tiny.windows(8), wants=tiny.WANTS, batch_size=2)
    qparams = quantize_params(params, tiny.recipe(), stats)
    n_stats = 0
    for path, s in stats.items():
        for k, v in s.items():
            got, want = p0[f"stats:{path}:{k}"], np.asarray(v)
            n_stats += 1
            if k in ("abs_sum", "hessian"):  # psum adds in the backend's order
                np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6, err_msg=f"{path} {k}")
            else:
                assert np.array_equal(got, want), (path, k)
    assert n_stats == len(tiny.WANTS) * 7 * tiny.CONFIG.num_layers
    n_q = 0
    for kp, leaf in jax.tree_util.tree_leaves_with_path(qparams, is_leaf=lambda x: isinstance(x, QArray)):
        if isinstance(leaf, QArray):
            for c in ("qvalue", "scale", "zero_point", "act_scale"):
                if getattr(leaf, c) is not None:
                    assert np.array_equal(p0[f"q:{path_str(kp)}:{c}"], np.asarray(getattr(leaf, c))), (kp, c)
                    n_q += 1
    assert n_q >= 3 * 7 * tiny.CONFIG.num_layers  # every kernel: values + scale + (zero point or act scale)

    # GPTQ with calibration split over the processes equals GPTQ in one process, bit for bit. Its
    # calibration forward runs the already quantized layers; one device would take the native
    # dequantized-panel GEMM for those (more than 8 rows), which a process of several devices never
    # uses (native.prefill_kernels_ok: XLA's dots), so the reference takes XLA's products there too.
    monkeypatch.setattr(native, "prefill_kernels_ok", lambda: False)
    gq, _ = quantize_model(tiny.CONFIG, params, tiny.gptq_recipe(), tiny.windows(8),
                           calibrate_fn=functools.partial(calibrate.calibrate, batch_size=1))
    monkeypatch.undo()
    n_g = 0
    for kp, leaf in jax.tree_util.tree_leaves_with_path(gq, is_leaf=is_qarray):
        if isinstance(leaf, QArray):
            for c in ("qvalue", "scale"):
                assert np.array_equal(p0[f"gptq:{path_str(kp)}:{c}"], np.asarray(getattr(leaf, c))), (kp, c)
                n_g += 1
    assert n_g == 2 * 7 * tiny.CONFIG.num_layers

    # The checkpoint both processes wrote restores in one process to the same tree, bit for bit.
    assert not list(tmp_path.glob(".ckpt.tmp-*"))
    assert checkpoint.metadata(tmp_path / "ckpt")["metadata"] == {"written_by": 2}
    restored = checkpoint.restore(tmp_path / "ckpt")
    want_leaves = jax.tree_util.tree_leaves_with_path(qparams, is_leaf=is_qarray)
    got_leaves = dict(jax.tree_util.tree_leaves_with_path(restored, is_leaf=is_qarray))
    assert len(got_leaves) == len(want_leaves)
    for kp, leaf in want_leaves:
        got = got_leaves[kp]
        if isinstance(leaf, QArray):
            assert isinstance(got, QArray) and got.bits == leaf.bits and got.tile == leaf.tile, kp
            for c in ("qvalue", "scale", "zero_point", "act_scale"):
                if getattr(leaf, c) is not None:
                    assert np.array_equal(np.asarray(getattr(got, c)), np.asarray(getattr(leaf, c))), (kp, c)
        else:
            assert np.array_equal(np.asarray(got), np.asarray(leaf)), kp
