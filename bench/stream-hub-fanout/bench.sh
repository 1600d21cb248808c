#!/usr/bin/env bash
# stream-hub fan-out benchmark (run by `make bench`; docs/stream-hub.md):
#   1. frames/s delivered to SUBS (1,000) StreamNodeIO subscribers of one run through the hub
#      (frames published on NATS by build/bin/hub-publisher, decoded, encoded once, pushed to
#      every subscriber), against the baseline: the same frames, encoded once and pushed to
#      SUBS bare libcommon streams by an in-process producer with no hub logic and no NATS
#      (build/bin/stream-hub-fanout bare). Same client, same frame size, as a ratio
#      (target >= 0.8);
#   2. through the hub, at a rate the client sustains, with one subscriber that stops
#      reading: the others' loss (target < 5%), and what the stalled one got;
#   3. publish-to-client latency p50/p99 at a paced rate (hub and baseline);
#   4. memory per idle subscriber: the hub's RSS with SUBS idle subscribers minus before,
#      divided by SUBS (and the same for the bare server).
# Needs the runtime (UPSQUAD_PG_DSN_STREAM_HUB, UPSQUAD_PG_ADMIN_DSN, UPSQUAD_NATS_URL); prints
# SKIP without it. Every process it starts listens on 127.0.0.1 and is stopped by pid.
#
#   BUILD  build folder (default build)    SUBS  subscribers (default 1000)
#   FRAMES frames of the throughput runs (default 200)    SIZE  token_text bytes (default 256)
#   HUB_ENV VAR=value settings of the hub (default UPSQUAD_RPC_UNARY_THREADS=1, as deployed:
#          k8s/stream-hub.yaml)
#   ROUNDS throughput rounds (default 3)
#   BARE_BATCH frames per batch of the third baseline (default 16, the hub's
#          UPSQUAD_HUB_FANOUT_BATCH)
# The throughput figures are interleaved rounds (each round: the hub, the baseline with 1 and
# with 2 completion-queue threads, and with 1 thread pushing in batches whose sends start
# together as the hub's bursts do, in an order that rotates from round to round, so a burst of
# load from the machine's other users hits every side alike); each side's figure is its median
# over the rounds, the baseline is the best of its three medians (its knobs at their best),
# and the ratio is the hub's median over it. Every round's own ratio is printed too, with the
# load average around it. The CPU (user + system) each serving process spent per delivered
# frame, from the client's ready to its last frame, is printed per side: steadier than the
# rates on a machine shared with other work, and where the hub's cost shows; so is the client's
# own CPU per frame, and every round's longest pause between two live frames (a sender that
# stalls, as a transport holding a whole burst before its first write did, shows there).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN="$BUILD/bin"
SUBS=${SUBS:-1000}
FRAMES=${FRAMES:-200}
SIZE=${SIZE:-256}
ROUNDS=${ROUNDS:-3}
BARE_BATCH=${BARE_BATCH:-16}

if [[ -z "${UPSQUAD_PG_DSN_STREAM_HUB:-}" || -z "${UPSQUAD_NATS_URL:-}" || -z "${UPSQUAD_PG_ADMIN_DSN:-}" ]]; then
    echo "stream-hub bench: SKIP (the runtime's UPSQUAD_PG_DSN_STREAM_HUB, UPSQUAD_PG_ADMIN_DSN and UPSQUAD_NATS_URL are required)"
    exit 0
fi
for b in stream-hub stream-hub-fanout hub-publisher upsquad-token; do
    [[ -x "$BIN/$b" ]] || { echo "stream-hub bench: $BIN/$b is missing (make tests-build)"; exit 1; }
done

TMP=$(mktemp -d /tmp/hub-bench.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    [[ -n "${KEEP:-}" ]] || rm -rf "$TMP"
}
trap cleanup EXIT

uuid() { cat /proc/sys/kernel/random/uuid; }
rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; } # user + system, clock ticks
PY=/usr/bin/python3
json() { "$PY" -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$1" "$2"; }

# start_hub NAME [ENV=VALUE...]: a hub on a free port; sets HUB_PID and HUB_ADDR
start_hub() {
    local name=$1
    shift
    env UPSQUAD_PG_DSN="$UPSQUAD_PG_DSN_STREAM_HUB" UPSQUAD_GRPC_ADDR=127.0.0.1:0 \
        UPSQUAD_METRICS_ADDR=127.0.0.1:0 UPSQUAD_LOG_LEVEL=warn \
        UPSQUAD_MIGRATIONS_DIR=services/stream-hub/migrations \
        UPSQUAD_HUB_PROJECTION_DURABLE="bench-$$-$name-events" \
        UPSQUAD_HUB_TRANSCRIPT_DURABLE="bench-$$-$name-io" UPSQUAD_HUB_PROJECTION_FROM=new \
        UPSQUAD_RPC_MAX_STREAMS=$((SUBS + 64)) ${HUB_ENV:-UPSQUAD_RPC_UNARY_THREADS=1} "$@" \
        "$BIN/stream-hub" >"$TMP/$name.out" 2>"$TMP/$name.err" &
    HUB_PID=$!
    PIDS+=("$HUB_PID")
    for _ in $(seq 100); do
        grep -q '^port=' "$TMP/$name.out" 2>/dev/null && break
        sleep 0.1
    done
    HUB_ADDR=127.0.0.1:$(sed -n 's/^port=//p' "$TMP/$name.out")
}

start_bare() { # FRAMES RATE [THREADS [BATCH]]
    BENCH_SUBS=$SUBS BENCH_FRAMES=$1 BENCH_SIZE=$SIZE BENCH_RATE=$2 BENCH_THREADS=${3:-1} \
        BENCH_BATCH=${4:-1} \
        "$BIN/stream-hub-fanout" bare >"$TMP/bare.out" 2>"$TMP/bare.err" &
    BARE_PID=$!
    PIDS+=("$BARE_PID")
    for _ in $(seq 50); do
        grep -q '^port=' "$TMP/bare.out" 2>/dev/null && break
        sleep 0.1
    done
    BARE_ADDR=127.0.0.1:$(sed -n 's/^port=//p' "$TMP/bare.out")
}

# client ADDR FRAMES [ENV=VALUE...]: starts the client in the background on a fifo; sets
# CLIENT_PID and waits for "ready"
client() {
    local addr=$1 frames=$2
    shift 2
    rm -f "$TMP/client.out"
    env BENCH_SUBS=$SUBS BENCH_FRAMES="$frames" BENCH_RUN="$RUN" BENCH_TOKEN="$TOKEN" \
        BENCH_IDLE_MS=3000 "$@" "$BIN/stream-hub-fanout" client "$addr" >"$TMP/client.out" \
        2>"$TMP/client.err" &
    CLIENT_PID=$!
    PIDS+=("$CLIENT_PID")
    for _ in $(seq 600); do
        grep -q '^ready' "$TMP/client.out" 2>/dev/null && return 0
        kill -0 "$CLIENT_PID" 2>/dev/null || break
        sleep 0.1
    done
    echo "stream-hub bench: the client did not get ready"; cat "$TMP/client.err" | tail -3
    # a server that died says why in its own stderr ($TMP is removed on exit unless KEEP=1)
    for f in "$TMP"/*.err; do
        [[ "$f" == "$TMP/client.err" || ! -s "$f" ]] || { echo "--- $f"; tail -n 20 "$f"; }
    done
    return 1
}
# waits for the client (not in a subshell: only the parent can wait for it); sets RESULT
client_result() {
    wait "$CLIENT_PID" || true
    RESULT=$(grep '^{' "$TMP/client.out" | tail -1 || true)
    [[ -n "$RESULT" ]] || { echo "stream-hub bench: the client printed no result"; tail -3 "$TMP/client.err"; exit 1; }
}

ORG=$(uuid)
RUN=$(uuid)
TOKEN=$(UPSQUAD_JWT_SECRET=$UPSQUAD_JWT_SECRET "$BIN/upsquad-token" --sub "$(uuid)" --org "$ORG" \
    --clearance 5 --ttl 3600)
PUB_IN="$TMP/pub.in"
mkfifo "$PUB_IN"
"$BIN/hub-publisher" "$UPSQUAD_NATS_URL" <"$PUB_IN" >"$TMP/pub.out" 2>/dev/null &
PUB_PID=$!
PIDS+=("$PUB_PID")
exec 9>"$PUB_IN"
pub() {
    local before
    before=$(wc -l <"$TMP/pub.out")
    echo "$1" >&9
    for _ in $(seq 3000); do
        [[ $(wc -l <"$TMP/pub.out") -gt $before ]] && return 0
        sleep 0.01
    done
    echo "stream-hub bench: the publisher did not answer"
    return 1
}

start_hub hub
pub "{\"op\":\"run\",\"org\":\"$ORG\",\"run\":\"$RUN\",\"seq\":1,\"status\":\"running\"}"
for _ in $(seq 300); do
    n=$(psql "$UPSQUAD_PG_ADMIN_DSN" -XAtqc "SELECT count(*) FROM stream_hub.runs WHERE run_id = '$RUN'" 2>/dev/null || echo 0)
    [[ "$n" == 1 ]] && break
    sleep 0.1
done
SEQ=0
publish() { # publish COUNT RATE SIZE
    pub "{\"op\":\"tokens\",\"org\":\"$ORG\",\"run\":\"$RUN\",\"node\":\"coder\",\"session\":\"s1\",\"from\":$((SEQ + 1)),\"count\":$1,\"rate\":$2,\"size\":$3}"
    SEQ=$((SEQ + $1))
}

echo "stream-hub bench: $SUBS subscribers of one run, $FRAMES frames of $SIZE bytes, $ROUNDS rounds"
loadavg() { cut -d' ' -f1 /proc/loadavg; }
# 4: idle memory (the hub's before its first round, the bare server's in its first round)
sleep 0.5
rss0=$(rss_kb "$HUB_PID")
rss1=
brss0=
brss1=
# one throughput measurement each; appends "side rate delivered expected" to $TMP/rounds
hub_round() {
    client "$HUB_ADDR" "$FRAMES"
    sleep 0.5
    [[ -n "$rss1" ]] || rss1=$(rss_kb "$HUB_PID")
    local c0
    c0=$(cpu_ticks "$HUB_PID")
    publish "$FRAMES" 0 "$SIZE"
    client_result
    echo "hub $(json "$RESULT" rate) $(json "$RESULT" delivered) $(json "$RESULT" expected) $(($(cpu_ticks "$HUB_PID") - c0)) $(json "$RESULT" client_cpu_us) $(json "$RESULT" max_gap_us)" >>"$TMP/rounds"
}
bare_round() { # THREADS [BATCH]: side "bare<threads>" or "bare<threads>b<batch>"
    local side=bare$1
    [[ "${2:-1}" == 1 ]] || side=bare$1b$2
    start_bare "$FRAMES" 0 "$1" "${2:-1}"
    sleep 0.3
    local r0 r1
    r0=$(rss_kb "$BARE_PID")
    local c0
    client "$BARE_ADDR" "$FRAMES"
    c0=$(cpu_ticks "$BARE_PID") # every stream attached; the producer starts 300 ms after that
    sleep 0.2
    r1=$(rss_kb "$BARE_PID")
    [[ -n "$brss0" ]] || { brss0=$r0; brss1=$r1; }
    client_result
    local c1
    c1=$(cpu_ticks "$BARE_PID")
    kill "$BARE_PID"; wait "$BARE_PID" 2>/dev/null || true
    echo "$side $(json "$RESULT" rate) $(json "$RESULT" delivered) $(json "$RESULT" expected) $((c1 - c0)) $(json "$RESULT" client_cpu_us) $(json "$RESULT" max_gap_us)" >>"$TMP/rounds"
}
: >"$TMP/rounds"
for r in $(seq "$ROUNDS"); do
    echo "round $r load $(loadavg)" >>"$TMP/rounds"
    case $((r % 4)) in
    1) hub_round; bare_round 1; bare_round 2; bare_round 1 "$BARE_BATCH" ;;
    2) bare_round 1; bare_round 2; bare_round 1 "$BARE_BATCH"; hub_round ;;
    3) bare_round 2; bare_round 1 "$BARE_BATCH"; hub_round; bare_round 1 ;;
    0) bare_round 1 "$BARE_BATCH"; hub_round; bare_round 1; bare_round 2 ;;
    esac
done
echo "end load $(loadavg)" >>"$TMP/rounds"
BARE_THREADS=$("$PY" - "$TMP/rounds" <<'EOF'
import statistics, sys
r = {}
for line in open(sys.argv[1]):
    k, v = line.split()[:2]
    if k.startswith("bare"):
        r.setdefault(k, []).append(float(v))
print(max(r, key=lambda k: statistics.median(r[k]))[4:].split("b")[0])
EOF
)

# 3: latency at a paced rate (20 frames/s to every subscriber)
LAT_FRAMES=60
client "$HUB_ADDR" "$LAT_FRAMES"
publish "$LAT_FRAMES" 20 "$SIZE"
client_result
HUB_L=$RESULT
start_bare "$LAT_FRAMES" 20 "$BARE_THREADS"
client "$BARE_ADDR" "$LAT_FRAMES"
client_result
BARE_L=$RESULT
kill "$BARE_PID"; wait "$BARE_PID" 2>/dev/null || true

# 2: one stalled subscriber, at a rate the client sustains for all the others (25 frames/s to
# each); a hub with 64-frame queues and 2 KiB frames, so the stalled one overflows in seconds
kill "$HUB_PID"; wait "$HUB_PID" 2>/dev/null || true
start_hub stalled UPSQUAD_RPC_STREAM_QUEUE=64
STALL_FRAMES=125
client "$HUB_ADDR" "$STALL_FRAMES" BENCH_STALLED=1
publish "$STALL_FRAMES" 25 2048
client_result
HUB_S=$RESULT

echo "  hub paced:  $HUB_L"
echo "  bare paced: $BARE_L"
echo "  stalled:    $HUB_S"
sed 's/^/  /' "$TMP/rounds"
"$PY" - "$TMP/rounds" "$HUB_L" "$BARE_L" "$HUB_S" "$rss0" "$rss1" "$brss0" "$brss1" "$SUBS" <<'EOF'
import json, statistics, sys
import os
tick = os.sysconf("SC_CLK_TCK")
rounds, per, loads, cur, cpu, ccpu, pause = {}, [], [], {}, {}, {}, {}
for line in open(sys.argv[1]):
    w = line.split()
    if w[0] in ("round", "end"):
        loads.append(float(w[-1]))
        if cur:
            per.append(cur)
        cur = {}
        continue
    rounds.setdefault(w[0], []).append((float(w[1]), int(w[2]), int(w[3])))
    cpu.setdefault(w[0], []).append(int(w[4]) * 1e6 / tick / max(int(w[2]), 1))
    ccpu.setdefault(w[0], []).append(int(w[5]) / max(int(w[2]), 1))
    pause.setdefault(w[0], []).append(int(w[6]) / 1000)
    cur[w[0]] = float(w[1])
hl, bl, hs = (json.loads(a) for a in sys.argv[2:5])
rss0, rss1, brss0, brss1, subs = (int(a) for a in sys.argv[5:10])
med = {k: statistics.median(r for r, _, _ in v) for k, v in rounds.items()}
bares = sorted(k for k in med if k.startswith("bare"))
best = max(bares, key=lambda k: med[k])
base = med[best]
ratio = med["hub"] / base if base else 0
lossless = all(d == e for _, d, e in rounds["hub"])
each = [p["hub"] / max(v for k, v in p.items() if k.startswith("bare")) for p in per]
def knob(k):
    t, _, b = k[4:].partition("b")
    return "%s thread(s)%s" % (t, ", batches of %s frames started together" % b if b else "")
loss = 1 - hs["delivered"] / hs["expected"] if hs["expected"] else 1
print("baseline: %d bare libcommon streams (libcommon rpc_server, %s: the best median of 1 "
      "thread, 2 threads, 1 thread with batched sends; in-process producer pushing each frame "
      "encoded once, lossless), same client and frames: median %.0f frames/s delivered over %d "
      "rounds (%s)" % (subs, knob(best), base, len(per), "; ".join(
          "%s: %s" % (knob(k), " ".join("%.0f" % r for r, _, _ in rounds[k])) for k in bares)))
print("hub: median %.0f frames/s delivered to %d subscribers (rounds: %s; every frame to every "
      "subscriber: %s): ratio %.2f (target >= 0.8); per round (hub / the round's better "
      "baseline): %s; load average %s"
      % (med["hub"], subs, " ".join("%.0f" % r for r, _, _ in rounds["hub"]),
         "yes" if lossless else "NO", ratio, " ".join("%.2f" % e for e in each),
         " -> ".join("%.1f" % l for l in loads)))
print("server CPU per delivered frame (user+system of the serving process, from the client's "
      "ready to its last frame; median over the rounds): hub %.2f us, bare %.2f us (%s); "
      "hub rounds: %s" % (statistics.median(cpu["hub"]), statistics.median(cpu[best]),
      knob(best), " ".join("%.2f" % c for c in cpu["hub"])) + "; bare: %s" % "; ".join(
          "%s %.2f us" % (knob(k), statistics.median(cpu[k])) for k in bares))
print("client CPU per delivered frame (the one client's user+system from its first live frame to "
      "its last; median over the rounds): hub side %.2f us (rounds: %s), bare side %.2f us (%s; "
      "rounds: %s)" % (statistics.median(ccpu["hub"]), " ".join("%.2f" % c for c in ccpu["hub"]),
                       statistics.median(ccpu[best]), knob(best),
                       " ".join("%.2f" % c for c in ccpu[best])))
print("longest pause between two live frames, per round (ms): hub %s; bare (%s) %s" % (
    " ".join("%.0f" % p for p in pause["hub"]), knob(best),
    " ".join("%.0f" % p for p in pause[best])))
print("stalled: one subscriber stops reading: the others lost %.2f%% (target < 5%%), the "
      "stalled one got %d frames, %d gaps" % (100 * loss, hs["stalled_live"], hs["gaps"]))
print("latency publish->client at 20 frames/s x %d: hub p50 %.2f ms p99 %.2f ms; bare p50 "
      "%.2f ms p99 %.2f ms" % (subs, hl["p50_ms"], hl["p99_ms"], bl["p50_ms"], bl["p99_ms"]))
print("memory per idle subscriber: hub %.1f KiB (RSS %d -> %d KiB), bare %.1f KiB"
      % ((rss1 - rss0) / subs, rss0, rss1, (brss1 - brss0) / subs))
EOF
