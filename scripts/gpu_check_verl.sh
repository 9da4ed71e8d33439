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
# What it needs beyond the GPU image (Python 3.12, torch 2.11, transformers 5.17, numpy, pandas,
# pyarrow, pillow, scipy, accelerate, peft, pytest, ...): the wheels of
# scripts/gpu_requirements_verl.txt, installed with --no-deps (verl's metadata pins
# transformers<5.11; this path runs with 5.17). Ray is imported by `import verl` but no cluster
# starts here, so its wheel (76 MiB) goes stripped (scripts/strip_ray_wheel.py: 13.7 MiB). 25
# wheels, 20.7 MiB in all (measured with ray 2.60.0). Built where there is network:
#   D=wheels/verl-gpu; RAW=wheels/verl-gpu-raw; mkdir -p $D $RAW   # (wheels/ is git-ignored)
#   grep -v -e '^#' -e antlr4 scripts/gpu_requirements_verl.txt > $RAW/req.txt
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d $RAW -r $RAW/req.txt
#   python3 -m pip wheel --no-deps -w $RAW antlr4-python3-runtime==4.9.3   # a source release only
#   python3 scripts/strip_ray_wheel.py $RAW/ray-2.60.0-cp312-*.whl $D
#   find $RAW -name '*.whl' ! -name 'ray-*' -exec cp {} $D \;
# Carry wheels/verl-gpu (only; not the raw folder). On the GPU machine (repository root):
#   python3 -m pip install --no-deps --target /tmp/site wheels/verl-gpu/*.whl
#   PYTHONPATH=/tmp/site bash scripts/gpu_check_verl.sh
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
    sys.exit(f"gpu_check_verl: {e}; install the wheels of scripts/gpu_requirements_verl.txt with --no-deps "
             "(see this script's header)")
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
