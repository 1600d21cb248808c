#!/usr/bin/env bash
# model-registry benchmark (run by `make bench`):
#   - GetModelRecommendation calls/s and p50/p99 latency, against the bare C-core echo server
#     (bench/rpc-bare-echo) driven by the same load client, as ratios (target >= 0.8x). The
#     baseline runs at its best: its one knob, the completion-queue threads, is measured at
#     BARE_THREADS (default "1 2") in alternating rounds and the best setting is kept and named;
#   - idle memory of the service process: RSS (target < 10 MB), and the process's own share
#     (PSS, and private = anonymous + private file pages), since RSS counts shared libraries.
# Needs the runtime's Postgres (UPSQUAD_PG_DSN_MODEL_REGISTRY); prints SKIP without it.
# Every server it starts listens on 127.0.0.1 and is stopped by pid on exit.
#
#   BUILD        build folder (default build)
#   CONCURRENCY  calls outstanding (default 8)      DURATION  seconds per run (default 5)
#   ROUNDS       rounds of (each bare setting, service) runs (default 2; the best run of each
#                side counts)
#   BARE_THREADS completion-queue thread counts tried for the bare server (default "1 2")
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN="$BUILD/bin"
CONCURRENCY=${CONCURRENCY:-8}
DURATION=${DURATION:-5}
ROUNDS=${ROUNDS:-2}
read -r -a BARE_THREADS <<<"${BARE_THREADS:-1 2}"

if [[ -z "${UPSQUAD_PG_DSN_MODEL_REGISTRY:-}" ]]; then
    echo "model-registry bench: SKIP (UPSQUAD_PG_DSN_MODEL_REGISTRY is not set)"
    exit 0
fi
for b in model-registry model-registry-load rpc-bare-echo upsquad-token; do
    [[ -x "$BIN/$b" ]] || { echo "model-registry bench: $BIN/$b is missing (make tests-build)"; exit 1; }
done

TMP=$(mktemp -d /tmp/mr-bench.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$TMP"
}
trap cleanup EXIT

# Waits for "port=N" on a process's stdout file; prints N.
port_of() {
    local file=$1 pid=$2 i
    for i in $(seq 1 200); do
        if grep -q '^port=' "$file" 2>/dev/null; then
            grep -m1 '^port=' "$file" | cut -d= -f2
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.05
    done
    echo "model-registry bench: server did not start:" >&2
    tail -n 20 "$file" "$file.err" >&2 || true
    return 1
}

export UPSQUAD_JWT_SECRET
UPSQUAD_JWT_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')

declare -A BARE_PORT BARE_PID
for t in "${BARE_THREADS[@]}"; do
    "$BIN/rpc-bare-echo" 127.0.0.1:0 "$t" >"$TMP/bare$t" 2>"$TMP/bare$t.err" &
    PIDS+=($!)
    BARE_PID[$t]=$!
    BARE_PORT[$t]=$(port_of "$TMP/bare$t" "${BARE_PID[$t]}")
done

UPSQUAD_GRPC_ADDR=127.0.0.1:0 UPSQUAD_METRICS_ADDR= UPSQUAD_LOG_LEVEL=warn \
    UPSQUAD_PG_DSN="$UPSQUAD_PG_DSN_MODEL_REGISTRY" \
    UPSQUAD_MIGRATIONS_DIR=services/model-registry/migrations \
    UPSQUAD_MODEL_CATALOG_FILE=services/model-registry/catalog/models.json \
    "$BIN/model-registry" >"$TMP/svc" 2>"$TMP/svc.err" &
PIDS+=($!)
SVC_PID=$!
SVC_PORT=$(port_of "$TMP/svc" "$SVC_PID")
TOKEN=$("$BIN/upsquad-token" --sub bench --org bench --ttl 3600)

# idle memory, after start-up settled and before any call
sleep 2
RSS_KB=$(awk '/^VmRSS:/{print $2}' "/proc/$SVC_PID/status")
PSS_KB=$(awk '/^Pss:/{print $2}' "/proc/$SVC_PID/smaps_rollup")
PRIV_KB=$(awk '/^Private_(Clean|Dirty):/{s+=$2} END{print s}' "/proc/$SVC_PID/smaps")
BARE_RSS_KB=$(awk '/^VmRSS:/{print $2}' "/proc/${BARE_PID[${BARE_THREADS[0]}]}/status")

load() { # kind port [token]
    local args=(--target "127.0.0.1:$2" --kind "$1" --concurrency "$CONCURRENCY"
                --duration "$DURATION" --warmup 1 --threads 2 --channels 2)
    [[ -n "${3:-}" ]] && args+=(--token "$3")
    "$BIN/model-registry-load" "${args[@]}"
}
field() { sed -E "s/.*\"$2\":([0-9.]+).*/\1/" <<<"$1"; }

best_bare="" best_svc="" best_threads=""
for r in $(seq 1 "$ROUNDS"); do
    for t in "${BARE_THREADS[@]}"; do
        b=$(load echo "${BARE_PORT[$t]}")
        echo "round $r bare ($t thread(s)): $b"
        if [[ -z "$best_bare" ]] || (( $(field "$b" calls_per_s) > $(field "$best_bare" calls_per_s) )); then
            best_bare=$b best_threads=$t
        fi
    done
    s=$(load recommend "$SVC_PORT" "$TOKEN")
    echo "round $r service: $s"
    if [[ -z "$best_svc" ]] || (( $(field "$s" calls_per_s) > $(field "$best_svc" calls_per_s) )); then best_svc=$s; fi
done

BARE_CPS=$(field "$best_bare" calls_per_s)
SVC_CPS=$(field "$best_svc" calls_per_s)
RATIO=$(awk -v a="$SVC_CPS" -v b="$BARE_CPS" 'BEGIN{printf "%.2f", a / b}')
P99_RATIO=$(awk -v a="$(field "$best_svc" p99_ms)" -v b="$(field "$best_bare" p99_ms)" \
    'BEGIN{printf "%.2f", b > 0 ? a / b : 0}')
verdict() { awk -v v="$1" -v t="$2" -v op="$3" 'BEGIN{ok = op == ">=" ? v >= t : v < t; print ok ? "meets" : "misses"}'; }

echo
echo "model-registry: GetModelRecommendation vs bare C-core echo, $CONCURRENCY calls outstanding"
echo "baseline: rpc-bare-echo with $best_threads completion-queue thread(s), its best of" \
    "${BARE_THREADS[*]} thread(s) on this machine; same client, alternating rounds"
printf '  %-26s %10s %9s %9s\n' "" "calls/s" "p50 ms" "p99 ms"
printf '  %-26s %10s %9s %9s\n' "bare echo (PublicEcho)" "$BARE_CPS" "$(field "$best_bare" p50_ms)" "$(field "$best_bare" p99_ms)"
printf '  %-26s %10s %9s %9s\n' "model-registry (auth'd)" "$SVC_CPS" "$(field "$best_svc" p50_ms)" "$(field "$best_svc" p99_ms)"
echo "  ratio to baseline: throughput ${RATIO}x (target >= 0.8x: $(verdict "$RATIO" 0.8 '>=')), p99 ${P99_RATIO}x"
echo "  idle memory: RSS $((RSS_KB / 1024)).$(((RSS_KB % 1024) * 10 / 1024)) MB (target < 10 MB: $(verdict "$RSS_KB" 10240 '<')), PSS $((PSS_KB / 1024)).$(((PSS_KB % 1024) * 10 / 1024)) MB, private $((PRIV_KB / 1024)).$(((PRIV_KB % 1024) * 10 / 1024)) MB; bare echo RSS $((BARE_RSS_KB / 1024)).$(((BARE_RSS_KB % 1024) * 10 / 1024)) MB"
echo "{\"bench\":\"model-registry\",\"bare_calls_per_s\":$BARE_CPS,\"calls_per_s\":$SVC_CPS,\"ratio\":$RATIO,\"p99_ratio\":$P99_RATIO,\"bare_threads\":$best_threads,\"p50_ms\":$(field "$best_svc" p50_ms),\"p99_ms\":$(field "$best_svc" p99_ms),\"bare_p99_ms\":$(field "$best_bare" p99_ms),\"idle_rss_kb\":$RSS_KB,\"idle_pss_kb\":$PSS_KB,\"idle_private_kb\":$PRIV_KB}"
