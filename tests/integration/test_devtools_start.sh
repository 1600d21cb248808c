#!/usr/bin/env bash
# devtools refuses to start rather than serve a partial catalogue: a catalogued action without
# its fixture, an unreadable catalogue, a fixture without a "result" object, a bad
# configuration value; each failure names its cause. Also: the documented configuration table
# is what --print-config prints. Needs no server (it fails before connecting).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BUILD:-build}/bin/devtools
[ -x "$BIN" ] || { echo "SKIP: $BIN not built"; exit 0; }
fail() { echo "FAIL: $*"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export UPSQUAD_NATS_URL=nats://127.0.0.1:1 UPSQUAD_LOG_LEVEL=error

# expect_fail NEEDLE [VAR=value...]: devtools exits non-zero and its log names NEEDLE
expect_fail() {
    local needle=$1
    shift
    if env "$@" timeout 10 "$BIN" >"$tmp/out" 2>"$tmp/err"; then
        fail "started with $*"
    fi
    grep -q "$needle" "$tmp/err" || fail "no '$needle' in: $(cat "$tmp/err")"
    grep -qx ready "$tmp/out" && fail "printed ready with $*"
    return 0
}

# 1. every catalogued action needs its fixture: remove one
mkdir -p "$tmp/fx"
cp tools/devtools/fixtures/*.json "$tmp/fx/"
rm "$tmp/fx/github.create_check_run.json"
expect_fail "github.create_check_run.json: cannot open" UPSQUAD_DEVTOOLS_FIXTURES="$tmp/fx"

# 2. a fixture must hold a "result" object
cp tools/devtools/fixtures/github.create_check_run.json "$tmp/fx/"
echo '{"output": {}}' >"$tmp/fx/github.get_issue.json"
expect_fail 'needs a \\"result\\" object' UPSQUAD_DEVTOOLS_FIXTURES="$tmp/fx"

# 3. the catalogue must exist and be JSON
expect_fail "cannot open" UPSQUAD_DEVTOOLS_CATALOG="$tmp/none.json"
echo '{"tools": [' >"$tmp/bad.json"
expect_fail "not valid JSON" UPSQUAD_DEVTOOLS_CATALOG="$tmp/bad.json"

# 4. configuration is checked, every problem named
expect_fail "UPSQUAD_DEVTOOLS_DEDUP_KEYS" UPSQUAD_DEVTOOLS_DEDUP_KEYS=0
expect_fail "UPSQUAD_NATS_URL" UPSQUAD_NATS_URL=

# 5. with everything in place it gets as far as connecting (nobody listens on port 1)
expect_fail "nats connect"

# 6. the configuration tables printed (devtools, wf-responder) are the ones in docs/devtools.md
"$BIN" --print-config >"$tmp/table"
WR=${BUILD:-build}/bin/wf-responder
if [ -x "$WR" ]; then "$WR" --print-config >>"$tmp/table"; fi
while IFS= read -r row; do
    case "$row" in "| \`"*) grep -qF -- "$row" docs/devtools.md || fail "docs lack: $row" ;; esac
done <"$tmp/table"
echo "test_devtools_start: OK"
