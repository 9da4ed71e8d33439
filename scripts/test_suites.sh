#!/usr/bin/env bash
# Both test suites, each to its end whatever the other does: stppo's suite in .venv (it leaves
# tests/verl out), then the verl backend's tests in .venv-verl. Each is spread over TEST_JOBS
# pytest-xdist workers (a test file stays on one worker: its module fixtures are built once), each
# worker on TEST_THREADS torch threads. Extra arguments go to both pytest runs (`-q`, `-x`, ...).
# Prints both summaries at the end; exits 1 when either suite failed.
# `make test`, `make test-stress` and `scripts/test_portable.sh` call it.
set -uo pipefail
cd "$(dirname "$0")/.."
JOBS=${TEST_JOBS:-2}
THREADS=${TEST_THREADS:-1}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
names=("main suite (.venv)" "verl suite (.venv-verl)")
suites=(".venv/bin/python -m pytest" ".venv-verl/bin/python -m pytest tests/verl")
codes=()
for i in 0 1; do
  echo "== ${names[$i]}: ${suites[$i]}"
  start=$SECONDS
  # shellcheck disable=SC2086  # the suite's command is words
  OMP_NUM_THREADS=$THREADS ${suites[$i]} -n "$JOBS" --dist loadfile "$@" 2>&1 | tee "$logs/$i.log"
  codes+=("${PIPESTATUS[0]}")
  echo "$((SECONDS - start))" >"$logs/$i.s"
done
echo
status=0
for i in 0 1; do
  summary=$(grep -E '(passed|failed|errors?|skipped|no tests ran).* in [0-9.]+s' "$logs/$i.log" | tail -n 1 | sed -E 's/^=+ | =+$//g')
  [ -n "$summary" ] || summary="(no pytest summary: exit status ${codes[$i]})"
  verdict=passed
  if [ "${codes[$i]}" != 0 ]; then verdict=FAILED; status=1; fi
  echo "== ${names[$i]} $verdict in $(cat "$logs/$i.s") s: $summary"
done
exit $status
