#!/usr/bin/env bash
# Runs a libFuzzer binary for a bounded time with a scratch corpus (committed seed folders are
# read, never written), keeps a crashing input under ARTIFACTS, and prints one closing line.
# Usage: tests/lib/fuzz_run.sh NAME BINARY SECONDS ARTIFACTS [libFuzzer flags and seed dirs...]
set -euo pipefail
name=$1 bin=$2 seconds=$3 artifacts=$4
shift 4
mkdir -p "$artifacts"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/corpus"
# libFuzzer writes new inputs to the first corpus folder: the scratch one goes first
"$bin" "$work/corpus" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$artifacts/" "$@" >"$work/log" 2>&1 || {
    tail -n 60 "$work/log"
    echo "$name: FAILED (input kept in $artifacts; run the binary with it as its argument)"
    exit 1
}
grep -E 'stat::number_of_executed_units|stat::peak_rss_mb' "$work/log" | sed "s/^/$name: /"
echo "$name: OK (${seconds}s, no crash)"
