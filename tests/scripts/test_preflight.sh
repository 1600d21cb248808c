#!/usr/bin/env bash
# The build fails early on a machine that lacks a package, naming the missing file and the
# Debian package that provides it (never make's bare "No rule to make target").
set -euo pipefail
cd "$(dirname "$0")/../.."
fail() { echo "FAIL: $*"; exit 1; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT

# 1. A required file is absent: `make` stops before compiling, naming file and package.
if DEPS_EXTRA_REQUIRED="/nonexistent/upsquad/probe.h:libupsquad-probe-dev" \
    make --no-print-directory -s all >"$out" 2>&1; then
    fail "make succeeded although a required file is missing"
fi
grep -q "missing /nonexistent/upsquad/probe.h (Debian package libupsquad-probe-dev)" "$out" ||
    fail "no message naming the file and its package: $(cat "$out")"
grep -q "No rule to make target" "$out" && fail "bare 'No rule to make target': $(cat "$out")"

# 2. A system .proto a rule needs is absent (the libprotobuf-dev case): its package is named.
if make --no-print-directory -s /usr/include/google/protobuf/upsquad_probe.proto >"$out" 2>&1; then
    fail "make succeeded for a missing system file"
fi
grep -q "missing /usr/include/google/protobuf/upsquad_probe.proto (Debian package libprotobuf-dev)" \
    "$out" || fail "no package named for a missing well-known proto: $(cat "$out")"

# 3. Every required file of the real table is present here (make deps installed them).
scripts/deps.sh --check || fail "scripts/deps.sh --check reports a missing file"
echo "test_preflight: OK"
