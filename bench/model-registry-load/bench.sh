#!/usr/bin/env bash
# model-registry benchmark (run by `make bench`):
#   - GetModelRecommendation calls/s and p50/p99 latency, against the bare C-core echo server
#     (bench/rpc-bare-echo) driven by the same load client, as ratios (target >= 0.8x calls/s,
#     p99 under 1 ms). The baseline runs at its best: its one knob, the completion-queue
#     threads, is measured at BARE_THREADS (default "1 2") in alternating rounds; the setting
#     with the most calls/s is the throughput baseline, the one with the lowest median p99 the
#     latency baseline, and both are named;
#   - the same client against libcommon's echo server (build/bin/echo-server, `Echo` with the
#     same bearer token): a trivial handler on the same server library, which splits the gap
#     into the library's share (bare -> echo) and the handler's (echo -> model-registry);
#   - for every run, the server's CPU per call and the time its threads spent runnable but
#     waiting for a core (run-queue wait, /proc/PID/task/*/schedstat): on a shared 2-core
#     machine the p99 tail is that wait, for every server alike;
#   - idle memory of the service process: RSS (target < 10 MB), and the process's own share
#     (PSS, and private = anonymous + private file pages), since RSS counts shared libraries.
# Latency figures are medians over the rounds (a single run's p99 moves by 2-5x with the load of
# other jobs); the load average is printed at the start and the end.
# Needs the runtime's Postgres (UPSQUAD_PG_DSN_MODEL_REGISTRY); prints SKIP without it.
# Every server it starts listens on 127.0.0.1 and is stopped by pid on exit.
#
#   BUILD        build folder (default build)
#   CONCURRENCY  calls outstanding (default 8)      DURATION  seconds per run (default 4)
#   ROUNDS       rounds of (each bare setting, echo, service) runs (default 3)
#   BARE_THREADS completion-queue thread counts tried for the bare server (default "1 2")
#   SVC_THREADS  completion-queue thread counts tried for the service (UPSQUAD_RPC_UNARY_THREADS,
#                default "1 2": 1 is libcommon's default, 2 what k8s/model-registry.yaml deploys);
#                the service is reported at each, and at its best for the ratios, like the baseline
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN="$BUILD/bin"
CONCURRENCY=${CONCURRENCY:-8}
DURATION=${DURATION:-4}
ROUNDS=${ROUNDS:-3}
read -r -a BARE_THREADS <<<"${BARE_THREADS:-1 2}"
read -r -a SVC_THREADS <<<"${SVC_THREADS:-1 2}"

if [[ -z "${UPSQUAD_PG_DSN_MODEL_REGISTRY:-}" ]]; then
    echo "model-registry bench: SKIP (UPSQUAD_PG_DSN_MODEL_REGISTRY is not set)"
    exit 0
fi
for b in model-registry model-registry-load rpc-bare-echo echo-server upsquad-token; do
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

# libcommon's echo server at its defaults (one completion-queue thread), same secret
UPSQUAD_GRPC_ADDR=127.0.0.1:0 UPSQUAD_METRICS_ADDR= UPSQUAD_LOG_LEVEL=warn \
    "$BIN/echo-server" >"$TMP/lib" 2>"$TMP/lib.err" &
PIDS+=($!)
LIB_PID=$!
LIB_PORT=$(port_of "$TMP/lib" "$LIB_PID")

declare -A SVC_PORT SVC_PID
for t in "${SVC_THREADS[@]}"; do
    UPSQUAD_GRPC_ADDR=127.0.0.1:0 UPSQUAD_METRICS_ADDR= UPSQUAD_LOG_LEVEL=warn \
        UPSQUAD_RPC_UNARY_THREADS="$t" UPSQUAD_PG_DSN="$UPSQUAD_PG_DSN_MODEL_REGISTRY" \
        UPSQUAD_MIGRATIONS_DIR=services/model-registry/migrations \
        UPSQUAD_MODEL_CATALOG_FILE=services/model-registry/catalog/models.json \
        "$BIN/model-registry" >"$TMP/svc$t" 2>"$TMP/svc$t.err" &
    PIDS+=($!)
    SVC_PID[$t]=$!
    SVC_PORT[$t]=$(port_of "$TMP/svc$t" "${SVC_PID[$t]}")
done
SVC_PID0=${SVC_PID[${SVC_THREADS[0]}]}
TOKEN=$("$BIN/upsquad-token" --sub bench --org bench --ttl 3600)

# idle memory, after start-up settled and before any call
sleep 2
RSS_KB=$(awk '/^VmRSS:/{print $2}' "/proc/$SVC_PID0/status")
PSS_KB=$(awk '/^Pss:/{print $2}' "/proc/$SVC_PID0/smaps_rollup")
PRIV_KB=$(awk '/^Private_(Clean|Dirty):/{s+=$2} END{print s}' "/proc/$SVC_PID0/smaps")
BARE_RSS_KB=$(awk '/^VmRSS:/{print $2}' "/proc/${BARE_PID[${BARE_THREADS[0]}]}/status")

load() { # kind port [token]
    local args=(--target "127.0.0.1:$2" --kind "$1" --concurrency "$CONCURRENCY"
                --duration "$DURATION" --warmup 1 --threads 2 --channels 2)
    [[ -n "${3:-}" ]] && args+=(--token "$3")
    "$BIN/model-registry-load" "${args[@]}"
}
field() { sed -E "s/.*\"$2\":([0-9.]+).*/\1/" <<<"$1"; }
# A server's CPU ticks (every thread, utime + stime; the fields after the ")" closing comm) and
# run-queue wait in ns (every thread), and the wall clock in ns.
snap() {
    local pid=$1
    echo "$(sed 's/.*) //' /proc/"$pid"/task/*/stat 2>/dev/null | awk '{t += $12 + $13} END {print t + 0}')" \
        "$(awk '{ns += $2} END {print ns + 0}' /proc/"$pid"/task/*/schedstat 2>/dev/null)" \
        "$(date +%s%N)"
}
HZ=$(getconf CLK_TCK)
# measure NAME KIND PORT PID [TOKEN]: one run; prints it; appends p50, p99, calls/s, CPU us per
# call and run-queue wait ms per s of the run to $TMP/NAME.runs
measure() {
    local name=$1 kind=$2 port=$3 pid=$4 tok=${5:-} a b out cps
    a=$(snap "$pid")
    out=$(load "$kind" "$port" "$tok")
    b=$(snap "$pid")
    cps=$(field "$out" calls_per_s)
    read -r cpu wait <<<"$(awk -v a="$a" -v b="$b" -v c="$cps" -v hz="$HZ" 'BEGIN {
        split(a, x, " "); split(b, y, " "); wall = (y[3] - x[3]) / 1e9;
        calls = c * wall; if (calls < 1) calls = 1;
        printf "%.1f %.0f", (y[1] - x[1]) * 1e6 / hz / calls, (y[2] - x[2]) / 1e6 / wall }')"
    echo "$(field "$out" p50_ms) $(field "$out" p99_ms) $cps $cpu $wait" >>"$TMP/$name.runs"
    echo "round $r $name: $out cpu_us_per_call=$cpu runq_wait_ms_per_s=$wait"
}
# median COLUMN NAME: the median of a column of $TMP/NAME.runs (1 p50, 2 p99, 4 CPU, 5 wait)
median() { awk -v c="$1" '{print $c}' "$TMP/$2.runs" | sort -g | awk '{v[NR] = $1} END {
    printf "%.3f", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
best() { awk '$3 > m {m = $3} END {print m + 0}' "$TMP/$1.runs"; } # the most calls/s

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for r in $(seq 1 "$ROUNDS"); do
    for t in "${BARE_THREADS[@]}"; do measure "bare$t" echo "${BARE_PORT[$t]}" "${BARE_PID[$t]}"; done
    measure lib echo "$LIB_PORT" "$LIB_PID" "$TOKEN"
    for t in "${SVC_THREADS[@]}"; do measure "svc$t" recommend "${SVC_PORT[$t]}" "${SVC_PID[$t]}" "$TOKEN"; done
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

best_threads="" best_cps=0 p99_threads="" p99_best=""
for t in "${BARE_THREADS[@]}"; do
    c=$(best "bare$t") p=$(median 2 "bare$t")
    if awk -v c="$c" -v b="$best_cps" 'BEGIN {exit !(c > b)}'; then best_cps=$c best_threads=$t; fi
    if [[ -z "$p99_best" ]] || awk -v p="$p" -v b="$p99_best" 'BEGIN {exit !(p < b)}'; then
        p99_best=$p p99_threads=$t
    fi
done
BARE_CPS=$best_cps
# the service at its best, by the same rules as the baseline
svc_threads="" SVC_CPS=0 svc_p99_threads="" SVC_P99=""
for t in "${SVC_THREADS[@]}"; do
    c=$(best "svc$t") p=$(median 2 "svc$t")
    if awk -v c="$c" -v b="$SVC_CPS" 'BEGIN {exit !(c > b)}'; then SVC_CPS=$c svc_threads=$t; fi
    if [[ -z "$SVC_P99" ]] || awk -v p="$p" -v b="$SVC_P99" 'BEGIN {exit !(p < b)}'; then
        SVC_P99=$p svc_p99_threads=$t
    fi
done
LIB_CPS=$(best lib)
RATIO=$(awk -v a="$SVC_CPS" -v b="$BARE_CPS" 'BEGIN {printf "%.2f", a / b}')
P99_RATIO=$(awk -v a="$SVC_P99" -v b="$p99_best" 'BEGIN {printf "%.2f", (b > 0 ? a / b : 0)}')
verdict() { awk -v v="$1" -v t="$2" -v op="$3" 'BEGIN{ok = op == ">=" ? v >= t : v < t; print ok ? "meets" : "misses"}'; }
row() { # label name calls/s
    printf '  %-34s %9s %9s %9s %9s %9s\n' "$1" "$3" "$(median 1 "$2")" "$(median 2 "$2")" \
        "$(median 4 "$2")" "$(median 5 "$2" | cut -d. -f1)"
}

echo
echo "model-registry: GetModelRecommendation vs bare C-core echo, $CONCURRENCY calls outstanding," \
    "$ROUNDS rounds of ${DURATION} s; load average $LOAD_START at the start, $LOAD_END at the end" \
    "($(nproc) cores)"
echo "baseline: rpc-bare-echo with $best_threads completion-queue thread(s) for calls/s and" \
    "$p99_threads thread(s) for p99, its best of ${BARE_THREADS[*]} thread(s) on this machine;" \
    "same client, alternating rounds"
printf '  %-34s %9s %9s %9s %9s %9s\n' "" "calls/s" "p50 ms" "p99 ms" "CPU us" "runq ms/s"
printf '  %-34s %9s %9s %9s %9s %9s\n' "" "(best)" "(median)" "(median)" "per call" "(median)"
for t in "${BARE_THREADS[@]}"; do row "bare echo, $t thread(s) (PublicEcho)" "bare$t" "$(best "bare$t")"; done
row "libcommon echo (Echo, auth'd)" lib "$LIB_CPS"
for t in "${SVC_THREADS[@]}"; do row "model-registry, $t thread(s) (auth'd)" "svc$t" "$(best "svc$t")"; done
echo "  ratio to baseline: throughput ${RATIO}x (target >= 0.8x: $(verdict "$RATIO" 0.8 '>=')), p99 ${P99_RATIO}x;" \
    "p99 ${SVC_P99} ms (target < 1 ms: $(verdict "$SVC_P99" 1 '<')); the service's best: $svc_threads thread(s)" \
    "for calls/s, $svc_p99_threads for p99"
echo "  idle memory: RSS $((RSS_KB / 1024)).$(((RSS_KB % 1024) * 10 / 1024)) MB (target < 10 MB: $(verdict "$RSS_KB" 10240 '<')), PSS $((PSS_KB / 1024)).$(((PSS_KB % 1024) * 10 / 1024)) MB, private $((PRIV_KB / 1024)).$(((PRIV_KB % 1024) * 10 / 1024)) MB; bare echo RSS $((BARE_RSS_KB / 1024)).$(((BARE_RSS_KB % 1024) * 10 / 1024)) MB"
echo "{\"bench\":\"model-registry\",\"bare_calls_per_s\":$BARE_CPS,\"calls_per_s\":$SVC_CPS,\"lib_calls_per_s\":$LIB_CPS,\"ratio\":$RATIO,\"p99_ratio\":$P99_RATIO,\"bare_threads\":$best_threads,\"bare_p99_threads\":$p99_threads,\"svc_threads\":$svc_threads,\"svc_p99_threads\":$svc_p99_threads,\"p50_ms\":$(median 1 "svc$svc_p99_threads"),\"p99_ms\":$SVC_P99,\"bare_p99_ms\":$p99_best,\"lib_p99_ms\":$(median 2 lib),\"cpu_us_per_call\":$(median 4 "svc$svc_threads"),\"bare_cpu_us_per_call\":$(median 4 "bare$best_threads"),\"lib_cpu_us_per_call\":$(median 4 lib),\"load_start\":\"$LOAD_START\",\"load_end\":\"$LOAD_END\",\"idle_rss_kb\":$RSS_KB,\"idle_pss_kb\":$PSS_KB,\"idle_private_kb\":$PRIV_KB}"
