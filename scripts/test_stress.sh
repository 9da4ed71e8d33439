#!/usr/bin/env bash
# `make test-stress`: both suites (scripts/test_suites.sh) with the CPU kept busy — one spinning
# process per core beside the suite's own workers — as on a user's busy laptop or a CI machine
# whose cores are shared. A test whose verdict hangs on timing (a sleep, a poll, a race with a
# monitor, a server or a file) fails here first. STRESS_RUNS=N repeats the whole run N times
# (default 1) and stops at the first failing run. The busy processes are stopped by their own
# process ids when it ends, however it ends.
set -uo pipefail
cd "$(dirname "$0")/.."
RUNS=${STRESS_RUNS:-1}
cores=$(nproc 2>/dev/null || sysctl -n hw.ncpu)
busy=()
suite=""
stop_busy() { ((${#busy[@]})) && kill "${busy[@]}" 2>/dev/null; wait "${busy[@]}" 2>/dev/null; busy=(); }
stop_all() {  # the suites' process group (pytest, its workers, what they started), then the busy ones
  [ -n "$suite" ] && kill -TERM -- "-$suite" 2>/dev/null
  stop_busy
}
trap stop_all EXIT
trap 'exit 130' INT TERM
for ((c = 0; c < cores; c++)); do
  # shellcheck disable=SC2016
  bash -c 'while :; do :; done' &
  busy+=("$!")
done
echo "== test-stress: $cores busy processes (${busy[*]}) beside the suites, $RUNS run(s)"
for ((run = 1; run <= RUNS; run++)); do
  echo "== test-stress: run $run of $RUNS"
  # in its own process group and waited for: a signal to this script is handled at once (bash
  # runs a trap only after a foreground command ends) and stops the whole group
  setsid bash scripts/test_suites.sh "$@" &
  suite=$!
  wait "$suite"
  status=$?
  suite=""
  if ((status != 0)); then
    echo "test-stress: run $run of $RUNS FAILED" >&2
    exit 1
  fi
done
echo "test-stress: $RUNS run(s) passed with $cores busy processes"
