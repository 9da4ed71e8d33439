#!/usr/bin/env bash
# The verl GPU check: verl 0.9.1's own actor update on one CUDA GPU — `ActorRolloutRefWorker(role=
# "actor")` from verl's ppo_trainer config with stppo's translated overrides, FSDP2 with verl's
# default bf16 mixed precision (float32 master weights), sdpa attention, sequence packing,
# micro-batches, verl's ppo_loss calling the stppo_<preset> loss — for every paper preset
# (ppo, turn_ppo, s_ppo, st_ppo, so_ppo, grpo, gspo, so_grpo) on a random-init Qwen2 (hidden 64,
# 2 layers): tests/verl/test_verl_actor_update.py with STPPO_TEST_DEVICE=cuda. Prints, per preset,
# the update_actor time and the packed log-probs' gap to a float32 transformers forward, then
# stppo_ppo vs verl's vanilla (pg_loss, grad norm) through the same update. Exits non-zero on any
# failure; with no CUDA device (or no verl) it ends in one line and exits 1.
#
# What it needs beyond the GPU image (Python 3.12, torch, transformers 5.17, numpy, pandas, pyarrow,
# scipy, accelerate, pytest, ...): the wheels `make gpu-wheels` puts in .gpu/ (verl's are listed in
# scripts/gpu/requirements-verl.txt; installed with --no-deps, since verl's metadata pins
# transformers<5.11 and this path runs with 5.17). `scripts/gpu_run.sh verl-update` installs them and
# runs this script; to run it alone, put those packages on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${GPU_CHECK_LOG:-$(mktemp)}

"$PY" - <<'PY'
import sys
try:
    import torch
except ImportError as e:
    sys.exit(f"gpu_check_verl: torch cannot be imported ({e})")
if not torch.cuda.is_available():
    sys.exit("gpu_check_verl: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine")
try:
    import ray, tensordict, transformers, verl  # noqa: F401
except ImportError as e:
    sys.exit(f"gpu_check_verl: {e}; install the wheels of `make gpu-wheels` (scripts/gpu_run.sh verl-update "
             "does)")
print(f"gpu_check_verl: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, verl {verl.__version__}, "
      f"transformers {transformers.__version__}, ray {ray.__version__}")
PY

status=0
STPPO_TEST_DEVICE=cuda "$PY" -m pytest -q -s -p no:cacheprovider tests/verl/test_verl_actor_update.py \
    > "$LOG" 2>&1 || status=$?
grep -E '^verl_actor_update:' "$LOG" | sed 's/^verl_actor_update/gpu_check_verl/' || true
if [ "$status" -ne 0 ]; then
    grep -E '^(E |FAILED|ERROR)' "$LOG" | head -40 || true
    tail -n 3 "$LOG"
    echo "gpu_check_verl: FAILED (pytest exit $status; full log: $LOG)"
    exit "$status"
fi
tail -n 1 "$LOG"
echo "gpu_check_verl: OK (full log: $LOG)"
