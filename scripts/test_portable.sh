#!/usr/bin/env bash
# `make test-portable`: both test suites under other CPU kernels and torch thread counts than
# `make test`'s (this machine's best kernels, 1 thread per worker). torch picks its kernels by
# ATEN_CPU_CAPABILITY (default: no AVX; avx2; avx512) and its threads by OMP_NUM_THREADS:
#   default × 2 threads, avx2 × 1 thread, and avx512 × 2 threads where the CPU has AVX-512.
# A CPU without AVX-512 lacks oneDNN's AVX-512 kernels too: ONEDNN_MAX_CPU_ISA caps them with
# ATen's (on an AVX-512 machine, torch's bfloat16 attention otherwise takes oneDNN's AVX-512
# packing from ATen's plain kernels and fails: "pack_vnni2 is only supported when avx512 is
# supported").
# Every setting runs both suites (scripts/test_suites.sh) even when one fails; the exit status is 1
# when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
JOBS=${TEST_JOBS:-2}
settings=("default 2 SSE41" "avx2 1 AVX2")
grep -qw avx512f /proc/cpuinfo 2>/dev/null && settings+=("avx512 2 ALL")
failed=()
for setting in "${settings[@]}"; do
  read -r cap threads isa <<<"$setting"
  echo "== ATEN_CPU_CAPABILITY=$cap ONEDNN_MAX_CPU_ISA=$isa, $threads torch thread(s) per worker"
  if ! ATEN_CPU_CAPABILITY=$cap ONEDNN_MAX_CPU_ISA=$isa TEST_JOBS=$JOBS TEST_THREADS=$threads \
      bash scripts/test_suites.sh -q; then
    failed+=("$cap/$threads")
  fi
done
if ((${#failed[@]})); then
  printf 'test-portable: failed under %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "test-portable: every setting passed (${#settings[@]} settings × 2 suites)"
