#!/usr/bin/env bash
# orchestrator relay against its limit: one SendMessage streaming a devworker burst script of
# N tokens through the orchestrator (build/bin/orchestrator -> build/bin/devworker), against the
# same script read through a bare relay (`orchestrator-relay --mode bare`: a server on the same
# libcommon rpc layer the orchestrator uses, one server stream in, one client stream out, each
# event re-sent as read, no service logic), by the same client, on the same machine in the same
# run. The relay necessarily receives and re-sends each token, so the bare relay is the limit;
# the ratio isolates what the orchestrator's service logic costs. Figures: tokens/s (from the
# request to the last token: the rate the caller sees; the relay's turn runs in a session
# created beforehand, untimed) and the per-token gap p50/p99, as ratios (target: >= 0.9 of the
# bare relay's rate, p99 gap added < 1 ms). The devworker read directly (no relay at all) is
# measured too, for reference. The first-to-last-token rate is printed but is not the figure:
# the devworker's transport sends whole runs of tokens per write, so when the client's first
# read comes late it finds most of the stream buffered and that "rate" is the client's decoding
# speed. Also: session create + first token latency (SendMessage without a session: create,
# snapshot, InitWorkerSession, turn) over FIRST_TURNS turns.
# Runs alternate relay, bare, direct for ROUNDS rounds after one warm-up of each (the same load
# for every side: each round's runs go back to back); the ratio is the median of the rounds'
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
# the bench's client calls the devworker with a member token (directly and through the bare
# relay), not the orchestrator's scoped one
env -u UPSQUAD_ORCHESTRATOR_ADDR "${common[@]}" UPSQUAD_DEVWORKER_REQUIRE_SCOPE=any "$BIN/devworker" >"$TMP/dw.out" 2>"$TMP/dw.err" &
PID[dw]=$!
port_of dw
"$BIN/orchestrator-relay" --mode bare --target "127.0.0.1:${PORT[dw]}" >"$TMP/bare.out" \
    2>"$TMP/bare.err" &
PID[bare]=$!
port_of bare
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
    else # bare and direct: the same ExecuteStep read, through the bare relay or not
        local port=${PORT[dw]}
        [ "$1" = bare ] && port=${PORT[bare]}
        "$BIN/orchestrator-relay" --mode direct --target "127.0.0.1:$port" --token "$TOKEN" \
            --count "$N"
    fi
}
run relay >/dev/null
run bare >/dev/null
run direct >/dev/null
: >"$TMP/runs.jsonl"
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; } # user + system CPU, clock ticks
for round in $(seq "$ROUNDS"); do
    for s in relay bare direct; do
        d0=$(ticks "${PID[dw]}") o0=$(ticks "${PID[orch]}") b0=$(ticks "${PID[bare]}")
        res=$(run $s)
        printf '{"side":"%s","round":%d,"result":%s,"dw_ticks":%d,"orch_ticks":%d,"bare_ticks":%d}\n' \
            "$s" "$round" "$res" $(($(ticks "${PID[dw]}") - d0)) \
            $(($(ticks "${PID[orch]}") - o0)) $(($(ticks "${PID[bare]}") - b0)) \
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
label = {"relay": "through the orchestrator (SendMessage)",
         "bare": "through a bare relay (ExecuteStep, rpc layer only)",
         "direct": "devworker read directly (ExecuteStep)"}
pairs = {}
for r in runs:
    pairs.setdefault(r["round"], {})[r["side"]] = r["result"]
def ratios_to(base):
    r = sorted(p["relay"]["tokens_per_s"] / p[base]["tokens_per_s"] for p in pairs.values())
    a = sorted(p["relay"]["gap_p99_us"] - p[base]["gap_p99_us"] for p in pairs.values())
    return r, a, statistics.median(r), statistics.median(a)
ratios, added, ratio, add = ratios_to("bare")
dratios, dadded, dratio, dadd = ratios_to("direct")
load = open("/proc/loadavg").read().split()[0]
lines = ["# orchestrator relay (%s, load average %s)" % (time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load), "",
         "One stream of %s tokens (a devworker burst script), same client; medians of %s "
         "alternating rounds (relay, bare, direct). tokens/s: request to last token." % (
             os.environ["N"], os.environ["ROUNDS"]), "",
         "| path | tokens/s | first token ms | first-to-last tokens/s | gap p50 us | gap p99 us |",
         "|---|---|---|---|---|---|"]
for s in ("relay", "bare", "direct"):
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
keys = {"relay": ("dw_ticks", "orch_ticks", "client"), "bare": ("dw_ticks", "bare_ticks", "client"),
        "direct": ("dw_ticks", "client")}
cpu = {s: {k: cpu_us(s, k) for k in keys[s]} for s in keys}
tot = {s: sum(cpu[s].values()) for s in keys}
lines += ["", "CPU per token (all rounds): relay path: devworker %.2f us + orchestrator %.2f us + "
          "client %.2f us = %.2f us; bare relay path: devworker %.2f us + bare relay %.2f us + "
          "client %.2f us = %.2f us; direct: devworker %.2f us + client %.2f us = %.2f us "
          "(the ratio the CPU allows when the path is CPU-bound, relay to bare: %.2f)" % (
              cpu["relay"]["dw_ticks"], cpu["relay"]["orch_ticks"], cpu["relay"]["client"],
              tot["relay"], cpu["bare"]["dw_ticks"], cpu["bare"]["bare_ticks"],
              cpu["bare"]["client"], tot["bare"], cpu["direct"]["dw_ticks"],
              cpu["direct"]["client"], tot["direct"], tot["bare"] / tot["relay"])]
text = "\n".join(lines)
print(text)
print("baseline: %s, the same script and client through a relay without service logic" % label["bare"])
summary = ("ratio: relay tokens/s / bare relay tokens/s = %.2f (median of %d rounds, range "
           "%.2f-%.2f; target >= 0.9); p99 gap added vs the bare relay = %.0f us (median; range "
           "%.0f..%.0f; target < 1000). For reference, to the devworker read directly: %.2f "
           "(range %.2f-%.2f), p99 gap added %.0f us" % (
               ratio, len(ratios), ratios[0], ratios[-1], add, added[0], added[-1],
               dratio, dratios[0], dratios[-1], dadd))
print(summary)
with open(sys.argv[2], "w") as f:
    f.write(text + "\n\nbaseline: %s\n\n%s\n" % (label["bare"], summary))
PYEOF
