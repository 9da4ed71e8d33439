#!/usr/bin/env bash
# Study v3, part 3 on one GPU machine (docs/results/staleness/README.md): the size ladder
# tiny < small < base (random-init Qwen2 with the task's BPE, warm started like tiny) at `l1f`,
# ppo, st_ppo, grpo and so_grpo at lags 0, 2 and 8, seeds 0-2, as independent single runs that
# share the GPU (JOBS at a time, one CPU thread each), in float32 like the CPU runs (bfloat16
# autocast would add a sampler/trainer mismatch of its own). Every run writes its own MLflow store
# (sqlite; no writer waits on another), so a run killed at the deadline loses only itself.
#   bash scripts/staleness_gpu.sh OUT [SECONDS]
# runs cells in the order model > seed > preset > lag (a deadline cuts the last model's last
# seeds), starts no run that would not end in time (its model's longest finished run so far, at
# least MIN_LEFT seconds), stops every run at SECONDS (default 420), and
# packs the stores and logs into OUT/stores.tgz. Back here, the stores become one parquet folder:
#   python -m analysis.export --experiment staleness_size_gpu --tracking-uri sqlite:///STORE.db ...
#       --finished-only --out DIR        (one --tracking-uri per store; docs/usage.md)
# Python packages: torch (CUDA) and transformers from the machine; the rest as wheels in
# .gpu/study (`make gpu-wheels`, then its own and rollout wheels: cp .gpu/cache/{own,rollout}/*.whl
# .gpu/study/), installed into .gpu/site-study without the network when mlflow or hydra is missing.
# Environment: PYTHON (python3), JOBS (10; at 14, 7 of 36 `base` runs ran out of an H100's
# memory), MIN_LEFT (60), MODELS ("base small tiny"), PRESETS ("ppo st_ppo grpo so_grpo"), LAGS ("0 2 8"), SEEDS ("0 1 2"), EXTRA (more overrides),
# DEVICE (cuda; cpu to try the script here), STALENESS_GPU_DIR (/tmp/staleness_gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:?usage: staleness_gpu.sh OUT [SECONDS]}
SECONDS_ALL=${2:-420}
JOBS=${JOBS:-10}
MIN_LEFT=${MIN_LEFT:-60}
END=$(( $(date +%s) + SECONDS_ALL ))
WORK=${STALENESS_GPU_DIR:-/tmp/staleness_gpu}
SITE=.gpu/site-study
mkdir -p "$OUT" "$WORK/stores" "$WORK/logs"

if ! "$PY" -c "import mlflow, hydra" 2>/dev/null && [ ! -f "$SITE/.done" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        .gpu/study/*.whl || { echo "staleness_gpu: installing .gpu/study's wheels failed"; exit 1; }
    touch "$SITE/.done"
fi
export PYTHONPATH="$PWD:$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
export STPPO_CACHE_DIR=$WORK/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export OMP_NUM_THREADS=1 END MIN_LEFT PY WORK EXTRA="${EXTRA:-}"
export DEVICE=${DEVICE:-cuda}
"$PY" -c "import sys, torch, mlflow, hydra
if sys.argv[1] == 'cuda' and not torch.cuda.is_available(): sys.exit('staleness_gpu: no CUDA device')
print('staleness_gpu:', torch.cuda.get_device_name(0) if sys.argv[1] == 'cuda' else 'cpu', 'torch', torch.__version__)" "$DEVICE" || exit 1

cell() {  # cell SEED MODEL PRESET LAG: one run, unless too little time is left
    local name="$2-$3-lag$4-s$1" left=$(( END - $(date +%s) )) need
    # the longest finished run of this model so far, at least MIN_LEFT: a run that cannot end
    # before the deadline is not started
    need=$(awk -v m="$2-" -v n="$MIN_LEFT" '$1 == "done" && index($2, m) == 1 && $5 > n {n = $5}
                                           END {print n + 0}' "$WORK/progress.txt" 2>/dev/null || echo "$MIN_LEFT")
    if [ "$left" -lt "${need:-$MIN_LEFT}" ]; then echo "skip $name (${left}s left, ${need}s needed)"; return 0; fi
    local t0=$(date +%s)
    # shellcheck disable=SC2086
    timeout "$left" "$PY" run.py +experiment=frontier +level=l1f model="$2" algo="$3" \
        trainer.offpolicy.lag="$4" seed="$1" trainer.device="$DEVICE" model.dtype=float32 \
        model.param_dtype=float32 trainer.threads=1 trainer.progress=false tracking.experiment=staleness_size_gpu \
        tracking.uri="sqlite:///$WORK/stores/$name.db" trainer.out_dir="$WORK/runs/$name" \
        hydra.run.dir="$WORK/hydra/$name" $EXTRA >"$WORK/logs/$name.log" 2>&1
    echo "done $name rc $? $(( $(date +%s) - t0 ))"
}
export -f cell

for model in ${MODELS:-base small tiny}; do
    for seed in ${SEEDS:-0 1 2}; do
        for preset in ${PRESETS:-ppo st_ppo grpo so_grpo}; do
            for lag in ${LAGS:-0 2 8}; do echo "$seed $model $preset $lag"; done
        done
    done
done > "$WORK/cells.txt"
: > "$WORK/progress.txt"

# Parallel runs of one model share its warm start: the first trains it under a lock, the rest
# wait and load it (stppo.train.setup.warm_start).
xargs -P "$JOBS" -L 1 bash -c 'cell "$@"' _ < "$WORK/cells.txt" >> "$WORK/progress.txt"; cat "$WORK/progress.txt"
echo "staleness_gpu: $(grep -c '^done .* rc 0 ' "$WORK/progress.txt") runs finished," \
     "$(grep -c '^skip' "$WORK/progress.txt") skipped, $(grep -c '^done' "$WORK/progress.txt") started"
tar czf "$OUT/stores.tgz" -C "$WORK" stores logs progress.txt cells.txt
