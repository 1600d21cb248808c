#!/usr/bin/env bash
# `make test`: a throw-away runtime (private Postgres, Redis, NATS on loopback), every test
# against it, then the AddressSanitizer/UBSan and the ThreadSanitizer builds of the test
# programs against it too.
set -euo pipefail
cd "$(dirname "$0")/.."
export RUN_DIR=${TEST_RUN_DIR:-$(mktemp -d /tmp/upsquad-test.XXXXXX)}
export PORT_BASE=${TEST_PORT_BASE:-46000}
export FAST=1 START_SERVICES=0
cleanup() { # down, then remove the data (a 0700 RUN_DIR keeps Postgres' data under /tmp)
    scripts/runtime.sh purge >/dev/null 2>&1 || true
    rm -rf "$RUN_DIR"
}
trap cleanup EXIT
scripts/runtime.sh up
# shellcheck disable=SC1091
source "$RUN_DIR/env"

status=0
echo "== tests (build)"
tests/run.sh || status=1

if [ "${SKIP_VALGRIND:-0}" != 1 ]; then
    echo "== unit tests under valgrind (leaks and memory errors fail)"
    TEST_WRAPPER="valgrind -q --leak-check=full --errors-for-leak-kinds=definite,indirect --error-exitcode=99" \
        tests/run.sh --unit-only || status=1
fi

if [ "${SKIP_ASAN:-0}" != 1 ]; then
    echo "== tests (AddressSanitizer + UBSan build)"
    make --no-print-directory -j"$(nproc)" BUILD=build-asan SAN=1 tests-build >build-asan.log 2>&1 ||
        { tail -n 80 build-asan.log; exit 1; }
    rm -f build-asan.log
    # leaks fail the tests and the servers they start; gRPC's and OpenSSL's process-lifetime
    # allocations are suppressed (tests/lsan.supp says why), nothing of ours is
    export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
    export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tests/lsan.supp}
    export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
    BUILD=build-asan tests/run.sh --binaries-only || status=1
fi
if [ "${SKIP_TSAN:-0}" != 1 ]; then
    echo "== tests (ThreadSanitizer build)"
    make --no-print-directory -j"$(nproc)" tsan >build-tsan.log 2>&1 ||
        { tail -n 80 build-tsan.log; exit 1; }
    rm -f build-tsan.log
    # only what is not ours is suppressed: uninstrumented gRPC, abseil, OpenSSL, nats.c, libpq.
    # The C test programs (libcommon's threads: server, pool, streams, async reader, bus, the
    # devtools/responder programs): the Python service tests run in the two passes above, their
    # timings are not made for a 5-15x slower build.
    TSAN_OPTIONS=${TSAN_OPTIONS:-suppressions=$PWD/tests/tsan.supp:halt_on_error=1} \
        BUILD=build-tsan tests/run.sh --programs-only || status=1
fi
exit $status
