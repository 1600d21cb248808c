#!/usr/bin/env bash
# Runs every test and prints one closing line: "N passed, N failed".
#   cmocka binaries in $BUILD/tests/{unit,integration}/   (each a test program)
#   tests/**/test_*.py  with /usr/bin/python3 (Debian's, which has grpcio and protobuf)
#   tests/**/test_*.sh  with bash                 (skipped with --binaries-only)
# Each runs with a time limit; a failure prints the tail of its output.
# Usage: tests/run.sh [--binaries-only | --programs-only | --unit-only] [NAME-FILTER]
#   --binaries-only   the test programs and the Python tests (no shell tests)
#   --programs-only   the test programs only (C, unit and integration)
#   TEST_WRAPPER   a command put before each test binary (e.g. valgrind ...)
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
export BUILD
only_bins=0
unit_only=0
progs_only=0
case "${1:-}" in
--binaries-only) only_bins=1; shift ;;
--programs-only) only_bins=1; progs_only=1; shift ;;
--unit-only) unit_only=1; shift ;;
esac
wrap=(${TEST_WRAPPER:-})
filter=${1:-}
limit=${TEST_TIMEOUT:-900}
logdir=$BUILD/test-logs
mkdir -p "$logdir"
pass=0
fail=0
failed=()

run_one() {
    local name=$1
    shift
    [ -n "$filter" ] && [[ "$name" != *"$filter"* ]] && return 0
    local log="$logdir/$(echo "$name" | tr '/' '_').log"
    local t0=$(date +%s%N)
    if timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1; then
        pass=$((pass + 1))
        local ms=$((($(date +%s%N) - t0) / 1000000))
        printf 'ok    %-60s %4d.%01ds\n' "$name" $((ms / 1000)) $((ms % 1000 / 100))
    else
        local rc=$?
        fail=$((fail + 1))
        failed+=("$name")
        printf 'FAIL  %-60s (exit %d)\n' "$name" "$rc"
        # the failures themselves first (unittest's FAIL:/ERROR: sections, cmocka's [  FAILED  ]
        # lines), where an excerpt of this output keeps them; then the end of the log
        grep -E -A 24 '^(FAIL|ERROR): |\[  (FAILED|ERROR) +\]' "$log" | head -n 50 | sed 's/^/      ! /'
        tail -n 60 "$log" | sed 's/^/      | /'
    fi
}

dirs=("$BUILD"/tests/unit)
[ $unit_only = 0 ] && dirs+=("$BUILD"/tests/integration)
for t in $(for d in "${dirs[@]}"; do ls "$d"/* 2>/dev/null; done | grep -v '\.d$' | sort); do
    [ -x "$t" ] && [ -f "$t" ] && run_one "$t" "${wrap[@]}" "$t"
done
if [ $unit_only = 0 ] && [ $progs_only = 0 ]; then
    for t in $(find tests -name 'test_*.py' | sort); do
        run_one "$t" /usr/bin/python3 "$t"
    done
fi
if [ $only_bins = 0 ] && [ $unit_only = 0 ]; then
    for t in $(find tests -name 'test_*.sh' | sort); do
        run_one "$t" bash "$t"
    done
fi

echo
[ ${#failed[@]} -gt 0 ] && printf 'failed: %s\n' "${failed[@]}"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
