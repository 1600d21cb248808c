#!/usr/bin/env bash
# devworker token stream against its limit: tokens/s of one ExecuteStep burst script
# (#!script [{"tokens": "tok tok …"}], N TokenEvents) read directly from build/bin/devworker,
# against the bare C-core echo server (build/bin/rpc-bare-echo) streaming the same number of
# messages of about the same size on one PublicStream, read by the same client
# (build/bin/devworker-stream, libcommon's client). Builds nothing: `make bench` builds first.
#
# The bare server runs with 1 and with 2 completion-queue threads (its one knob); the baseline
# is whichever has the higher median, named on the "baseline:" line. Runs alternate
# step, bare1, bare2, … for DW_BENCH_ROUNDS rounds; medians and ratios are reported.
# Results: stdout and build/bench/devworker.md.
#
# Environment (all optional):
#   BUILD             build folder (default build)
#   DW_BENCH_TOKENS   messages per stream (default 100000)
#   DW_BENCH_ROUNDS   runs per server (default 5)
set -euo pipefail

cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN=$BUILD/bin
OUT=$BUILD/bench
N=${DW_BENCH_TOKENS:-100000}
ROUNDS=${DW_BENCH_ROUNDS:-5}
PY=/usr/bin/python3
for b in devworker rpc-bare-echo devworker-stream upsquad-token; do
    [ -x "$BIN/$b" ] || { echo "devworker bench: $BIN/$b missing (run make bench)" >&2; exit 1; }
done
mkdir -p "$OUT"
TMP=$(mktemp -d)
SECRET=devworker-bench-secret-not-for-production-0123456789
declare -A PID PORT
# shellcheck disable=SC2317  # called from the EXIT trap
cleanup() {
    local s
    for s in "${!PID[@]}"; do kill -TERM "${PID[$s]}" 2>/dev/null || true; done
    for s in "${!PID[@]}"; do wait "${PID[$s]}" 2>/dev/null || true; done
    rm -rf "$TMP"
}
trap cleanup EXIT

env -u UPSQUAD_ORCHESTRATOR_ADDR -u UPSQUAD_METRICS_ADDR UPSQUAD_LOG_LEVEL=warn \
    UPSQUAD_GRPC_ADDR=127.0.0.1:0 UPSQUAD_JWT_SECRET=$SECRET UPSQUAD_JWT_AUDIENCE=upsquad \
    UPSQUAD_DEVWORKER_REQUIRE_SCOPE=any "$BIN/devworker" >"$TMP/step.out" 2>"$TMP/step.err" &
PID[step]=$!
"$BIN/rpc-bare-echo" 127.0.0.1:0 1 >"$TMP/bare1.out" 2>"$TMP/bare1.err" &
PID[bare1]=$!
"$BIN/rpc-bare-echo" 127.0.0.1:0 2 >"$TMP/bare2.out" 2>"$TMP/bare2.err" &
PID[bare2]=$!
for s in step bare1 bare2; do
    for _ in $(seq 100); do
        PORT[$s]=$(sed -n 's/^port=\([0-9]*\)$/\1/p' "$TMP/$s.out" 2>/dev/null | head -1)
        [ -n "${PORT[$s]}" ] && break
        sleep 0.05
    done
    [ -n "${PORT[$s]}" ] || { echo "devworker bench: $s did not start" >&2; tail -5 "$TMP/$s.err" >&2; exit 1; }
done
TOKEN=$(UPSQUAD_JWT_SECRET=$SECRET UPSQUAD_JWT_AUDIENCE=upsquad "$BIN/upsquad-token" \
    --sub orchestrator --org bench --ttl 3600)

LOADAVG_START=$(cut -d' ' -f1-3 /proc/loadavg)
: >"$TMP/runs.jsonl"
for round in $(seq "$ROUNDS"); do
    for s in step bare1 bare2; do
        if [ "$s" = step ]; then
            args=(--mode step --token "$TOKEN")
        else
            args=(--mode bare --payload 8)
        fi
        line=$("$BIN/devworker-stream" --target "127.0.0.1:${PORT[$s]}" --count "$N" "${args[@]}")
        printf '{"server":"%s","round":%d,"result":%s}\n' "$s" "$round" "$line" >>"$TMP/runs.jsonl"
    done
done

LOADAVG_END=$(cut -d' ' -f1-3 /proc/loadavg)
export N ROUNDS LOADAVG_START LOADAVG_END
"$PY" - "$TMP/runs.jsonl" "$OUT/devworker.md" <<'EOF'
import json, os, statistics, sys, time
runs = [json.loads(l) for l in open(sys.argv[1])]
def med(server, key):
    return statistics.median(r["result"][key] for r in runs if r["server"] == server)
label = {"step": "devworker ExecuteStep (burst script)",
         "bare1": "rpc-bare-echo, 1 cq thread", "bare2": "rpc-bare-echo, 2 cq threads"}
base = max(("bare1", "bare2"), key=lambda s: med(s, "msgs_per_s"))
N = int(os.environ["N"])
lines = []
lines.append("# devworker token stream (%s)" % time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
lines.append("")
lines.append("One stream of %d messages, read by the same client; medians of %s runs; load "
             "average %s at the start, %s at the end (2 cores: above 2, every figure is "
             "squeezed, the devworker's two-thread pipeline more than the bare one-thread "
             "server)." % (N, os.environ["ROUNDS"], os.environ["LOADAVG_START"],
                          os.environ["LOADAVG_END"]))
lines.append("")
lines.append("| server | msgs/s | first message ms | gap p50 us | gap p99 us |")
lines.append("|---|---|---|---|---|")
for s in ("step", "bare1", "bare2"):
    lines.append("| %s | %.0f | %.2f | %.2f | %.2f |" % (
        label[s], med(s, "msgs_per_s"), med(s, "first_ms"), med(s, "gap_p50_us"),
        med(s, "gap_p99_us")))
lines.append("")
ratio = med("step", "msgs_per_s") / med(base, "msgs_per_s")
p99 = med("step", "gap_p99_us") / max(med(base, "gap_p99_us"), 1e-9)
text = "\n".join(lines)
print(text)
print("baseline: %s (bare C-core echo server at its best thread setting), %d messages of "
      "~12 bytes on one PublicStream, same client" % (label[base], N))
print("ratio: devworker tokens/s / baseline msgs/s = %.2f; p99 gap ratio = %.2f" % (ratio, p99))
with open(sys.argv[2], "w") as f:
    f.write(text + "\n\nbaseline: %s\n\nratio tokens/s = %.2f, p99 gap ratio = %.2f\n" %
            (label[base], ratio, p99))
EOF
