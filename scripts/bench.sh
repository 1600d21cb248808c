#!/usr/bin/env bash
# `make bench`: every bench/*/bench.sh, against its limit, in one run on this machine, with a
# throw-away runtime for the benchmarks that need Postgres/NATS. Figures go to stdout and to
# build/bench/*.md; docs/benchmarks.md records them with the date.
set -euo pipefail
cd "$(dirname "$0")/.."
export RUN_DIR=${BENCH_RUN_DIR:-$(mktemp -d /tmp/upsquad-bench.XXXXXX)}
export PORT_BASE=${BENCH_PORT_BASE:-44000}
export FAST=1 START_SERVICES=0
cleanup() {
    scripts/runtime.sh purge >/dev/null 2>&1 || true
    rm -rf "$RUN_DIR"
}
trap cleanup EXIT
scripts/runtime.sh up >/dev/null
# shellcheck disable=SC1091
source "$RUN_DIR/env"
mkdir -p build/bench
status=0
for b in $(ls bench/*/bench.sh | sort); do
    echo "== $b"
    bash "$b" || { echo "bench failed: $b"; status=1; }
done
exit $status
