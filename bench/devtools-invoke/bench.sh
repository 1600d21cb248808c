#!/usr/bin/env bash
# devtools against its limit: tool invocations per second through devtools (decode, catalogue
# and argument checks, idempotency record, fixture rendering, encode) against a bare NATS
# request/reply responder that answers a pre-packed reply of the same shape (the limit: what
# the bus alone costs), with the same client (build/bin/devtools-invoke load), in the same run
# on the NATS of the bench runtime (UPSQUAD_NATS_URL). Rounds alternate bare, devtools, ... and
# the medians are compared. Every devtools request carries a new idempotency key, so its
# de-duplication record is written on every call (and evicts at its 65,536-key bound).
#
# Environment (optional): BUILD (default build), DEVTOOLS_BENCH_SECONDS per run (default 2),
# DEVTOOLS_BENCH_ROUNDS (default 3), DEVTOOLS_BENCH_CONCURRENCY outstanding requests (default 8).
# Each server's CPU time per answered call is read from /proc over each run: on a shared machine
# it is steadier than throughput. Output: stdout and build/bench/devtools.md. Bench folder named devtools-invoke, not devtools:
# bench/<name>/*.c builds build/bin/<name>, which would collide with tools/devtools.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN=$BUILD/bin
SECONDS_PER_RUN=${DEVTOOLS_BENCH_SECONDS:-2}
ROUNDS=${DEVTOOLS_BENCH_ROUNDS:-3}
CONC=${DEVTOOLS_BENCH_CONCURRENCY:-8}
: "${UPSQUAD_NATS_URL:?source the runtime env first (make bench does)}"
for b in devtools devtools-invoke; do
    [ -x "$BIN/$b" ] || { echo "devtools bench: $BIN/$b missing (run make bench)" >&2; exit 1; }
done
TMP=$(mktemp -d)
PIDS=()
# shellcheck disable=SC2317  # called from the EXIT trap
cleanup() {
    local p
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$TMP"
}
trap cleanup EXIT

# start NAME CMD...: in the background until it prints "ready" (bounded wait)
start() {
    local name=$1 i
    shift
    "$@" >"$TMP/$name.out" 2>"$TMP/$name.err" &
    PIDS+=($!)
    for ((i = 0; i < 100; i++)); do
        grep -qx ready "$TMP/$name.out" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "devtools bench: $name did not start:" >&2
    tail -n 5 "$TMP/$name.err" >&2
    exit 1
}
start bare "$BIN/devtools-invoke" bare
BARE_PID=${PIDS[-1]}
UPSQUAD_LOG_LEVEL=warn start devtools "$BIN/devtools"
DT_PID=${PIDS[-1]}

# CPU time (user + system, clock ticks) a server has used so far
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# run PID TOOL: one load run; its JSON with the server's CPU microseconds per answered call added
run() {
    local pid=$1 tool=$2 c0 c1 out
    c0=$(cpu_ticks "$pid")
    out=$("$BIN/devtools-invoke" load "$tool" get_issue "$SECONDS_PER_RUN" "$CONC")
    c1=$(cpu_ticks "$pid")
    /usr/bin/python3 -c 'import json,os,sys; r=json.loads(sys.argv[1]); t=(int(sys.argv[3])-int(sys.argv[2]))*1e6/os.sysconf("SC_CLK_TCK"); r["cpu_us"]=t/max(1,r["rps"]*float(sys.argv[4])); print(json.dumps(r))' \
        "$out" "$c0" "$c1" "$SECONDS_PER_RUN"
}

declare -a BARE DT
for ((r = 0; r < ROUNDS; r++)); do
    BARE+=("$(run "$BARE_PID" bench)")
    DT+=("$(run "$DT_PID" github)")
done

/usr/bin/python3 - "$CONC" "$SECONDS_PER_RUN" "$ROUNDS" "$BUILD/bench/devtools.md" \
    "${BARE[@]}" -- "${DT[@]}" <<'PY'
import json, statistics, sys, os
conc, secs, rounds, out = sys.argv[1:5]
rest = sys.argv[5:]
cut = rest.index("--")
bare = [json.loads(x) for x in rest[:cut]]
dt = [json.loads(x) for x in rest[cut + 1:]]
med = lambda runs, k: statistics.median(r[k] for r in runs)
b, d = med(bare, "rps"), med(dt, "rps")
lines = [
    f"baseline: bare nats.c request/reply responder (one queue subscription, pre-packed "
    f"ToolInvokeResponse of the same shape), same client, {conc} outstanding requests: "
    f"{b:.0f} req/s, p50 {med(bare, 'p50_us'):.0f} us, p99 {med(bare, 'p99_us'):.0f} us, "
    f"server CPU {med(bare, 'cpu_us'):.1f} us/call",
    f"devtools: github.get_issue, a new idempotency key per call, {conc} outstanding: "
    f"{d:.0f} inv/s, p50 {med(dt, 'p50_us'):.0f} us, p99 {med(dt, 'p99_us'):.0f} us, "
    f"server CPU {med(dt, 'cpu_us'):.1f} us/call",
    f"ratio devtools/bare: {d / b:.2f} throughput, "
    f"{med(dt, 'cpu_us') / max(0.001, med(bare, 'cpu_us')):.2f}x server CPU per call "
    f"(medians of {rounds} runs of {secs} s each, alternating)",
    f"errors: bare {sum(r['errors'] for r in bare)}, devtools {sum(r['errors'] for r in dt)}",
]
print("\n".join(lines))
os.makedirs(os.path.dirname(out), exist_ok=True)
with open(out, "w") as f:
    f.write("## devtools: tool invocations against bare NATS request/reply\n\n")
    f.write("\n".join("- " + l for l in lines) + "\n")
PY
