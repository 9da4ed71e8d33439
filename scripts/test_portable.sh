#!/usr/bin/env bash
# `make test-portable`: both test suites under other CPU kernels and torch thread counts than
# `make test`'s (this machine's best kernels, 1 thread per worker). torch picks its kernels by
# ATEN_CPU_CAPABILITY (default: no AVX; avx2; avx512) and its threads by OMP_NUM_THREADS:
#   default × 2 threads, avx2 × 1 thread, and avx512 × 2 threads where the CPU has AVX-512.
# Every setting runs even when one fails; the exit status is 1 when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
JOBS=${TEST_JOBS:-2}
settings=("default 2" "avx2 1")
grep -qw avx512f /proc/cpuinfo 2>/dev/null && settings+=("avx512 2")
failed=()
for setting in "${settings[@]}"; do
  read -r cap threads <<<"$setting"
  for suite in ".venv/bin/python -m pytest" ".venv-verl/bin/python -m pytest tests/verl"; do
    echo "== ATEN_CPU_CAPABILITY=$cap OMP_NUM_THREADS=$threads: $suite"
    start=$SECONDS
    if ATEN_CPU_CAPABILITY=$cap OMP_NUM_THREADS=$threads $suite -q -n "$JOBS" --dist loadfile; then
      echo "== passed in $((SECONDS - start)) s"
    else
      echo "== FAILED in $((SECONDS - start)) s"
      failed+=("$cap/$threads: ${suite%% *}")
    fi
  done
done
if ((${#failed[@]})); then
  printf 'test-portable: failed under %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "test-portable: every setting passed (${settings[*]/ /×})"
