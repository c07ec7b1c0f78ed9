#!/usr/bin/env bash
# The README's test command: builds .venv (if needed), installs the project with
# its [dev] extra at pinned versions, then runs the whole test suite.
# pytest runs one worker process per core (pytest-xdist, at most 4; a test file stays
# in one worker, so its module fixtures are built once): 21-26 minutes on 2 CPU
# cores (tests compile at LLVM -O0, fusions through the LLVM emitters: tests/xla_flags.py). LLMEQ_TEST_WORKERS=N overrides the count (0: no workers,
# everything in this process). Each phase prints its own time. Tests marked `gpu`
# are dropped by tests/conftest.py where JAX has no GPU (not counted as skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
install_venv '.[dev]'
cores=$(nproc 2>/dev/null || echo 1)
workers=${LLMEQ_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
(( workers > 1 )) || workers=0  # one worker is only overhead: run in this process
phase "pytest: whole suite on $workers worker(s) (-q progress, failures/errors summarised, 10 slowest tests)"
set +e
.venv/bin/python -m pytest -q -rfE --durations=10 -n "$workers" --dist loadfile "$@"
rc=$?
set -e
phase "done: pytest exit code $rc, total $(elapsed)"
exit $rc
