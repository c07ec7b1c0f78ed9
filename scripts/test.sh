#!/usr/bin/env bash
# The README's test command: builds .venv (if needed), installs the project with
# its [dev] extra at pinned versions, then runs the whole test suite.
# Takes about 17-36 minutes on 2 CPU cores (most of it pytest); each phase prints
# its own time. Tests marked `gpu` are deselected by tests/conftest.py where JAX
# has no GPU (pytest reports them as "deselected", not skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
phase() { echo "== [$(( SECONDS - start ))s] $*" >&2; }
phase "venv: .venv (python3 -m venv)"
python3 -m venv .venv
phase "pip: upgrade pip"
.venv/bin/python -m pip install -q --upgrade pip
phase "pip: install -e '.[dev]' (pinned versions; slow the first time)"
.venv/bin/python -m pip install -q -e '.[dev]'
phase "pytest: whole suite (-q progress, failures/errors summarised, 10 slowest tests)"
set +e
.venv/bin/python -m pytest -q -rfE --durations=10 "$@"
rc=$?
set -e
phase "done: pytest exit code $rc, total $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
exit $rc
