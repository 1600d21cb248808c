#!/usr/bin/env bash
# Every benchmark names its baseline's configuration in its output (a line "baseline: ..."), so
# that no bench can silently compare against a handicapped limit: the reader sees which setting
# of the limit was measured (and, where the limit has a knob, that the best one was kept).
# This is a check of the scripts' text, not a timing.
set -euo pipefail
cd "$(dirname "$0")/../.."
fail=0 n=0
for b in bench/*/bench.sh; do
    n=$((n + 1))
    # a quoted string, outside a comment, that starts the "baseline:" line of the output (read
    # whole: a `grep -q` after a pipe exits early, and pipefail reports the writer's SIGPIPE)
    text=$(grep -vE '^[[:space:]]*#' "$b" || true)
    if ! grep -E "[\"'][^\"']*baseline: [^\"']+" <<<"$text" >/dev/null; then
        echo "FAIL: $b prints no \"baseline: <what and which configuration>\" line"
        fail=1
    fi
done
[ "$n" -gt 0 ] || { echo "FAIL: no bench/*/bench.sh found"; exit 1; }
[ $fail = 0 ] && echo "test_baselines: $n benches name their baseline"
exit $fail
