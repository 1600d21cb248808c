#!/usr/bin/env bash
# orchestrator relay against its limit: one SendMessage streaming a devworker burst script of
# N tokens through the orchestrator (build/bin/orchestrator -> build/bin/devworker), against the
# same script read from the devworker directly by the same client (ExecuteStep): tokens/s (from
# the request to the last token: the rate the caller sees; the relay's turn runs in a session
# created beforehand, untimed) and the per-token gap p50/p99, as ratios (target: >= 0.8 of the
# direct rate, p99 gap added < 1 ms). The first-to-last-token rate is printed too but is not
# the figure: the devworker's transport sends whole runs of tokens per write, so when the
# client's first read comes late it finds most of the stream buffered and that "rate" is the
# client's decoding speed (450,000+ tokens/s direct on a quiet machine, ~4x what the devworker
# produces). Also: session create + first token latency (SendMessage
# without a session: create, snapshot, InitWorkerSession, turn) over FIRST_TURNS turns.
# The baseline is the devworker read directly (no relay at all): the limit a relay can reach.
# Runs alternate relay, direct for ROUNDS rounds after one warm-up of each (the same load for
# both sides: each round's pair runs back to back); the ratio is the median of the rounds'
# ratios (robust to the machine's load drifting between rounds), with its range.
# Needs the runtime's Postgres and Redis (UPSQUAD_PG_DSN_ORCHESTRATOR); SKIP without them.
# Results: stdout and build/bench/orchestrator.md. Every process it starts is stopped by pid.
#
#   BUILD        build folder (default build)
#   RELAY_TOKENS tokens per stream (default 100000: a 400 KB script, so the bench's orchestrator
#                takes messages up to 1 MiB; a round of ~0.5-1 s per side averages out the
#                scheduler's hiccups that swung 15,000-token rounds 0.2-2x)
#   ROUNDS       runs of each side (default 9)       FIRST_TURNS  (default 30)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN=$BUILD/bin
OUT=$BUILD/bench
N=${RELAY_TOKENS:-100000}
ROUNDS=${ROUNDS:-9}
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
    UPSQUAD_MESSAGE_MAX=1048576 \
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
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; } # user + system CPU, clock ticks
for round in $(seq "$ROUNDS"); do
    for s in relay direct; do
        d0=$(ticks "${PID[dw]}") o0=$(ticks "${PID[orch]}")
        res=$(run $s)
        printf '{"side":"%s","round":%d,"result":%s,"dw_ticks":%d,"orch_ticks":%d}\n' "$s" \
            "$round" "$res" $(($(ticks "${PID[dw]}") - d0)) $(($(ticks "${PID[orch]}") - o0)) \
            >>"$TMP/runs.jsonl"
    done
done
FIRSTLINE=$("$BIN/orchestrator-relay" --mode first --target "127.0.0.1:${PORT[orch]}" \
    --token "$TOKEN" --agent "$AGENT" --count "$FIRST")

export N ROUNDS FIRSTLINE
cp "$TMP/runs.jsonl" "$OUT/orchestrator-runs.jsonl"
"$PY" - "$TMP/runs.jsonl" "$OUT/orchestrator.md" <<'PYEOF'
import json, os, statistics, sys, time
runs = [json.loads(l) for l in open(sys.argv[1])]
def med(side, key):
    return statistics.median(r["result"][key] for r in runs if r["side"] == side)
first = json.loads(os.environ["FIRSTLINE"])
label = {"relay": "through the orchestrator (SendMessage)", "direct": "devworker read directly (ExecuteStep)"}
pairs = {}
for r in runs:
    pairs.setdefault(r["round"], {})[r["side"]] = r["result"]
ratios = sorted(p["relay"]["tokens_per_s"] / p["direct"]["tokens_per_s"] for p in pairs.values())
added = sorted(p["relay"]["gap_p99_us"] - p["direct"]["gap_p99_us"] for p in pairs.values())
ratio, add = statistics.median(ratios), statistics.median(added)
load = open("/proc/loadavg").read().split()[0]
lines = ["# orchestrator relay (%s, load average %s)" % (time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load), "",
         "One stream of %s tokens (a devworker burst script), same client; medians of %s "
         "alternating rounds. tokens/s: request to last token." % (os.environ["N"], os.environ["ROUNDS"]), "",
         "| path | tokens/s | first token ms | first-to-last tokens/s | gap p50 us | gap p99 us |",
         "|---|---|---|---|---|---|"]
for s in ("relay", "direct"):
    lines.append("| %s | %.0f | %.2f | %.0f | %.2f | %.2f |" % (
        label[s], med(s, "tokens_per_s"), med(s, "first_ms"), med(s, "burst_tokens_per_s"),
        med(s, "gap_p50_us"), med(s, "gap_p99_us")))
lines += ["", "Session create + first token (SendMessage without a session, %d turns): p50 %.2f ms, "
          "p99 %.2f ms." % (first["turns"], first["first_p50_ms"], first["first_p99_ms"])]
# CPU per token of each process on the path, over all rounds (clock ticks of the servers,
# getrusage of the client): what a relayed token costs next to a direct one, whatever the
# machine's load did to the wall clock
hz = os.sysconf("SC_CLK_TCK")
def cpu_us(side, key):
    rs = [r for r in runs if r["side"] == side]
    toks = sum(r["result"]["tokens"] for r in rs)
    if key == "client":
        return sum(r["result"]["cpu_us"] for r in rs) / toks
    return sum(r[key] for r in rs) * 1e6 / hz / toks
cpu = {s: {k: cpu_us(s, k) for k in ("dw_ticks", "orch_ticks", "client")} for s in ("relay", "direct")}
lines += ["", "CPU per token (all rounds): relay path: devworker %.2f us + orchestrator %.2f us + "
          "client %.2f us = %.2f us; direct: devworker %.2f us + client %.2f us = %.2f us "
          "(the ratio the CPU allows when the path is CPU-bound: %.2f)" % (
              cpu["relay"]["dw_ticks"], cpu["relay"]["orch_ticks"], cpu["relay"]["client"],
              sum(cpu["relay"].values()), cpu["direct"]["dw_ticks"], cpu["direct"]["client"],
              cpu["direct"]["dw_ticks"] + cpu["direct"]["client"],
              (cpu["direct"]["dw_ticks"] + cpu["direct"]["client"]) / sum(cpu["relay"].values()))]
text = "\n".join(lines)
print(text)
print("baseline: %s, the same script and client without the relay" % label["direct"])
summary = ("ratio: relay tokens/s / direct tokens/s = %.2f (median of %d rounds, range %.2f-%.2f; "
           "target >= 0.8); p99 gap added by the relay = %.0f us (median; range %.0f..%.0f; "
           "target < 1000)" % (ratio, len(ratios), ratios[0], ratios[-1], add, added[0], added[-1]))
print(summary)
with open(sys.argv[2], "w") as f:
    f.write(text + "\n\nbaseline: %s\n\n%s\n" % (label["direct"], summary))
PYEOF
