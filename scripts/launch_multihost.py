#!/usr/bin/env python
"""Run a Python script as one process of a multi-process JAX job (``jax.distributed.initialize``).

One process per host (GPUs or CPUs), each started with its own id::

    python scripts/launch_multihost.py --coordinator 10.0.0.1:7777 --num-processes 2 --process-id 0 job.py ARGS
    python scripts/launch_multihost.py --coordinator 10.0.0.1:7777 --num-processes 2 --process-id 1 job.py ARGS

or all processes on this machine (testing; picks a free port on 127.0.0.1, starts and
always stops the children, fails if any fails or the timeout passes)::

    python scripts/launch_multihost.py --local 2 --cpu-devices 2 job.py ARGS

``job.py`` runs as ``__main__`` after ``initialize``, so ``jax.devices()`` already lists the
devices of every process. On CPU the collectives go over gloo; ``--cpu-devices K`` gives
each process K CPU devices. GPUs need no extra flag.
"""

from __future__ import annotations

import argparse
import os
import runpy
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(n: int, cpu_devices: int | None, timeout: float, script: str, script_args: list[str]) -> int:
    """Start ``n`` processes of this launcher on 127.0.0.1 and wait for all of them."""
    addr = f"127.0.0.1:{free_port()}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    procs: list[subprocess.Popen] = []
    try:
        for i in range(n):
            cmd = [sys.executable, __file__, "--coordinator", addr, "--num-processes", str(n), "--process-id", str(i)]
            if cpu_devices:
                cmd += ["--cpu-devices", str(cpu_devices)]
            procs.append(subprocess.Popen(cmd + [script, *script_args], env=env))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                print(f"launch_multihost: timeout after {timeout:.0f}s; stopping the processes", file=sys.stderr)
                return 124
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one failed: the others would wait for it forever
            time.sleep(0.2)
        codes = [p.returncode for p in procs]
        bad = [(i, c) for i, c in enumerate(codes) if c not in (0, None)]
        if bad:
            print(f"launch_multihost: process(es) failed: {bad}", file=sys.stderr)
            return 1
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", help="HOST:PORT of process 0's coordinator service")
    ap.add_argument("--num-processes", type=int)
    ap.add_argument("--process-id", type=int)
    ap.add_argument("--local", type=int, metavar="N", help="start N processes on 127.0.0.1 instead")
    ap.add_argument("--cpu-devices", type=int, help="CPU devices per process (CPU backend)")
    ap.add_argument("--timeout", type=float, default=600.0, help="with --local: seconds before all are stopped")
    ap.add_argument("script", help="Python script to run in every process")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if not Path(a.script).is_file():
        ap.error(f"script {a.script!r} does not exist")
    if a.local is not None:
        if a.local < 1:
            ap.error("--local needs N >= 1")
        return run_local(a.local, a.cpu_devices, a.timeout, a.script, a.args)
    if a.coordinator is None or a.num_processes is None or a.process_id is None:
        ap.error("give --coordinator, --num-processes and --process-id (or --local N)")
    sys.path.insert(0, str(REPO))
    from llmeq_jax import distributed

    try:
        distributed.initialize(a.coordinator, a.num_processes, a.process_id, cpu_devices=a.cpu_devices)
    except distributed.DistributedError as e:
        ap.error(str(e))
    sys.argv = [a.script, *a.args]
    runpy.run_path(a.script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
