#!/usr/bin/env bash
# The README's first command: sets up .venv and runs the main job
# (`llmeq compare` on smollm2-135m over the ready recipes).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e .
if ! .venv/bin/python -c "import llmeq_jax.cli" 2>/dev/null; then
  echo "llmeq compare is not yet available (it lands with the evaluation/CLI issue)."
  exit 0
fi
exec .venv/bin/llmeq main "$@"
