"""Every concern of llmeq_jax/distributed/ on 8 host devices, in a subprocess (so this suite keeps its single
device): bit-identical sharded quantization, sharded calibration, the model on a mesh, checkpoint shardings."""

from __future__ import annotations

import subprocess
import sys

from tests.distributed_helpers import HELPERS, REPO, subprocess_env


def test_eight_device_checks():
    """Bit-identical sharded quantization, sharded calibration, model and checkpoint on 8 devices."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HELPERS / "eight_device_checks.py")],
        cwd=REPO, env=subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
