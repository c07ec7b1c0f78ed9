#!/usr/bin/env bash
# The README's test command: builds .venv (if needed), installs the project with
# its [dev] extra at pinned versions, then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
exec .venv/bin/python -m pytest -q "$@"
