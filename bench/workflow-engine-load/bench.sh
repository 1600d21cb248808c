#!/usr/bin/env bash
# workflow-engine benchmark (run by `make bench`):
#   - durable step transitions per second through the interpreter: RUNS runs of STEPS chained
#     tool_action steps against devtools (two committed transitions per step: in_progress,
#     completed, each with its outbox event), first trigger to last completion;
#   - against `pgbench -N` (simple-update TPC-B without branch/teller updates) on the same
#     Postgres, with as many clients as the engine has connections (UPSQUAD_PG_POOL_SIZE), as a
#     ratio (target >= 1.0);
#   - trigger-to-first-step latency p50/p99 (server clock: run created_at to its first action);
#   - per-org fairness: another org's one-step run latency (median of 11, client clock) while
#     one org floods the engine with FLOOD_RUNS loops of 25 laps, as a ratio to its idle
#     latency (the engine's default admission limits lifted, so the flood is all queued);
#   - run length: the machine CPU (engine + Postgres backends, from /proc) per transition of one
#     run of 256 chained steps (the longest definition) and of one run of 1,000 laps (nested
#     loops), as a ratio to that of 10-step runs, runs one at a time, median of LEN_ROUNDS rounds
#     (target <= 1.5: a tick's cost does not grow with the run's history).
# The engine is tried with each interpreter thread count of WORKERS and the best is kept and
# named. Needs the runtime's Postgres and NATS; prints SKIP without them.
#
#   BUILD  build folder (default build)   RUNS (default 100)   STEPS (default 10)
#   POOL   engine connections = pgbench clients (default 8)   WORKERS (default "2 4")
#   PGBENCH_SECONDS (default 5)   FLOOD_RUNS (default 200)   LEN_ROUNDS (default 3)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN="$BUILD/bin"
RUNS=${RUNS:-100}
STEPS=${STEPS:-10}
POOL=${POOL:-8}
PGBENCH_SECONDS=${PGBENCH_SECONDS:-5}
FLOOD_RUNS=${FLOOD_RUNS:-200}
LEN_ROUNDS=${LEN_ROUNDS:-3}
PGBIN=${PGBIN:-/usr/lib/postgresql/15/bin}
read -r -a WORKERS <<<"${WORKERS:-2 4}"

if [[ -z "${UPSQUAD_PG_DSN_WORKFLOW_ENGINE:-}" || -z "${UPSQUAD_NATS_URL:-}" || -z "${UPSQUAD_PG_ADMIN_DSN:-}" ]]; then
    echo "workflow-engine bench: SKIP (the runtime's env is not sourced)"
    exit 0
fi
for b in workflow-engine workflow-engine-load devtools upsquad-token; do
    [[ -x "$BIN/$b" ]] || { echo "workflow-engine bench: $BIN/$b is missing (make tests-build)"; exit 1; }
done

TMP=$(mktemp -d /tmp/wf-bench.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    "$PGBIN/pgbench" -i -I d "$UPSQUAD_PG_ADMIN_DSN" >/dev/null 2>&1 || true
    rm -rf "$TMP"
}
trap cleanup EXIT

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
    echo "workflow-engine bench: engine did not start:" >&2
    tail -n 20 "$file" "$file.err" >&2 || true
    return 1
}
field() { sed -E "s/.*\"$2\":([0-9.]+).*/\1/" <<<"$1"; }

export UPSQUAD_JWT_SECRET
UPSQUAD_JWT_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
ORG=$(cat /proc/sys/kernel/random/uuid)
USER_ID=$(cat /proc/sys/kernel/random/uuid)
TOKEN=$("$BIN/upsquad-token" --sub "$USER_ID" --org "$ORG" --ttl 3600)
VICTIM_TOKEN=$("$BIN/upsquad-token" --sub "$USER_ID" --org "$(cat /proc/sys/kernel/random/uuid)" --ttl 3600)

UPSQUAD_LOG_LEVEL=error "$BIN/devtools" >"$TMP/devtools" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do grep -q ready "$TMP/devtools" && break; sleep 0.05; done

start_engine() { # $1 interpreter threads; sets pid and port
    UPSQUAD_GRPC_ADDR=127.0.0.1:0 UPSQUAD_METRICS_ADDR= UPSQUAD_LOG_LEVEL=error \
        UPSQUAD_PG_DSN="$UPSQUAD_PG_DSN_WORKFLOW_ENGINE" UPSQUAD_PG_POOL_SIZE="$POOL" \
        UPSQUAD_WF_WORKERS="$1" UPSQUAD_RPC_UNARY_THREADS=2 \
        UPSQUAD_WF_ORG_MAX_ACTIVE_RUNS=1000000 UPSQUAD_WF_ORG_TRIGGERS_PER_SEC=100000 \
        UPSQUAD_MIGRATIONS_DIR=services/workflow-engine/migrations \
        "$BIN/workflow-engine" >"$TMP/engine-$1" 2>"$TMP/engine-$1.err" &
    pid=$!
    PIDS+=($pid)
    port=$(port_of "$TMP/engine-$1" "$pid")
}
best="" best_w=""
for w in "${WORKERS[@]}"; do
    start_engine "$w"
    r=$("$BIN/workflow-engine-load" --target "127.0.0.1:$port" --token "$TOKEN" --runs "$RUNS" --steps "$STEPS")
    echo "engine with $w interpreter thread(s): $r"
    if [[ -z "$best" ]] || (( $(echo "$(field "$r" transitions_per_s) > $(field "$best" transitions_per_s)" | bc) )); then
        best=$r best_w=$w
    fi
    kill "$pid"
    wait "$pid" 2>/dev/null || true
done

start_engine 2
fair=$("$BIN/workflow-engine-load" --target "127.0.0.1:$port" --token "$TOKEN" \
    --fairness "$VICTIM_TOKEN" --runs "$FLOOD_RUNS")
kill "$pid"
wait "$pid" 2>/dev/null || true

# run length: CPU ticks (engine + Postgres: the postmaster's reaped children and its live
# ones) per transition of one sequential workload
PM=$(head -1 "$(psql -XAtq "$UPSQUAD_PG_ADMIN_DSN" -c "SHOW data_directory")/postmaster.pid")
cpu_ticks() { # engine pid
    local s
    s=$(awk '{print $14 + $15}' "/proc/$1/stat")
    s=$((s + $(awk '{print $16 + $17}' "/proc/$PM/stat")))
    # the live backends: children of the postmaster (field 4 of /proc/<pid>/stat)
    s=$((s + $(cat /proc/[0-9]*/stat 2>/dev/null | awk -v pm="$PM" '$4 == pm {t += $14 + $15} END {print t + 0}')))
    echo "$s"
}
per_transition() { # runs steps laps -> CPU ms per transition
    local a b r n
    a=$(cpu_ticks "$pid")
    r=$("$BIN/workflow-engine-load" --target "127.0.0.1:$port" --token "$TOKEN" --sequential \
        --runs "$1" --steps "$2" --laps "$3")
    b=$(cpu_ticks "$pid")
    n=$(field "$r" transitions)
    awk -v a="$a" -v b="$b" -v n="$n" -v hz="$(getconf CLK_TCK)" 'BEGIN{printf "%.3f", (b - a) * 1000 / hz / n}'
}
median() { tr ' ' '\n' | awk 'NF' | sort -g | awk '{v[NR]=$1} END{print v[int((NR + 1) / 2)]}'; }
start_engine 2
short="" chain="" laps=""
for _ in $(seq 1 "$LEN_ROUNDS"); do
    short+="$(per_transition 20 10 0) "
    chain+="$(per_transition 1 256 0) "
    laps+="$(per_transition 1 1 1000) "
done
kill "$pid"
wait "$pid" 2>/dev/null || true
SHORT=$(median <<<"$short") CHAIN=$(median <<<"$chain") LAPS=$(median <<<"$laps")
CHAIN_RATIO=$(awk -v a="$CHAIN" -v b="$SHORT" 'BEGIN{printf "%.2f", a / b}')
LAPS_RATIO=$(awk -v a="$LAPS" -v b="$SHORT" 'BEGIN{printf "%.2f", a / b}')

"$PGBIN/pgbench" -i -s 1 -q "$UPSQUAD_PG_ADMIN_DSN" >"$TMP/pginit" 2>&1
pg=$("$PGBIN/pgbench" -N -c "$POOL" -j 2 -T "$PGBENCH_SECONDS" -n "$UPSQUAD_PG_ADMIN_DSN" 2>&1)
PG_TPS=$(grep -E '^tps' <<<"$pg" | head -1 | sed -E 's/tps = ([0-9.]+).*/\1/')
ENGINE_TPS=$(field "$best" transitions_per_s)
RATIO=$(awk -v a="$ENGINE_TPS" -v b="$PG_TPS" 'BEGIN{printf "%.2f", (b > 0 ? a / b : 0)}')

echo
echo "workflow-engine: durable step transitions/s ($RUNS runs x $STEPS tool_action steps, devtools)"
echo "baseline: pgbench -N (simple update, scale 1) with $POOL clients, 2 threads, ${PGBENCH_SECONDS}s, on the same Postgres; the engine at its best of ${WORKERS[*]} interpreter thread(s) ($best_w) with $POOL connections"
printf '  %-34s %12s\n' "pgbench -N transactions/s" "$PG_TPS"
printf '  %-34s %12s\n' "engine step transitions/s" "$ENGINE_TPS"
echo "  ratio to baseline: ${RATIO}x (target >= 1.0)"
echo "  trigger to first step: p50 $(field "$best" first_step_p50_ms) ms, p99 $(field "$best" first_step_p99_ms) ms"
echo "  per-org fairness: another org's one-step run $(field "$fair" victim_idle_ms) ms idle, $(field "$fair" victim_flood_ms) ms while one org floods $FLOOD_RUNS x 25 laps: $(field "$fair" ratio)x"
echo "  run length (CPU ms per transition, engine + Postgres, median of $LEN_ROUNDS): 10-step runs $SHORT, 256 chained steps $CHAIN (${CHAIN_RATIO}x), 1,000 laps $LAPS (${LAPS_RATIO}x) (target <= 1.5x)"
echo "{\"bench\":\"workflow-engine\",\"run_len_short_ms\":$SHORT,\"run_len_chain_ratio\":$CHAIN_RATIO,\"run_len_laps_ratio\":$LAPS_RATIO,\"fairness_ratio\":$(field "$fair" ratio),\"victim_idle_ms\":$(field "$fair" victim_idle_ms),\"victim_flood_ms\":$(field "$fair" victim_flood_ms),\"transitions_per_s\":$ENGINE_TPS,\"pgbench_tps\":$PG_TPS,\"ratio\":$RATIO,\"workers\":$best_w,\"pool\":$POOL,\"first_step_p50_ms\":$(field "$best" first_step_p50_ms),\"first_step_p99_ms\":$(field "$best" first_step_p99_ms)}"
