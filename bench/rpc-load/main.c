/* Load generator for the echo servers (bench/rpc-bare-echo and tests/support/echo-server), on
 * the gRPC C core client API, so that the client costs the same against either server.
 *
 *   rpc-load --target HOST:PORT --mode unary|stream --concurrency N --duration S
 *            [--warmup S] [--count M] [--payload B] [--token T] [--threads K]
 *            [--channels C] [--text STR] [--server-pid PID]
 *
 * unary:  N independent call loops, each with one PublicEcho call outstanding; every call is
 *         one batch (one completion). Latency goes into a log-linear histogram (bounded memory,
 *         ~1.5% resolution).
 * stream: N loops, each holding one PublicStream of --count messages open and opening the next
 *         one when it ends; messages are counted as they arrive. Streams still open when the
 *         measurement ends are cancelled.
 * Both:   only completions inside [warmup, warmup + duration] count. Every response is decoded
 *         and checked (text, payload size, stream order and length). --token switches to the
 *         authenticated methods (Echo/Stream) with "authorization: Bearer T".
 * With --server-pid, the server's CPU time (utime + stime from /proc) over the window is reported
 * per call or per message: on a small machine where client and server share the cores, that is
 * the figure that compares two servers best; with it, the server's context switches per call or
 * message (a hand-off between threads costs one).
 * Prints one line of JSON on stdout; exit status 0 when there were completions and no errors. */
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include "upsquad/test/v1/echo.pb-c.h"

#define MAX_THREADS 8
#define MAX_CHANNELS 64
#define MAX_CONCURRENCY 4096
#define UNARY_DEADLINE_MS 10000
#define CONNECT_TIMEOUT_MS 5000
/* After the measurement ends, calls still open are cancelled; this long after, the run is
 * abandoned (a server that ignores cancellation cannot hang the benchmark). */
#define DRAIN_LIMIT_NS (10 * 1000000000LL)
#define TICK_MS 100

/* ---- log-linear histogram of nanoseconds: 64 linear sub-buckets per power of two ---- */
#define H_SUB_BITS 6
#define H_SUB (1 << H_SUB_BITS)
#define H_BUCKETS ((64 - H_SUB_BITS + 1) * H_SUB)

typedef struct hist {
    uint64_t n[H_BUCKETS];
    uint64_t total;
    uint64_t max;
} hist;

static size_t hist_index(uint64_t v) {
    if (v < H_SUB) return (size_t)v;
    int e = 63 - __builtin_clzll(v);
    return (size_t)(e - H_SUB_BITS + 1) * H_SUB + (size_t)(v >> (e - H_SUB_BITS)) - H_SUB;
}

/* Midpoint of a bucket's value range. */
static double hist_value(size_t i) {
    if (i < H_SUB) return (double)i;
    size_t block = i / H_SUB, sub = i % H_SUB;
    int shift = (int)block - 1;
    double lo = (double)((uint64_t)(sub + H_SUB) << shift);
    return lo + (double)((uint64_t)1 << shift) / 2.0;
}

static void hist_add(hist *h, uint64_t v) {
    h->n[hist_index(v)]++;
    h->total++;
    if (v > h->max) h->max = v;
}

static void hist_merge(hist *into, const hist *h) {
    for (size_t i = 0; i < H_BUCKETS; i++)
        into->n[i] += h->n[i];
    into->total += h->total;
    if (h->max > into->max) into->max = h->max;
}

static double hist_quantile_ms(const hist *h, double q) {
    if (h->total == 0) return 0;
    uint64_t rank = (uint64_t)(q * (double)h->total);
    if (rank >= h->total) rank = h->total - 1;
    uint64_t seen = 0;
    for (size_t i = 0; i < H_BUCKETS; i++) {
        seen += h->n[i];
        if (seen > rank) return hist_value(i) / 1e6;
    }
    return (double)h->max / 1e6;
}

/* ---- configuration ---- */

typedef struct config {
    const char *target, *mode, *token, *text;
    int stream, concurrency, threads, channels, server_pid;
    double duration_s, warmup_s;
    int32_t count, payload;
} config;

/* ---- run state ---- */

enum { EV_UNARY, EV_MSG, EV_STATUS };

typedef struct loop loop;
typedef struct worker worker;

typedef struct ev {
    int kind;
    loop *l;
} ev;

struct loop {
    worker *w;
    grpc_channel *ch;
    void *reg;
    grpc_call *call;
    ev ev_unary, ev_msg, ev_status;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    grpc_byte_buffer *send_bb, *recv_bb;
    uint64_t start_ns, last_msg_ns;
    int pending;   /* stream: batches in flight (message reads, status) */
    int32_t seq;   /* stream: next expected seq */
    int cancelled; /* we cancelled it at the end of the run */
    int done;      /* no more calls on this loop */
};

struct worker {
    grpc_completion_queue *cq;
    pthread_t thread;
    loop *loops;
    int nloops, active;
    hist lat; /* unary: call latency; stream: gap between messages */
    uint64_t calls, msgs, msg_bytes, streams, errors;
    int cancel_sent;
};

static config g_cfg;
static grpc_slice g_req;       /* the encoded request, shared by every call */
static grpc_metadata g_auth;   /* authorization metadata when --token is set */
static uint64_t g_warm_end_ns; /* completions from here on count */
static uint64_t g_end_ns;      /* ... up to here */
static size_t g_text_len;
static pthread_mutex_t g_err_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_err_printed;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int in_window(uint64_t t) {
    return t >= g_warm_end_ns && t <= g_end_ns;
}

/* Counts an error seen inside the window and reports the first one on stderr. */
static void note_error(worker *w, uint64_t t, const char *what, grpc_status_code code,
                       const grpc_slice *details) {
    if (in_window(t)) w->errors++;
    pthread_mutex_lock(&g_err_mu);
    if (!g_err_printed) {
        g_err_printed = 1;
        int dl = details ? (int)GRPC_SLICE_LENGTH(*details) : 0;
        fprintf(stderr, "rpc-load: %s (status %d%s%.*s)\n", what, (int)code, dl ? ": " : "", dl,
                dl ? (const char *)GRPC_SLICE_START_PTR(*details) : "");
    }
    pthread_mutex_unlock(&g_err_mu);
}

/* Decodes a response and checks it against the request. 0 or -1. */
static int check_response(grpc_byte_buffer *bb, int32_t want_seq) {
    grpc_byte_buffer_reader r;
    int rc = -1;
    if (!bb || !grpc_byte_buffer_reader_init(&r, bb)) return -1;
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    Upsquad__Test__V1__EchoResponse *resp = upsquad__test__v1__echo_response__unpack(
        NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    grpc_slice_unref(s);
    if (!resp) return -1;
    if (resp->seq == want_seq && resp->payload.len == (size_t)g_cfg.payload &&
        strlen(resp->text) == g_text_len && memcmp(resp->text, g_cfg.text, g_text_len) == 0)
        rc = 0;
    upsquad__test__v1__echo_response__free_unpacked(resp, NULL);
    return rc;
}

static void call_reset(loop *l) {
    if (l->call) grpc_call_unref(l->call);
    l->call = NULL;
    grpc_metadata_array_destroy(&l->init_md);
    grpc_metadata_array_destroy(&l->trail_md);
    grpc_slice_unref(l->details);
    l->details = grpc_empty_slice();
    if (l->send_bb) grpc_byte_buffer_destroy(l->send_bb);
    if (l->recv_bb) grpc_byte_buffer_destroy(l->recv_bb);
    l->send_bb = l->recv_bb = NULL;
}

static void loop_finish(loop *l) {
    l->done = 1;
    l->w->active--;
}

/* Starts the loop's next call: one batch for unary; for a stream, the request with the first
 * read, and the status in its own batch. */
static void call_start(loop *l) {
    gpr_timespec deadline =
        g_cfg.stream ? gpr_inf_future(GPR_CLOCK_MONOTONIC)
                     : gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                    gpr_time_from_millis(UNARY_DEADLINE_MS, GPR_TIMESPAN));
    l->call = grpc_channel_create_registered_call(l->ch, NULL, GRPC_PROPAGATE_DEFAULTS, l->w->cq,
                                                  l->reg, deadline, NULL);
    grpc_metadata_array_init(&l->init_md);
    grpc_metadata_array_init(&l->trail_md);
    l->send_bb = grpc_raw_byte_buffer_create(&g_req, 1);
    l->seq = 0;
    l->start_ns = l->last_msg_ns = now_ns();

    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (g_cfg.token) {
        ops[n].data.send_initial_metadata.count = 1;
        ops[n].data.send_initial_metadata.metadata = &g_auth;
    }
    n++;
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = l->send_bb;
    ops[n++].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n++].data.recv_initial_metadata.recv_initial_metadata = &l->init_md;
    ops[n].op = GRPC_OP_RECV_MESSAGE;
    ops[n++].data.recv_message.recv_message = &l->recv_bb;
    grpc_op *status_op = &ops[n];
    status_op->op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    status_op->data.recv_status_on_client.trailing_metadata = &l->trail_md;
    status_op->data.recv_status_on_client.status = &l->status;
    status_op->data.recv_status_on_client.status_details = &l->details;
    grpc_call_error e;
    if (!g_cfg.stream) {
        e = grpc_call_start_batch(l->call, ops, n + 1, &l->ev_unary, NULL);
    } else {
        e = grpc_call_start_batch(l->call, ops, n, &l->ev_msg, NULL);
        if (e == GRPC_CALL_OK)
            e = grpc_call_start_batch(l->call, status_op, 1, &l->ev_status, NULL);
        l->pending = e == GRPC_CALL_OK ? 2 : 0;
    }
    if (e != GRPC_CALL_OK) {
        fprintf(stderr, "rpc-load: start_batch: %s\n", grpc_call_error_to_string(e));
        exit(1);
    }
}

static void on_unary(loop *l, int ok) {
    worker *w = l->w;
    uint64_t t = now_ns();
    if (!ok || l->status != GRPC_STATUS_OK)
        note_error(w, t, "call failed", ok ? l->status : GRPC_STATUS_UNKNOWN, &l->details);
    else if (check_response(l->recv_bb, 0) != 0)
        note_error(w, t, "unexpected response", l->status, NULL);
    else if (in_window(t)) {
        w->calls++;
        hist_add(&w->lat, t - l->start_ns);
    }
    call_reset(l);
    if (t < g_end_ns)
        call_start(l);
    else
        loop_finish(l);
}

static void stream_read_next(loop *l) {
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &l->recv_bb;
    if (grpc_call_start_batch(l->call, &op, 1, &l->ev_msg, NULL) != GRPC_CALL_OK) l->pending--;
}

static void stream_end_if_idle(loop *l) {
    if (l->pending > 0) return;
    call_reset(l);
    l->cancelled = 0;
    if (now_ns() < g_end_ns)
        call_start(l);
    else
        loop_finish(l);
}

static void on_stream_msg(loop *l, int ok) {
    worker *w = l->w;
    uint64_t t = now_ns();
    if (!ok || !l->recv_bb) { /* end of stream (or failure): the status tells which */
        l->pending--;
        stream_end_if_idle(l);
        return;
    }
    size_t len = grpc_byte_buffer_length(l->recv_bb);
    if (check_response(l->recv_bb, l->seq) != 0) {
        note_error(w, t, "unexpected stream message", GRPC_STATUS_OK, NULL);
        grpc_call_cancel(l->call, NULL);
        l->cancelled = 1;
    } else if (in_window(t)) {
        w->msgs++;
        w->msg_bytes += len;
        hist_add(&w->lat, t - l->last_msg_ns);
    }
    l->seq++;
    l->last_msg_ns = t;
    grpc_byte_buffer_destroy(l->recv_bb);
    l->recv_bb = NULL;
    stream_read_next(l);
    stream_end_if_idle(l);
}

static void on_stream_status(loop *l, int ok) {
    worker *w = l->w;
    uint64_t t = now_ns();
    l->pending--;
    if (!l->cancelled) {
        if (!ok || l->status != GRPC_STATUS_OK)
            note_error(w, t, "stream failed", ok ? l->status : GRPC_STATUS_UNKNOWN, &l->details);
        else if (l->seq != g_cfg.count)
            note_error(w, t, "stream ended early", l->status, NULL);
        else if (in_window(t))
            w->streams++;
    }
    stream_end_if_idle(l);
}

/* At the end of the window, open streams are cancelled; past the drain limit, everything. */
static void cancel_open_calls(worker *w, int all) {
    for (int i = 0; i < w->nloops; i++) {
        loop *l = &w->loops[i];
        if (l->done || !l->call || (!g_cfg.stream && !all)) continue;
        l->cancelled = 1;
        grpc_call_cancel(l->call, NULL);
    }
}

static void *worker_main(void *arg) {
    worker *w = arg;
    for (int i = 0; i < w->nloops; i++)
        call_start(&w->loops[i]);
    while (w->active > 0) {
        grpc_event e = grpc_completion_queue_next(
            w->cq,
            gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(TICK_MS, GPR_TIMESPAN)),
            NULL);
        if (e.type == GRPC_OP_COMPLETE) {
            ev *x = e.tag;
            if (x->kind == EV_UNARY)
                on_unary(x->l, e.success);
            else if (x->kind == EV_MSG)
                on_stream_msg(x->l, e.success);
            else
                on_stream_status(x->l, e.success);
        }
        uint64_t t = now_ns();
        if (t >= g_end_ns && w->cancel_sent == 0) {
            cancel_open_calls(w, 0);
            w->cancel_sent = 1;
        }
        if (t >= g_end_ns + DRAIN_LIMIT_NS && w->cancel_sent == 1) {
            fprintf(stderr, "rpc-load: calls still open %ds after the end; cancelling\n",
                    (int)(DRAIN_LIMIT_NS / 1000000000LL));
            cancel_open_calls(w, 1);
            w->cancel_sent = 2;
        }
    }
    return NULL;
}

/* ---- set-up ---- */

static void usage(void) {
    fprintf(stderr, "usage: rpc-load --target HOST:PORT --mode unary|stream --concurrency N "
                    "--duration S [--warmup S] [--count M] [--payload B] [--token T] "
                    "[--threads K] [--channels C] [--text STR] [--server-pid PID]\n");
    exit(2);
}

static double num_arg(const char *name, const char *v, double lo, double hi) {
    char *end;
    errno = 0;
    double d = strtod(v, &end);
    if (errno || end == v || *end || d < lo || d > hi) {
        fprintf(stderr, "rpc-load: %s: expected a number in [%g, %g], got '%s'\n", name, lo, hi, v);
        exit(2);
    }
    return d;
}

static void parse_args(int argc, char **argv, config *c) {
    *c = (config){.mode = "unary",
                  .text = "hello",
                  .concurrency = 4,
                  .threads = 1,
                  .channels = 1,
                  .duration_s = 5,
                  .warmup_s = 1,
                  .count = 100000};
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) usage();
        i++;
        if (!strcmp(k, "--target"))
            c->target = v;
        else if (!strcmp(k, "--mode"))
            c->mode = v;
        else if (!strcmp(k, "--token"))
            c->token = v;
        else if (!strcmp(k, "--text"))
            c->text = v;
        else if (!strcmp(k, "--concurrency"))
            c->concurrency = (int)num_arg(k, v, 1, MAX_CONCURRENCY);
        else if (!strcmp(k, "--threads"))
            c->threads = (int)num_arg(k, v, 1, MAX_THREADS);
        else if (!strcmp(k, "--channels"))
            c->channels = (int)num_arg(k, v, 1, MAX_CHANNELS);
        else if (!strcmp(k, "--duration"))
            c->duration_s = num_arg(k, v, 0.1, 3600);
        else if (!strcmp(k, "--warmup"))
            c->warmup_s = num_arg(k, v, 0, 3600);
        else if (!strcmp(k, "--count"))
            c->count = (int32_t)num_arg(k, v, 1, INT32_MAX);
        else if (!strcmp(k, "--server-pid"))
            c->server_pid = (int)num_arg(k, v, 1, INT32_MAX);
        else if (!strcmp(k, "--payload"))
            c->payload = (int32_t)num_arg(k, v, 0, 1 << 20);
        else
            usage();
    }
    if (!c->target) usage();
    if (strcmp(c->mode, "unary") && strcmp(c->mode, "stream")) usage();
    c->stream = !strcmp(c->mode, "stream");
}

static int wait_ready(grpc_channel *ch) {
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                         gpr_time_from_millis(CONNECT_TIMEOUT_MS, GPR_TIMESPAN));
    int rc = -1, tag;
    for (;;) {
        grpc_connectivity_state st = grpc_channel_check_connectivity_state(ch, 1);
        if (st == GRPC_CHANNEL_READY) {
            rc = 0;
            break;
        }
        grpc_channel_watch_connectivity_state(ch, st, deadline, cq, &tag);
        grpc_event e =
            grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (!e.success) break; /* deadline passed */
    }
    grpc_completion_queue_shutdown(cq);
    grpc_completion_queue_destroy(cq);
    return rc;
}

static void encode_request(void) {
    Upsquad__Test__V1__EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    req.text = (char *)g_cfg.text;
    req.count = g_cfg.stream ? g_cfg.count : 0;
    req.payload_bytes = g_cfg.payload;
    size_t n = upsquad__test__v1__echo_request__get_packed_size(&req);
    g_req = grpc_slice_malloc(n);
    upsquad__test__v1__echo_request__pack(&req, GRPC_SLICE_START_PTR(g_req));
    g_text_len = strlen(g_cfg.text);
}

static double cpu_seconds(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

/* utime + stime of every thread of `pid` (fields 14 and 15 of /proc/PID/stat); -1 if unknown. */
static double proc_cpu_seconds(int pid) {
    char path[64], buf[1024];
    unsigned long long ut, st;
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    if (!p ||
        sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* Context switches of every thread of `pid` (voluntary + involuntary, from each
 * /proc/PID/task/TID/status): a thread handing a call to another costs one, which is what separates
 * servers on a small machine. -1 if unknown. */
static long long proc_ctx_switches(int pid) {
    char path[96], line[256];
    long long total = 0, v;
    snprintf(path, sizeof path, "/proc/%d/task", pid);
    DIR *d = opendir(path);
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "/proc/%d/task/%.16s/status", pid, e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue; /* the thread ended meanwhile */
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "voluntary_ctxt_switches: %lld", &v) == 1 ||
                sscanf(line, "nonvoluntary_ctxt_switches: %lld", &v) == 1)
                total += v;
        fclose(f);
    }
    closedir(d);
    return total;
}

static void sleep_until(uint64_t t) {
    struct timespec ts = {(time_t)(t / 1000000000ull), (long)(t % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

/* The figures cover the measured window; server_cpu_s < 0 / server_cs < 0: not measured. */
static void report(const worker *ws, int nw, double client_cpu_s, double server_cpu_s,
                   long long server_cs) {
    static hist h; /* static: 30 KB */
    uint64_t calls = 0, msgs = 0, bytes = 0, streams = 0, errors = 0;
    for (int i = 0; i < nw; i++) {
        hist_merge(&h, &ws[i].lat);
        calls += ws[i].calls;
        msgs += ws[i].msgs;
        bytes += ws[i].msg_bytes;
        streams += ws[i].streams;
        errors += ws[i].errors;
    }
    double d = g_cfg.duration_s, ops = (double)(g_cfg.stream ? msgs : calls);
    const char *per = g_cfg.stream ? "msg" : "call";
    char server[192] = "";
    if (server_cpu_s >= 0 && server_cs >= 0)
        snprintf(server, sizeof server,
                 ",\"server_cores\":%.2f,\"server_us_per_%s\":%.2f,\"server_cs_per_%s\":%.3f",
                 server_cpu_s / d, per, ops > 0 ? server_cpu_s * 1e6 / ops : 0, per,
                 ops > 0 ? (double)server_cs / ops : 0);
    if (!g_cfg.stream) {
        printf("{\"mode\":\"unary\",\"concurrency\":%d,\"duration_s\":%.1f,\"payload\":%d,"
               "\"calls\":%llu,\"calls_per_s\":%.0f,\"p50_ms\":%.3f,\"p90_ms\":%.3f,"
               "\"p99_ms\":%.3f,\"max_ms\":%.3f,\"errors\":%llu,\"client_cores\":%.2f%s}\n",
               g_cfg.concurrency, d, g_cfg.payload, (unsigned long long)calls, ops / d,
               hist_quantile_ms(&h, 0.5), hist_quantile_ms(&h, 0.9), hist_quantile_ms(&h, 0.99),
               (double)h.max / 1e6, (unsigned long long)errors, client_cpu_s / d, server);
    } else {
        printf("{\"mode\":\"stream\",\"concurrency\":%d,\"duration_s\":%.1f,\"count\":%d,"
               "\"payload\":%d,\"streams_completed\":%llu,\"messages\":%llu,"
               "\"messages_per_s\":%.0f,\"msg_bytes\":%.0f,\"mb_per_s\":%.2f,"
               "\"gap_p50_ms\":%.4f,\"gap_p99_ms\":%.3f,\"gap_max_ms\":%.3f,\"errors\":%llu,"
               "\"client_cores\":%.2f%s}\n",
               g_cfg.concurrency, d, g_cfg.count, g_cfg.payload, (unsigned long long)streams,
               (unsigned long long)msgs, ops / d, msgs ? (double)bytes / (double)msgs : 0,
               (double)bytes / d / 1e6, hist_quantile_ms(&h, 0.5), hist_quantile_ms(&h, 0.99),
               (double)h.max / 1e6, (unsigned long long)errors, client_cpu_s / d, server);
    }
    fflush(stdout);
}

int main(int argc, char **argv) {
    static worker ws[MAX_THREADS];
    static grpc_channel *chans[MAX_CHANNELS];
    static void *regs[MAX_CHANNELS];
    int rc = 1;
    parse_args(argc, argv, &g_cfg);
    grpc_init();
    encode_request();
    if (g_cfg.token) {
        static char bearer[4096];
        snprintf(bearer, sizeof bearer, "Bearer %s", g_cfg.token);
        g_auth.key = grpc_slice_from_static_string("authorization");
        g_auth.value = grpc_slice_from_static_string(bearer);
    }
    const char *path = g_cfg.stream ? (g_cfg.token ? "/upsquad.test.v1.EchoService/Stream"
                                                   : "/upsquad.test.v1.EchoService/PublicStream")
                                    : (g_cfg.token ? "/upsquad.test.v1.EchoService/Echo"
                                                   : "/upsquad.test.v1.EchoService/PublicEcho");
    /* Retries off: the retry filter costs per call and a benchmark wants failures visible. */
    grpc_arg arg = {GRPC_ARG_INTEGER, GRPC_ARG_ENABLE_RETRIES, {.integer = 0}};
    grpc_channel_args args = {1, &arg};
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    for (int i = 0; i < g_cfg.channels; i++) {
        /* a distinct arg per channel keeps the core from sharing one connection */
        grpc_arg a2[2] = {arg, {GRPC_ARG_INTEGER, "upsquad.bench.channel", {.integer = i}}};
        grpc_channel_args args2 = {2, a2};
        chans[i] = grpc_channel_create(g_cfg.target, creds, g_cfg.channels > 1 ? &args2 : &args);
        regs[i] = grpc_channel_register_call(chans[i], path, NULL, NULL);
        if (wait_ready(chans[i]) != 0) {
            fprintf(stderr, "rpc-load: cannot connect to %s\n", g_cfg.target);
            goto done;
        }
    }

    int nw = g_cfg.threads < g_cfg.concurrency ? g_cfg.threads : g_cfg.concurrency;
    loop *loops = calloc((size_t)g_cfg.concurrency, sizeof *loops);
    if (!loops) goto done;
    for (int i = 0; i < nw; i++)
        ws[i].cq = grpc_completion_queue_create_for_next(NULL);
    /* each thread drives a contiguous run of loops; loops go to channels round-robin */
    for (int i = 0, k = 0; i < nw; i++) {
        worker *w = &ws[i];
        w->loops = &loops[k];
        w->nloops = w->active = g_cfg.concurrency / nw + (i < g_cfg.concurrency % nw);
        for (int j = 0; j < w->nloops; j++, k++) {
            loop *l = &loops[k];
            l->w = w;
            l->ch = chans[k % g_cfg.channels];
            l->reg = regs[k % g_cfg.channels];
            l->ev_unary = (ev){EV_UNARY, l};
            l->ev_msg = (ev){EV_MSG, l};
            l->ev_status = (ev){EV_STATUS, l};
            l->details = grpc_empty_slice();
        }
    }
    uint64_t t0 = now_ns();
    g_warm_end_ns = t0 + (uint64_t)(g_cfg.warmup_s * 1e9);
    g_end_ns = g_warm_end_ns + (uint64_t)(g_cfg.duration_s * 1e9);
    for (int i = 0; i < nw; i++)
        pthread_create(&ws[i].thread, NULL, worker_main, &ws[i]);
    /* this thread only samples CPU time at the edges of the window */
    sleep_until(g_warm_end_ns);
    int pid = g_cfg.server_pid;
    double c0 = cpu_seconds(), s0 = pid ? proc_cpu_seconds(pid) : -1;
    long long x0 = pid ? proc_ctx_switches(pid) : -1;
    sleep_until(g_end_ns);
    double c1 = cpu_seconds(), s1 = pid ? proc_cpu_seconds(pid) : -1;
    long long x1 = pid ? proc_ctx_switches(pid) : -1;
    for (int i = 0; i < nw; i++)
        pthread_join(ws[i].thread, NULL);
    report(ws, nw, c1 - c0, s0 >= 0 && s1 >= 0 ? s1 - s0 : -1, x0 >= 0 && x1 >= 0 ? x1 - x0 : -1);
    uint64_t good = 0, errors = 0;
    for (int i = 0; i < nw; i++) {
        good += ws[i].calls + ws[i].msgs;
        errors += ws[i].errors;
    }
    rc = good > 0 && errors == 0 ? 0 : 1;
    for (int i = 0; i < nw; i++) {
        grpc_completion_queue_shutdown(ws[i].cq);
        while (
            grpc_completion_queue_next(ws[i].cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
            GRPC_QUEUE_SHUTDOWN) {
        }
        grpc_completion_queue_destroy(ws[i].cq);
    }
    for (int i = 0; i < g_cfg.concurrency; i++)
        grpc_slice_unref(loops[i].details);
    free(loops);
done:
    for (int i = 0; i < g_cfg.channels; i++)
        if (chans[i]) grpc_channel_destroy(chans[i]);
    grpc_channel_credentials_release(creds);
    grpc_slice_unref(g_req);
    grpc_shutdown_blocking();
    return rc;
}
