/* libcommon-conc: benchmarks of the concurrency model (bench/libcommon-conc/bench.sh).
 *
 *   libcommon-conc pg      --workers N --duration S     (needs UPSQUAD_PG_ADMIN_DSN)
 *   libcommon-conc pgdirect --workers N --duration S
 *   libcommon-conc fanout  --subs N --delivery-threads T (needs UPSQUAD_NATS_URL)
 *   libcommon-conc relay   --streams N --count M --direct 0|1
 *
 * pg:       an in-process libcommon server whose RPC_BLOCKING handler runs one transaction
 *           with SELECT pg_sleep(0.001) (BEGIN, the SELECT, ROLLBACK) on a pool of N threads
 *           and N connections; 2N client threads call it back to back (the pool saturated,
 *           N more queued) while one prober calls Health/Check every 2 ms. Prints calls/s and
 *           the prober's p50/p99.
 * pgdirect: the limit: N threads, each with its own libpq connection, running the same
 *           transaction (BEGIN; SELECT pg_sleep(0.001); ROLLBACK) back to back.
 * fanout:   N NATS subscriptions on one connection, one message to each, then threads and RSS
 *           of the process (T = 0: a thread per subscription, nats.c's default).
 * relay:    a backend libcommon server streams M messages on each of N concurrent streams; a
 *           reader with the async client (2 I/O threads) reads them directly (--direct 1) or
 *           through a relay server (--direct 0) that reads each from the backend with the async
 *           client and pushes every message into its own server stream. Prints messages/s, the
 *           process's thread count at the peak, and its CPU time per message.
 * Output: one line of JSON. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "bus.h"
#include "db.h"
#include "grpc/health/v1/health.pb-c.h"
#include "log.h"
#include "rpc.h"
#include "rpc_astream.h"
#include "rpc_client.h"
#include "upsquad/test/v1/echo.pb-c.h"

#define PATH(m) "/upsquad.test.v1.EchoService/" m
#define REQ_DESC (&upsquad__test__v1__echo_request__descriptor)
#define RESP_DESC (&upsquad__test__v1__echo_response__descriptor)
typedef Upsquad__Test__V1__EchoRequest EchoRequest;
typedef Upsquad__Test__V1__EchoResponse EchoResponse;

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static long proc_status(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    size_t n = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, key, n) == 0 && line[n] == ':') {
            v = atol(line + n + 1);
            break;
        }
    if (f) fclose(f);
    return v;
}

static double cpu_us(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 +
           (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

static const char *arg(int argc, char **argv, const char *name, const char *def) {
    for (int i = 2; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0) return argv[i + 1];
    return def;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* ---------------------------------------------------------------- pg ---- */

static db_pool *g_pool;
static atomic_int g_stop;
static atomic_long g_calls, g_errors;
static rpc_channel *g_ch;

static int pg_handler(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                      void *ud) {
    (void)req, (void)resp, (void)ud;
    char err[256];
    db_tx *tx = NULL;
    int rc = db_tx_begin(g_pool, NULL, &tx, err, sizeof err);
    if (rc == DB_OK)
        rc = db_exec(db_tx_conn(tx), "SELECT pg_sleep(0.001)", 0, NULL, NULL, err, sizeof err);
    db_tx_rollback(tx);
    return rc == DB_OK ? RPC_OK : rpc_error(call, RPC_UNAVAILABLE, "%s", err);
}

static void *pg_client(void *a) {
    (void)a;
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    rpc_call_opts o = {.timeout_ms = 10000};
    while (!atomic_load(&g_stop)) {
        ProtobufCMessage *resp = NULL;
        int code = rpc_unary_call(g_ch, PATH("PublicEcho"), &req.base, RESP_DESC, &o, &resp, NULL);
        if (resp) protobuf_c_message_free_unpacked(resp, NULL);
        if (code == RPC_OK)
            atomic_fetch_add(&g_calls, 1);
        else
            atomic_fetch_add(&g_errors, 1);
    }
    return NULL;
}

#define PROBES_MAX 100000
static int64_t g_probe[PROBES_MAX];
static int g_nprobe;

static void *pg_prober(void *a) {
    (void)a;
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    rpc_call_opts o = {.timeout_ms = 5000};
    while (!atomic_load(&g_stop) && g_nprobe < PROBES_MAX) {
        ProtobufCMessage *resp = NULL;
        int64_t t0 = now_us();
        int code =
            rpc_unary_call(g_ch, "/grpc.health.v1.Health/Check", &req.base,
                           &grpc__health__v1__health_check_response__descriptor, &o, &resp, NULL);
        int64_t dt = now_us() - t0;
        if (resp) protobuf_c_message_free_unpacked(resp, NULL);
        if (code == RPC_OK) g_probe[g_nprobe++] = dt;
        usleep(2000);
    }
    return NULL;
}

static int bench_pg(int workers, double duration) {
    const char *dsn = getenv("UPSQUAD_PG_ADMIN_DSN");
    char err[256], target[64];
    if (!dsn) return fprintf(stderr, "UPSQUAD_PG_ADMIN_DSN is not set\n"), 2;
    db_pool_opts po;
    db_pool_opts_default(&po);
    po.size = workers;
    if (db_pool_open_ex(dsn, &po, &g_pool, err, sizeof err) != DB_OK)
        return fprintf(stderr, "db: %s\n", err), 1;
    rpc_server *s = NULL;
    rpc_server_opts o = {
        .addr = "127.0.0.1:0", .blocking_workers = workers, .blocking_queue = 4 * workers};
    rpc_method m = {
        PATH("PublicEcho"),   RPC_UNARY, RPC_AUTH_NONE, REQ_DESC, RESP_DESC, pg_handler, NULL, NULL,
        .flags = RPC_BLOCKING};
    if (rpc_server_new(&o, &s, err, sizeof err) || rpc_server_add(s, &m, 1) ||
        rpc_server_start(s, err, sizeof err))
        return fprintf(stderr, "server: %s\n", err), 1;
    snprintf(target, sizeof target, "127.0.0.1:%d", rpc_server_port(s));
    rpc_channel_opts co = {.target = target};
    if (rpc_channel_new(&co, &g_ch, err, sizeof err)) return 1;
    int nclients = 2 * workers;
    pthread_t th[64], pr;
    for (int i = 0; i < nclients; i++)
        pthread_create(&th[i], NULL, pg_client, NULL);
    usleep(300 * 1000); /* warm-up: connections open, pool saturated */
    atomic_store(&g_calls, 0);
    pthread_create(&pr, NULL, pg_prober, NULL);
    int64_t t0 = now_us();
    usleep((useconds_t)(duration * 1e6));
    long calls = atomic_load(&g_calls);
    double secs = (double)(now_us() - t0) / 1e6;
    atomic_store(&g_stop, 1);
    for (int i = 0; i < nclients; i++)
        pthread_join(th[i], NULL);
    pthread_join(pr, NULL);
    qsort(g_probe, (size_t)g_nprobe, sizeof g_probe[0], cmp_i64);
    double p50 = g_nprobe ? g_probe[g_nprobe / 2] / 1e3 : -1;
    double p99 = g_nprobe ? g_probe[(g_nprobe * 99) / 100] / 1e3 : -1;
    printf("{\"mode\":\"pg\",\"workers\":%d,\"clients\":%d,\"calls_per_s\":%.1f,\"errors\":%ld,"
           "\"health_p50_ms\":%.3f,\"health_p99_ms\":%.3f,\"health_probes\":%d}\n",
           workers, nclients, calls / secs, atomic_load(&g_errors), p50, p99, g_nprobe);
    rpc_channel_free(g_ch);
    rpc_server_shutdown(s, 1000);
    rpc_server_free(s);
    db_pool_close(g_pool);
    return 0;
}

static void *pgdirect_thread(void *a) {
    PGconn *c = PQconnectdb(getenv("UPSQUAD_PG_ADMIN_DSN"));
    (void)a;
    if (PQstatus(c) != CONNECTION_OK) {
        atomic_fetch_add(&g_errors, 1);
        PQfinish(c);
        return NULL;
    }
    static const char *const sql[] = {"BEGIN", "SELECT pg_sleep(0.001)", "ROLLBACK"};
    while (!atomic_load(&g_stop)) {
        int ok = 1;
        for (int i = 0; i < 3; i++) {
            PGresult *r = PQexec(c, sql[i]);
            ok &= PQresultStatus(r) == PGRES_COMMAND_OK || PQresultStatus(r) == PGRES_TUPLES_OK;
            PQclear(r);
        }
        atomic_fetch_add(ok ? &g_calls : &g_errors, 1);
    }
    PQfinish(c);
    return NULL;
}

static int bench_pgdirect(int workers, double duration) {
    if (!getenv("UPSQUAD_PG_ADMIN_DSN")) return 2;
    pthread_t th[64];
    for (int i = 0; i < workers; i++)
        pthread_create(&th[i], NULL, pgdirect_thread, NULL);
    usleep(300 * 1000);
    atomic_store(&g_calls, 0);
    int64_t t0 = now_us();
    usleep((useconds_t)(duration * 1e6));
    long calls = atomic_load(&g_calls);
    double secs = (double)(now_us() - t0) / 1e6;
    atomic_store(&g_stop, 1);
    for (int i = 0; i < workers; i++)
        pthread_join(th[i], NULL);
    printf("{\"mode\":\"pgdirect\",\"workers\":%d,\"calls_per_s\":%.1f,\"errors\":%ld}\n", workers,
           calls / secs, atomic_load(&g_errors));
    return 0;
}

/* ---------------------------------------------------------------- fanout ---- */

static atomic_long g_got;

static void fan_cb(bus *b, natsMsg *m, void *ud) {
    (void)b, (void)m, (void)ud;
    atomic_fetch_add(&g_got, 1);
}

static int bench_fanout(int nsubs, int threads) {
    const char *url = getenv("UPSQUAD_NATS_URL");
    char err[256], subj[128];
    if (!url) return fprintf(stderr, "UPSQUAD_NATS_URL is not set\n"), 2;
    bus_opts o;
    bus_opts_default(&o);
    o.delivery_threads = threads;
    bus *b = NULL;
    if (bus_connect_ex(url, "bench-fanout", &o, &b, err, sizeof err) != BUS_OK)
        return fprintf(stderr, "bus: %s\n", err), 1;
    long thr0 = proc_status("Threads"), rss0 = proc_status("VmRSS");
    bus_sub **subs = calloc((size_t)nsubs, sizeof *subs);
    int made = 0;
    int64_t t0 = now_us();
    for (; made < nsubs; made++) {
        snprintf(subj, sizeof subj, "bench.fan.%d.%d", (int)getpid(), made);
        if (bus_subscribe(b, subj, NULL, fan_cb, NULL, &subs[made], err, sizeof err) != BUS_OK) {
            fprintf(stderr, "subscribe %d: %s\n", made, err);
            break;
        }
    }
    double sub_ms = (double)(now_us() - t0) / 1e3;
    bus_flush(b, 10000);
    t0 = now_us();
    for (int i = 0; i < made; i++) {
        snprintf(subj, sizeof subj, "bench.fan.%d.%d", (int)getpid(), i);
        bus_publish(b, subj, "x", 1);
    }
    bus_flush(b, 10000);
    for (int i = 0; i < 3000 && atomic_load(&g_got) < made; i++)
        usleep(1000);
    double deliver_ms = (double)(now_us() - t0) / 1e3;
    long thr = proc_status("Threads"), rss = proc_status("VmRSS");
    printf("{\"mode\":\"fanout\",\"subs\":%d,\"delivery_threads\":%d,\"delivered\":%ld,"
           "\"threads_before\":%ld,\"threads\":%ld,\"rss_before_kb\":%ld,\"rss_kb\":%ld,"
           "\"subscribe_ms\":%.1f,\"deliver_ms\":%.1f}\n",
           made, threads, atomic_load(&g_got), thr0, thr, rss0, rss, sub_ms, deliver_ms);
    fflush(stdout);
    for (int i = 0; i < made; i++)
        bus_unsubscribe(subs[i]);
    free(subs);
    bus_close(b);
    return 0;
}

/* ---------------------------------------------------------------- relay ---- */

/* backend: every stream detached; one producer thread pushes `count` frames to each, round
 * robin, so that the backend's own threads do not grow with the streams. */
typedef struct bstream {
    rpc_call *call;
    int sent, count, closed;
} bstream;

#define RELAY_MAX 4096
static bstream g_bs[RELAY_MAX];
static atomic_int g_nbs;
static pthread_mutex_t g_bmu = PTHREAD_MUTEX_INITIALIZER;

static void bclose(rpc_call *c, void *ud) {
    (void)c;
    bstream *b = ud;
    pthread_mutex_lock(&g_bmu);
    b->closed = 1;
    pthread_mutex_unlock(&g_bmu);
}

static int backend_stream(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    (void)ud;
    pthread_mutex_lock(&g_bmu);
    int i = atomic_load(&g_nbs);
    if (i >= RELAY_MAX) {
        pthread_mutex_unlock(&g_bmu);
        return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "too many");
    }
    g_bs[i].count = ((const EchoRequest *)req)->count;
    g_bs[i].call = rpc_stream_detach(call, bclose, &g_bs[i]);
    atomic_store(&g_nbs, i + 1);
    pthread_mutex_unlock(&g_bmu);
    return RPC_EDETACHED;
}

static void *backend_producer(void *a) {
    (void)a;
    EchoResponse m = UPSQUAD__TEST__V1__ECHO_RESPONSE__INIT;
    m.text = "relay-bench-payload-0123456789abcdefghijklmnopqrstuvwxyz"; /* ~64 bytes */
    while (!atomic_load(&g_stop)) {
        int n = atomic_load(&g_nbs), busy = 0;
        for (int i = 0; i < n; i++) {
            bstream *b = &g_bs[i];
            if (b->call == NULL || b->sent >= b->count) continue;
            pthread_mutex_lock(&g_bmu);
            int closed = b->closed;
            pthread_mutex_unlock(&g_bmu);
            if (closed) continue;
            for (int k = 0; k < 16 && b->sent < b->count; k++) {
                m.seq = b->sent;
                rpc_frame *f = rpc_frame_encode(&m.base);
                int rc = rpc_stream_push(b->call, f);
                rpc_frame_unref(f);
                if (rc != RPC_OK) break;
                b->sent++;
                busy = 1;
            }
            if (b->sent >= b->count) rpc_stream_finish(b->call, RPC_OK, NULL);
        }
        if (!busy) usleep(200);
    }
    return NULL;
}

/* relay: each call opens an async stream to the backend (parent = the call) and pushes what it
 * reads into its own detached stream; a full queue pauses the read until it drains. */
typedef struct rstream {
    rpc_call *call;
    rpc_astream *up;
    atomic_int paused, closed;
} rstream;

static rstream g_rs[RELAY_MAX];
static atomic_int g_nrs;
static rpc_aclient *g_relay_ac;
static rpc_channel *g_to_backend;

static int relay_msg(rpc_astream *s, const ProtobufCMessage *msg, void *ud) {
    (void)s;
    rstream *r = ud;
    rpc_frame *f = rpc_frame_encode(msg);
    int rc = rpc_stream_push(r->call, f);
    rpc_frame_unref(f);
    if (rc == RPC_ECLOSED) return RPC_ASTREAM_CANCEL;
    /* a frame refused by a full queue would be lost: the queue is sized so that pausing at
     * half keeps room for the one in flight */
    if (rpc_stream_queued(r->call) > 64) {
        atomic_store(&r->paused, 1);
        return RPC_ASTREAM_PAUSE;
    }
    return RPC_ASTREAM_CONTINUE;
}

static void relay_done(rpc_astream *s, const rpc_status *st, void *ud) {
    (void)s;
    rstream *r = ud;
    rpc_stream_finish(r->call, st->code, st->message);
}

static void relay_closed(rpc_call *c, void *ud) {
    (void)c;
    rstream *r = ud;
    atomic_store(&r->closed, 1);
    if (r->up) rpc_astream_cancel(r->up);
}

static int relay_stream(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    (void)ud;
    int i = atomic_fetch_add(&g_nrs, 1);
    if (i >= RELAY_MAX) return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "too many");
    rstream *r = &g_rs[i];
    r->call = rpc_stream_detach(call, relay_closed, r);
    if (r->call == NULL) return RPC_CANCELLED;
    rpc_call_opts o = {.parent = call};
    rpc_astream *up = NULL;
    if (rpc_astream_open(g_relay_ac, g_to_backend, PATH("PublicStream"), req, RESP_DESC, &o,
                         relay_msg, relay_done, r, &up) != RPC_OK) {
        rpc_stream_finish(r->call, RPC_UNAVAILABLE, "backend");
        return RPC_EDETACHED;
    }
    r->up = up;
    return RPC_EDETACHED;
}

/* resumes relayed streams whose queue drained (no drain callback in the server API) */
static void *relay_resumer(void *a) {
    (void)a;
    while (!atomic_load(&g_stop)) {
        int n = atomic_load(&g_nrs);
        for (int i = 0; i < n && i < RELAY_MAX; i++) {
            rstream *r = &g_rs[i];
            if (atomic_load(&r->paused) && r->up && rpc_stream_queued(r->call) < 16) {
                atomic_store(&r->paused, 0);
                rpc_astream_resume(r->up);
            }
        }
        usleep(500);
    }
    return NULL;
}

static atomic_long g_msgs, g_done, g_bad;

static int read_msg(rpc_astream *s, const ProtobufCMessage *m, void *ud) {
    (void)s, (void)m, (void)ud;
    atomic_fetch_add(&g_msgs, 1);
    return RPC_ASTREAM_CONTINUE;
}

static void read_done(rpc_astream *s, const rpc_status *st, void *ud) {
    (void)s, (void)ud;
    if (st->code != RPC_OK) atomic_fetch_add(&g_bad, 1);
    atomic_fetch_add(&g_done, 1);
}

static rpc_server *serve(const rpc_method *m, int stream_queue, char *target) {
    char err[256];
    rpc_server *s = NULL;
    rpc_server_opts o = {.addr = "127.0.0.1:0",
                         .stream_workers = 4,
                         .max_streams = RELAY_MAX,
                         .stream_queue = stream_queue,
                         .max_concurrent_streams = RELAY_MAX};
    if (rpc_server_new(&o, &s, err, sizeof err) || rpc_server_add(s, m, 1) ||
        rpc_server_start(s, err, sizeof err)) {
        fprintf(stderr, "server: %s\n", err);
        exit(1);
    }
    sprintf(target, "127.0.0.1:%d", rpc_server_port(s));
    return s;
}

static int bench_relay(int nstreams, int count, int direct) {
    char bt[64], rt[64], err[256];
    rpc_method bm = {
        PATH("PublicStream"), RPC_SERVER_STREAM, RPC_AUTH_NONE, REQ_DESC, RESP_DESC, NULL,
        backend_stream};
    rpc_method rm = {
        PATH("PublicStream"), RPC_SERVER_STREAM, RPC_AUTH_NONE, REQ_DESC, RESP_DESC, NULL,
        relay_stream};
    long thr_start = proc_status("Threads");
    rpc_server *backend = serve(&bm, 256, bt), *relay = NULL;
    pthread_t prod, res;
    pthread_create(&prod, NULL, backend_producer, NULL);
    rpc_channel_opts co = {.target = bt};
    rpc_channel_new(&co, &g_to_backend, err, sizeof err);
    if (!direct) {
        rpc_aclient_new(2, &g_relay_ac);
        relay = serve(&rm, 128, rt);
        pthread_create(&res, NULL, relay_resumer, NULL);
    }
    rpc_channel *ch = NULL;
    rpc_channel_opts co2 = {.target = direct ? bt : rt};
    rpc_channel_new(&co2, &ch, err, sizeof err);
    rpc_aclient *reader = NULL;
    rpc_aclient_new(2, &reader);
    long thr_idle = proc_status("Threads");
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    req.count = count;
    rpc_call_opts o = {.timeout_ms = 120000};
    rpc_astream **ss = calloc((size_t)nstreams, sizeof *ss);
    double cpu0 = cpu_us();
    int64_t t0 = now_us();
    for (int i = 0; i < nstreams; i++)
        rpc_astream_open(reader, ch, PATH("PublicStream"), &req.base, RESP_DESC, &o, read_msg,
                         read_done, NULL, &ss[i]);
    long thr_peak = 0;
    while (atomic_load(&g_done) < nstreams && now_us() - t0 < 110 * 1000000LL) {
        long t = proc_status("Threads");
        if (t > thr_peak) thr_peak = t;
        usleep(5000);
    }
    double secs = (double)(now_us() - t0) / 1e6;
    /* the process's CPU over the run (servers, relay, reader: all in here) */
    double cpu = cpu_us() - cpu0;
    printf("{\"mode\":\"relay\",\"direct\":%d,\"streams\":%d,\"count\":%d,\"messages\":%ld,"
           "\"messages_per_s\":%.1f,\"failed_streams\":%ld,\"threads_start\":%ld,"
           "\"threads_idle\":%ld,\"threads_peak\":%ld,\"cpu_us_per_msg\":%.2f}\n",
           direct, nstreams, count, atomic_load(&g_msgs), atomic_load(&g_msgs) / secs,
           atomic_load(&g_bad) + (nstreams - atomic_load(&g_done)), thr_start, thr_idle, thr_peak,
           atomic_load(&g_msgs) ? cpu / (double)atomic_load(&g_msgs) : 0.0);
    fflush(stdout);
    for (int i = 0; i < nstreams; i++)
        if (ss[i]) rpc_astream_unref(ss[i]);
    free(ss);
    atomic_store(&g_stop, 1);
    pthread_join(prod, NULL);
    if (!direct) pthread_join(res, NULL);
    rpc_channel_free(ch);
    if (relay) rpc_server_shutdown(relay, 500);
    rpc_server_shutdown(backend, 500);
    _exit(0); /* the servers' detached streams and readers end with the process */
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: libcommon-conc pg|pgdirect|fanout|relay [options]\n");
        return 2;
    }
    log_init("libcommon-conc", LOG_ERROR);
    const char *mode = argv[1];
    int workers = atoi(arg(argc, argv, "--workers", "4"));
    double duration = atof(arg(argc, argv, "--duration", "2"));
    if (workers < 1 || workers > 32) workers = 4;
    if (strcmp(mode, "pg") == 0) return bench_pg(workers, duration);
    if (strcmp(mode, "pgdirect") == 0) return bench_pgdirect(workers, duration);
    if (strcmp(mode, "fanout") == 0)
        return bench_fanout(atoi(arg(argc, argv, "--subs", "10000")),
                            atoi(arg(argc, argv, "--delivery-threads", "2")));
    if (strcmp(mode, "relay") == 0) {
        int n = atoi(arg(argc, argv, "--streams", "1000"));
        return bench_relay(n < 1 || n > RELAY_MAX ? 1000 : n,
                           atoi(arg(argc, argv, "--count", "100")),
                           atoi(arg(argc, argv, "--direct", "1")));
    }
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
}
