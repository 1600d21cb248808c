#!/usr/bin/env bash
# libcommon's concurrency model against its limits (run by `make bench`; build/bin/libcommon-conc):
#   (a) blocking handlers: an RPC_BLOCKING handler running one transaction with
#       SELECT pg_sleep(0.001) on a pool of 2, 4 and 8 threads (2x as many callers: saturated),
#       against the same transaction run by as many threads on direct libpq connections;
#       calls/s, the ratio, and the p99 of Health/Check probed every 2 ms meanwhile (target
#       < 5 ms);
#   (b) relay: 1,000 concurrent server streams read through a libcommon relay server that reads
#       each from a backend with the async client, against the backend read directly by the
#       same async reader; messages/s, the ratio (target >= 0.8; the median of RELAY_ROUNDS
#       alternating direct/relayed rounds, with its range and the load average) and the
#       process's threads at 100 and 1,000 streams (target: independent of the streams);
#   (c) fan-out: 10,000 NATS subscriptions on nats.c's shared delivery pool (2 threads) against
#       a thread per subscription (measured at FANOUT_BASELINE_SUBS, default 2,000: 10,000
#       threads on a shared 2-core machine would disturb everyone else); threads and RSS.
# Needs the runtime's Postgres (UPSQUAD_PG_ADMIN_DSN) and NATS (UPSQUAD_NATS_URL); the parts
# without theirs print SKIP. Everything runs in-process on 127.0.0.1 and ends with it.
#
#   BUILD  build folder (default build)    DURATION  seconds per pg run (default 2)
#   RELAY_STREAMS (1000)  RELAY_COUNT messages per stream (100)  RELAY_ROUNDS (5)
#   FANOUT_SUBS (10000)   FANOUT_BASELINE_SUBS (2000)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN="$BUILD/bin/libcommon-conc"
OUT=$BUILD/bench
DURATION=${DURATION:-2}
RELAY_STREAMS=${RELAY_STREAMS:-1000}
RELAY_COUNT=${RELAY_COUNT:-100}
RELAY_ROUNDS=${RELAY_ROUNDS:-5}
FANOUT_SUBS=${FANOUT_SUBS:-10000}
FANOUT_BASELINE_SUBS=${FANOUT_BASELINE_SUBS:-2000}
[ -x "$BIN" ] || { echo "libcommon-conc bench: $BIN missing (run make bench)" >&2; exit 1; }
mkdir -p "$OUT"
J=$OUT/libcommon-conc.jsonl
: >"$J"
failed=0
run() { "$BIN" "$@" >>"$J" || { failed=1; echo "libcommon-conc bench: $* failed" >&2; }; }

if [ -n "${UPSQUAD_PG_ADMIN_DSN:-}" ]; then
    for w in 2 4 8; do
        run pg --workers "$w" --duration "$DURATION"
        run pgdirect --workers "$w" --duration "$DURATION"
    done
else
    echo "libcommon-conc bench (a): SKIP (UPSQUAD_PG_ADMIN_DSN is not set)"
fi
# (b) alternating rounds, direct then relayed, back to back: both sides of a round see the same
# load of the machine; the ratio is the median of the rounds' ratios, printed with its range
for _ in $(seq "$RELAY_ROUNDS"); do
    run relay --streams "$RELAY_STREAMS" --count "$RELAY_COUNT" --direct 1
    run relay --streams "$RELAY_STREAMS" --count "$RELAY_COUNT" --direct 0
done
run relay --streams 100 --count "$RELAY_COUNT" --direct 0
if [ -n "${UPSQUAD_NATS_URL:-}" ]; then
    run fanout --subs "$FANOUT_SUBS" --delivery-threads 2
    run fanout --subs "$FANOUT_BASELINE_SUBS" --delivery-threads 0
else
    echo "libcommon-conc bench (c): SKIP (UPSQUAD_NATS_URL is not set)"
fi

echo "baseline: (a) direct libpq, one connection per thread, the same transaction" \
    "(BEGIN; SELECT pg_sleep(0.001); ROLLBACK) at the same concurrency as the pool;" \
    "(b) the backend's streams read directly by the same async reader (2 I/O threads);" \
    "(c) nats.c's default, a delivery thread per subscription"
/usr/bin/python3 - "$J" "$OUT/libcommon-conc.md" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
md = []
pg = {r["workers"]: r for r in rows if r["mode"] == "pg"}
pd = {r["workers"]: r for r in rows if r["mode"] == "pgdirect"}
if pg:
    md += ["(a) RPC_BLOCKING handler waiting ~1 ms on Postgres, pool saturated (2 callers per "
           "thread)", "",
           "| pool threads | calls/s | direct libpq calls/s | ratio | Health/Check p50 ms | "
           "p99 ms |", "|---:|---:|---:|---:|---:|---:|"]
    for w in sorted(pg):
        a, b = pg[w], pd.get(w, {})
        ratio = a["calls_per_s"] / b["calls_per_s"] if b.get("calls_per_s") else 0
        md.append(f"| {w} | {a['calls_per_s']:,.0f} | {b.get('calls_per_s', 0):,.0f} | "
                  f"{ratio:.2f} | {a['health_p50_ms']:.2f} | {a['health_p99_ms']:.2f} |")
    md.append("")
rl = [r for r in rows if r["mode"] == "relay"]
full = [r for r in rl if r["streams"] == max(x["streams"] for x in rl)] if rl else []
dd = [r for r in full if r["direct"] == 1]
rr = [r for r in full if r["direct"] == 0]
if dd and rr:
    import statistics
    ratios = sorted(b["messages_per_s"] / a["messages_per_s"] for a, b in zip(dd, rr))
    load = open("/proc/loadavg").read().split()[0]
    md += ["(b) server streams relayed through a libcommon server with the async client "
           f"({len(ratios)} alternating rounds, load average {load})", "",
           "| path | streams | messages/s (median) | range | threads idle | threads peak |",
           "|---|---:|---:|---|---:|---:|"]
    def row(name, rs):
        v = sorted(r["messages_per_s"] for r in rs)
        return (f"| {name} | {rs[0]['streams']} | {statistics.median(v):,.0f} | "
                f"{v[0]:,.0f}-{v[-1]:,.0f} | {max(r['threads_idle'] for r in rs)} | "
                f"{max(r['threads_peak'] for r in rs)} |")
    md.append(row("direct", dd))
    md.append(row("relay", rr))
    small = [r for r in rl if r["streams"] != full[0]["streams"]]
    if small:
        md.append(row("relay", small))
    cd = statistics.median(r["cpu_us_per_msg"] for r in dd)
    cr = statistics.median(r["cpu_us_per_msg"] for r in rr)
    md += ["", f"ratio relay/direct: median {statistics.median(ratios):.2f}, range "
           f"{ratios[0]:.2f}-{ratios[-1]:.2f} (target >= 0.8); CPU per message (the process: "
           f"backend, reader and relay): direct {cd:.1f} us, relayed {cr:.1f} us (the ratio the "
           f"CPU allows when the run is CPU-bound: {cd / cr:.2f})"]
    md.append("")
fo = [r for r in rows if r["mode"] == "fanout"]
if fo:
    md += ["(c) NATS subscriptions on one connection", "",
           "| delivery | subscriptions | threads | RSS MiB | RSS KiB per subscription | "
           "subscribe ms |", "|---|---:|---:|---:|---:|---:|"]
    for r in fo:
        per = (r["rss_kb"] - r["rss_before_kb"]) / max(r["subs"], 1)
        how = (f"shared pool, {r['delivery_threads']} threads" if r["delivery_threads"]
               else "thread per subscription")
        md.append(f"| {how} | {r['subs']:,} | {r['threads']} | {r['rss_kb'] / 1024:.1f} | "
                  f"{per:.2f} | {r['subscribe_ms']:.0f} |")
text = "\n".join(md) + "\n"
open(sys.argv[2], "w").write(text)
print(text)
PY
exit $failed
