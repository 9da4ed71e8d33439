#!/usr/bin/env bash
# The GPU run: every GPU figure from one entry under one deadline (scripts/gpu_run.py has the
# parts, their budgets and what each prints; docs/scaling.md, "The GPU run").
#   OUT=DIR DEADLINE_S=480 bash scripts/gpu_run.sh [PART ...]
# On the GPU machine it first installs the .gpu parts that are here (scripts/gpu_install.sh:
# the wheels of `make gpu-wheels` and SmolLM2's weights); PYTHON picks the interpreter (python3).
# GPU_RUN_DRY=1: the CPU dry run (tests/test_gpu_run.py), no install.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python3}
if [ "${GPU_RUN_DRY:-0}" != 1 ]; then
  bash scripts/gpu_install.sh || exit 1
fi
exec "$PYTHON" scripts/gpu_run.py "$@"
