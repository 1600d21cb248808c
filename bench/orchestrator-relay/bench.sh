#!/usr/bin/env bash
# orchestrator relay against its limit: one SendMessage streaming a devworker burst script of
# N tokens through the orchestrator (build/bin/orchestrator -> build/bin/devworker), against the
# same script read from the devworker directly by the same client (ExecuteStep): tokens/s (from
# the first token to the last) and the per-token gap p50/p99, as ratios (target: >= 0.8 of the
# direct rate, p99 gap added < 1 ms). Also: session create + first token latency (SendMessage
# without a session: create, snapshot, InitWorkerSession, turn) over FIRST_TURNS turns.
# The baseline is the devworker read directly (no relay at all): the limit a relay can reach.
# Runs alternate relay, direct for ROUNDS rounds after one warm-up of each; medians reported.
# Needs the runtime's Postgres and Redis (UPSQUAD_PG_DSN_ORCHESTRATOR); SKIP without them.
# Results: stdout and build/bench/orchestrator.md. Every process it starts is stopped by pid.
#
#   BUILD        build folder (default build)
#   RELAY_TOKENS tokens per stream (default 15000; messages are at most 64 KiB)
#   ROUNDS       runs of each side (default 5)       FIRST_TURNS  (default 30)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN=$BUILD/bin
OUT=$BUILD/bench
N=${RELAY_TOKENS:-15000}
ROUNDS=${ROUNDS:-5}
FIRST=${FIRST_TURNS:-30}
PY=/usr/bin/python3
if [[ -z "${UPSQUAD_PG_DSN_ORCHESTRATOR:-}" || -z "${UPSQUAD_REDIS_URL:-}" ]]; then
    echo "orchestrator bench: SKIP (UPSQUAD_PG_DSN_ORCHESTRATOR / UPSQUAD_REDIS_URL not set)"
    exit 0
fi
for b in orchestrator devworker orchestrator-relay upsquad-agents upsquad-token; do
    [ -x "$BIN/$b" ] || { echo "orchestrator bench: $BIN/$b missing (run make bench)" >&2; exit 1; }
done
mkdir -p "$OUT"
TMP=$(mktemp -d)
SECRET=orchestrator-bench-secret-not-for-production-0123456789
ORG=0be00000-0000-4000-8000-$(od -An -tx1 -N6 /dev/urandom | tr -d ' \n')
declare -A PID PORT
# shellcheck disable=SC2317  # called from the EXIT trap
cleanup() {
    local s
    for s in "${!PID[@]}"; do kill -TERM "${PID[$s]}" 2>/dev/null || true; done
    for s in "${!PID[@]}"; do wait "${PID[$s]}" 2>/dev/null || true; done
    rm -rf "$TMP"
}
trap cleanup EXIT

port_of() {
    local s=$1
    for _ in $(seq 200); do
        PORT[$s]=$(sed -n 's/^port=\([0-9]*\)$/\1/p' "$TMP/$s.out" 2>/dev/null | head -1)
        [ -n "${PORT[$s]}" ] && return 0
        sleep 0.05
    done
    echo "orchestrator bench: $s did not start" >&2
    tail -5 "$TMP/$s.err" >&2
    exit 1
}

common=(UPSQUAD_LOG_LEVEL=warn UPSQUAD_GRPC_ADDR=127.0.0.1:0 UPSQUAD_METRICS_ADDR=
    "UPSQUAD_JWT_SECRET=$SECRET" UPSQUAD_JWT_AUDIENCE=upsquad)
env -u UPSQUAD_ORCHESTRATOR_ADDR "${common[@]}" "$BIN/devworker" >"$TMP/dw.out" 2>"$TMP/dw.err" &
PID[dw]=$!
port_of dw
env "${common[@]}" UPSQUAD_PG_DSN="$UPSQUAD_PG_DSN_ORCHESTRATOR" UPSQUAD_NATS_URL= \
    UPSQUAD_MIGRATIONS_DIR=services/orchestrator/migrations UPSQUAD_MODEL_REGISTRY_ADDR= \
    "UPSQUAD_WORKER_TARGETS=127.0.0.1:${PORT[dw]}" UPSQUAD_WORKER_PROBE=200ms \
    "$BIN/orchestrator" >"$TMP/orch.out" 2>"$TMP/orch.err" &
PID[orch]=$!
port_of orch
printf '{"role": "bench", "display_name": "Bench", "model": "claude-sonnet-4-6"}' >"$TMP/agent.json"
AGENT=$(UPSQUAD_PG_DSN="$UPSQUAD_PG_DSN_ORCHESTRATOR" "$BIN/upsquad-agents" --org "$ORG" \
    apply "$TMP/agent.json" | awk '{print $1}')
TOKEN=$(UPSQUAD_JWT_SECRET=$SECRET UPSQUAD_JWT_AUDIENCE=upsquad "$BIN/upsquad-token" \
    --sub 0be00000-0000-4000-8000-0000000000a1 --org "$ORG" --ttl 3600)
sleep 0.5 # the first worker probe

run() { # run <side> : one JSON line
    if [ "$1" = relay ]; then
        "$BIN/orchestrator-relay" --mode relay --target "127.0.0.1:${PORT[orch]}" --token "$TOKEN" \
            --agent "$AGENT" --count "$N"
    else
        "$BIN/orchestrator-relay" --mode direct --target "127.0.0.1:${PORT[dw]}" --token "$TOKEN" \
            --count "$N"
    fi
}
run relay >/dev/null
run direct >/dev/null
: >"$TMP/runs.jsonl"
for round in $(seq "$ROUNDS"); do
    for s in relay direct; do
        printf '{"side":"%s","round":%d,"result":%s}\n' "$s" "$round" "$(run $s)" >>"$TMP/runs.jsonl"
    done
done
FIRSTLINE=$("$BIN/orchestrator-relay" --mode first --target "127.0.0.1:${PORT[orch]}" \
    --token "$TOKEN" --agent "$AGENT" --count "$FIRST")

export N ROUNDS FIRSTLINE
"$PY" - "$TMP/runs.jsonl" "$OUT/orchestrator.md" <<'PYEOF'
import json, os, statistics, sys, time
runs = [json.loads(l) for l in open(sys.argv[1])]
def med(side, key):
    return statistics.median(r["result"][key] for r in runs if r["side"] == side)
first = json.loads(os.environ["FIRSTLINE"])
label = {"relay": "through the orchestrator (SendMessage)", "direct": "devworker read directly (ExecuteStep)"}
lines = ["# orchestrator relay (%s)" % time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "",
         "One stream of %s tokens (a devworker burst script), same client; medians of %s runs." %
         (os.environ["N"], os.environ["ROUNDS"]), "",
         "| path | tokens/s | gap p50 us | gap p99 us |", "|---|---|---|---|"]
for s in ("relay", "direct"):
    lines.append("| %s | %.0f | %.2f | %.2f |" % (label[s], med(s, "tokens_per_s"),
                                                   med(s, "gap_p50_us"), med(s, "gap_p99_us")))
lines += ["", "Session create + first token (SendMessage without a session, %d turns): p50 %.2f ms, "
          "p99 %.2f ms." % (first["turns"], first["first_p50_ms"], first["first_p99_ms"])]
ratio = med("relay", "tokens_per_s") / med("direct", "tokens_per_s")
added = med("relay", "gap_p99_us") - med("direct", "gap_p99_us")
text = "\n".join(lines)
print(text)
print("baseline: %s, the same script and client without the relay" % label["direct"])
print("ratio: relay tokens/s / direct tokens/s = %.2f (target >= 0.8); p99 gap added by the "
      "relay = %.0f us (target < 1000)" % (ratio, added))
with open(sys.argv[2], "w") as f:
    f.write(text + "\n\nbaseline: %s\n\nratio tokens/s = %.2f, p99 gap added = %.0f us\n" %
            (label["direct"], ratio, added))
PYEOF
