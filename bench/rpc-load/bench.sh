#!/usr/bin/env bash
# RPC layer against its limit: libcommon's gRPC server (build/bin/echo-server) against a bare
# C-core echo server (build/bin/rpc-bare-echo), with the same C client (build/bin/rpc-load), on
# loopback. Builds nothing: `make bench` builds first.
#
# Servers: "bare" and "bare2" (the limit, with 1 and RPC_BENCH_BARE2_THREADS completion-queue
# threads: its one knob), "lib" (echo-server with the library's defaults, as deployed) and
# "lib-same" (echo-server with as many unary threads as the bare server has: the cost of the
# library's code alone, without the cost of its thread settings).
# Each scenario runs bare, bare2, lib, lib-same, bare, ... (RPC_BENCH_ROUNDS rounds) and reports
# medians and ratios to the baseline: per scenario, the bare setting with the higher median
# throughput (named in the output), so the limit is always compared at its best. Each server's
# CPU time and context switches per call (or message) are measured over the same window. Idle
# memory is read after start.
# Results: stdout, build/bench/rpc.md (markdown), build/bench/rpc.jsonl (every run).
#
# Environment (all optional):
#   BUILD                 build folder (default build)
#   RPC_BENCH_DURATION    measured seconds per run (default 1.5)
#   RPC_BENCH_WARMUP      warm-up seconds per run, not counted (default 0.3)
#   RPC_BENCH_ROUNDS      runs per server and scenario (default 5: on a shared machine more,
#                         shorter runs give steadier medians than fewer long ones)
#   RPC_BENCH_BARE_THREADS  completion-queue threads of the "bare" server and of "lib-same"
#                         (default 1: with one client connection and the client on the other
#                         core, its fastest setting on a 2-core machine)
#   RPC_BENCH_BARE2_THREADS completion-queue threads of the second bare server (default 2)
#   RPC_BENCH_SELF=1      replace echo-server by more bare servers (harness check)
set -euo pipefail

cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN=$BUILD/bin
OUT=$BUILD/bench
DURATION=${RPC_BENCH_DURATION:-1.5}
WARMUP=${RPC_BENCH_WARMUP:-0.3}
ROUNDS=${RPC_BENCH_ROUNDS:-5}
BARE_THREADS=${RPC_BENCH_BARE_THREADS:-1}
BARE2_THREADS=${RPC_BENCH_BARE2_THREADS:-2}
SELF=${RPC_BENCH_SELF:-0}
PY=/usr/bin/python3

for b in rpc-bare-echo rpc-load; do
    [ -x "$BIN/$b" ] || { echo "rpc bench: $BIN/$b missing (run make bench)" >&2; exit 1; }
done
if [ "$SELF" != 1 ] && [ ! -x "$BIN/echo-server" ]; then
    echo "rpc bench: $BIN/echo-server missing (run make bench)" >&2
    exit 1
fi

mkdir -p "$OUT"
TMP=$(mktemp -d)
SERVERS=(bare bare2 lib lib-same)
[ "$SELF" = 1 ] && SERVERS=(bare lib lib-same)
JWT_SECRET=rpc-bench-secret-not-for-production-0123456789
declare -A PID PORT LABEL RSS_IDLE ANON_IDLE CONF
# shellcheck disable=SC2317  # called from the EXIT trap
stop_servers() {
    local s
    for s in "${!PID[@]}"; do kill -TERM "${PID[$s]}" 2>/dev/null || true; done
    for s in "${!PID[@]}"; do
        for _ in $(seq 50); do kill -0 "${PID[$s]}" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "${PID[$s]}" 2>/dev/null || true
        wait "${PID[$s]}" 2>/dev/null || true
        unset "PID[$s]"
    done
}
trap 'stop_servers; rm -rf "$TMP"' EXIT

# start NAME LABEL UNARY_THREADS: a server in the background, its pid in PID[NAME].
start() {
    local name=$1 threads=$3
    LABEL[$name]=$2
    if [ "$SELF" = 1 ] || [[ "$name" = bare* ]]; then
        "$BIN/rpc-bare-echo" 127.0.0.1:0 "${threads:-$BARE_THREADS}" >"$TMP/$name.out" \
            2>"$TMP/$name.err" &
    else
        # production settings except the unary threads when asked; a secret so it starts
        env -u UPSQUAD_METRICS_ADDR -u UPSQUAD_LOG_LEVEL -u UPSQUAD_RPC_UNARY_THREADS \
            -u UPSQUAD_RPC_STREAM_THREADS \
            -u UPSQUAD_RPC_STREAM_WORKERS ${threads:+UPSQUAD_RPC_UNARY_THREADS=$threads} \
            UPSQUAD_GRPC_ADDR=127.0.0.1:0 \
            UPSQUAD_JWT_SECRET=$JWT_SECRET \
            "$BIN/echo-server" >"$TMP/$name.out" 2>"$TMP/$name.err" &
    fi
    PID[$name]=$!
}

# wait_port NAME: the port the server printed as "port=N" on stdout, into PORT[NAME].
wait_port() {
    local name=$1 port=
    for _ in $(seq 100); do
        port=$(sed -n 's/^port=\([0-9]*\)$/\1/p' "$TMP/$name.out" 2>/dev/null | head -1)
        if [ -n "$port" ]; then PORT[$name]=$port; return 0; fi
        kill -0 "${PID[$name]}" 2>/dev/null || break
        sleep 0.05
    done
    echo "rpc bench: $name did not start:" >&2
    tail -5 "$TMP/$name.err" >&2
    return 1
}

rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
hwm_kb() { awk '/^VmHWM:/ {print $2}' "/proc/$1/status"; }
anon_kb() { awk '/^RssAnon:/ {print $2}' "/proc/$1/status"; }

if [ "$SELF" = 1 ]; then
    start bare bare "" && start lib "bare (2nd)" "" && start lib-same "bare (3rd)" ""
else
    start bare "bare, $BARE_THREADS thread(s)" "" &&
        start bare2 "bare, $BARE2_THREADS thread(s)" "$BARE2_THREADS" &&
        start lib libcommon "" &&
        start lib-same "libcommon, $BARE_THREADS unary thread(s)" "$BARE_THREADS"
fi
for s in "${SERVERS[@]}"; do wait_port "$s"; done
sleep 0.5
for s in "${SERVERS[@]}"; do
    RSS_IDLE[$s]=$(rss_kb "${PID[$s]}")
    ANON_IDLE[$s]=$(anon_kb "${PID[$s]}")
    # the thread settings the library logged at start
    CONF[$s]=$(grep -o 'UPSQUAD_RPC_[A-Z_]*THREADS=[0-9]*' "$TMP/$s.err" |
        sed 's/UPSQUAD_RPC_//' | tr '\n' ' ' || true)
done
[ "$SELF" = 1 ] || CONF[bare]="$BARE_THREADS completion-queue thread(s)"
[ "$SELF" = 1 ] || CONF[bare2]="$BARE2_THREADS completion-queue thread(s)"

# name|rpc-load arguments
SCENARIOS=(
    "unary, 4 in flight|--mode unary --concurrency 4 --payload 64"
    "unary, 16 in flight|--mode unary --concurrency 16 --payload 64"
    "stream, 1 x 100k msgs|--mode stream --concurrency 1 --count 100000 --payload 64"
    "stream, 4 x 100k msgs|--mode stream --concurrency 4 --count 100000 --payload 64"
)
# Authenticated calls: libcommon verifies a bearer token on every call (Echo); the bare server,
# which verifies nothing, answers PublicEcho, so the ratio includes the whole cost of
# authentication. Needs build/bin/upsquad-token to mint the token.
TOKEN=
if [ "$SELF" != 1 ] && [ -x "$BIN/upsquad-token" ]; then
    TOKEN=$(UPSQUAD_JWT_SECRET=$JWT_SECRET "$BIN/upsquad-token" --sub rpc-bench --org bench \
        --ttl 3600 2>"$TMP/token.err") || TOKEN=
    [ -n "$TOKEN" ] || echo "rpc bench: no token ($(head -c 200 "$TMP/token.err")): skipping" \
        "the authenticated scenario" >&2
fi
[ -z "$TOKEN" ] ||
    SCENARIOS+=("unary, 16 in flight, bearer token|--mode unary --concurrency 16 --payload 64")

LOADAVG_START=$(cut -d' ' -f1-3 /proc/loadavg)
: >"$OUT/rpc.jsonl"
failed=0
for sc in "${SCENARIOS[@]}"; do
    name=${sc%%|*}
    read -r -a args <<<"${sc#*|}"
    for round in $(seq "$ROUNDS"); do
        for s in "${SERVERS[@]}"; do
            auth=()
            [[ $name != *token* || $s = bare* ]] || auth=(--token "$TOKEN")
            line=$("$BIN/rpc-load" --target "127.0.0.1:${PORT[$s]}" "${args[@]}" "${auth[@]}" \
                --duration "$DURATION" --warmup "$WARMUP" --server-pid "${PID[$s]}" \
                2>"$TMP/load.err") || {
                failed=1
                echo "rpc bench: $name ($s, round $round) failed: $(head -c 300 "$TMP/load.err")" >&2
            }
            [ -n "$line" ] || line='{}'
            printf '{"scenario":"%s","server":"%s","round":%d,"result":%s}\n' \
                "$name" "$s" "$round" "$line" >>"$OUT/rpc.jsonl"
        done
    done
done
LOADAVG_END=$(cut -d' ' -f1-3 /proc/loadavg)

# Memory after the runs, then SIGTERM: every server must exit 0.
: >"$TMP/servers.tsv"
for s in "${SERVERS[@]}"; do
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$s" "${LABEL[$s]}" "${CONF[$s]}" \
        "${RSS_IDLE[$s]}" "${ANON_IDLE[$s]}" "$(rss_kb "${PID[$s]}")" "$(hwm_kb "${PID[$s]}")" \
        >>"$TMP/servers.tsv"
    kill -TERM "${PID[$s]}"
done
for s in "${SERVERS[@]}"; do
    rc=0
    wait "${PID[$s]}" || rc=$?
    unset "PID[$s]"
    if [ $rc != 0 ]; then
        echo "rpc bench: $s exited $rc after SIGTERM" >&2
        failed=1
    fi
done

CPU_MODEL=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
export DURATION WARMUP ROUNDS LOADAVG_START LOADAVG_END CPU_MODEL
"$PY" - "$OUT/rpc.jsonl" "$TMP/servers.tsv" "$OUT/rpc.md" <<'EOF'
import json, os, statistics, sys, time

E = os.environ
runs = [json.loads(l) for l in open(sys.argv[1])]
servers = [l.rstrip("\n").split("\t") for l in open(sys.argv[2])]
names = [s[0] for s in servers]
label = {s[0]: s[1] for s in servers}
scenarios = []
for r in runs:
    if r["scenario"] not in scenarios:
        scenarios.append(r["scenario"])

def med(sc, server, key):
    v = [r["result"][key] for r in runs
         if r["scenario"] == sc and r["server"] == server and key in r["result"]]
    return statistics.median(v) if v else None

def fmt(v, nd=0):
    return "n/a" if v is None else f"{v:,.{nd}f}"

def ratio(a, b):
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}"

def keys(sc):
    if sc.startswith("stream"):
        return "msg/s", "messages_per_s", "gap_p50_ms", "gap_p99_ms", "msg"
    return "calls/s", "calls_per_s", "p50_ms", "p99_ms", "call"

def table(head, rows):
    out = ["| " + " | ".join(head) + " |",
           "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]

# The baseline of a scenario is the bare setting with the higher median throughput: the limit
# at its best on this machine (a harness check, RPC_BENCH_SELF=1, has a single "bare").
bares = [n for n in names if n == "bare" or n == "bare2"]
others = [n for n in names if n not in bares]
base = {}
for sc in scenarios:
    rate = keys(sc)[1]
    base[sc] = max(bares, key=lambda b: med(sc, b, rate) or 0)
t1, t2, t3 = [], [], []
for sc in scenarios:
    unit, rate, p50, p99, per = keys(sc)
    bs = base[sc]
    b, b99 = med(sc, bs, rate), med(sc, bs, p99)
    row = [f"{sc} ({unit})", label[bs], fmt(b)]
    for s in others:
        v = med(sc, s, rate)
        row += [fmt(v), ratio(v, b), ratio(med(sc, s, p99), b99)]
    t1.append(row)
    t2.append([sc] + [f"{fmt(med(sc, s, p50), 3)} / {fmt(med(sc, s, p99), 3)}" for s in names])
    bc = med(sc, bs, f"server_us_per_{per}")
    row = [f"{sc} (per {per})", fmt(bc, 1)]
    for s in others:
        row += [fmt(med(sc, s, f"server_us_per_{per}"), 1)]
    row += [fmt(med(sc, s, f"server_cs_per_{per}"), 2) for s in [bs] + others]
    t3.append(row)

streams = [sc for sc in scenarios if sc.startswith("stream")]
msg_bytes = med(streams[-1], bares[0], "msg_bytes") if streams else None
errors = sum(r["result"].get("errors", 0) for r in runs)
mib = lambda kb: f"{int(kb) / 1024:.1f} MiB" if kb else "n/a"

md = [f"Measured {time.strftime('%Y-%m-%d %H:%M %Z')} on {os.cpu_count()} cores "
      f"({E['CPU_MODEL']}); the client and the servers share them. Load average "
      f"{E['LOADAVG_START']} at start, {E['LOADAVG_END']} at end.", ""]
md.append(f"Median of {E['ROUNDS']} alternating runs per server, {E['WARMUP']} s warm-up + "
          f"{E['DURATION']} s measured each, one client connection, 64-byte payload "
          f"({fmt(msg_bytes)} bytes per stream message). Errors over all runs: {errors}. "
          + ("With a bearer token, libcommon verifies an HS256 token on every call (Echo) and "
             "bare answers PublicEcho, verifying nothing. "
             if any("token" in sc for sc in scenarios) else "")
          + "Servers:")
for s in servers:
    md.append(f"- {s[1]}: {s[2].strip() or 'defaults'}")
md += ["", "baseline: per scenario, the bare C-core server at its best of "
       + " and ".join(label[b] for b in bares) + " (the 'baseline' column)", ""]
md += ["Throughput and p99 latency as ratios to the baseline", ""]
head = ["scenario", "baseline", "rate"]
for s in others:
    head += [label[s], "ratio", "p99 ratio"]
md += table(head, t1)
md += ["", "Latency p50 / p99 in ms (unary: per call; stream: gap between messages)", ""]
md += table(["scenario"] + [label[s] for s in names], t2)
md += ["", "Server cost: CPU µs (utime + stime) and context switches per call or message, "
       "over the measured window", ""]
md += table(["scenario", "CPU µs: baseline"] + [label[s] for s in others] +
            ["ctx sw: baseline"] + [label[s] for s in others], t3)
md += ["", "Memory (VmRSS; RssAnon is the part not shared with other processes: heap, stacks)",
       ""]
md += table(["server", "idle after start", "RssAnon idle", "after the runs", "peak (VmHWM)"],
            [[s[1], mib(s[3]), mib(s[4]), mib(s[5]), mib(s[6])] for s in servers])
text = "\n".join(md) + "\n"
open(sys.argv[3], "w").write(text)
print("RPC layer: libcommon against a bare C-core server\n")
print(text)
EOF
echo "rpc bench: results in $OUT/rpc.md"
exit $failed
